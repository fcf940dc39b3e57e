"""Muon: momentum orthogonalized by Newton–Schulz for the hidden matrices, AdamW for the rest.

Which parameters Muon steps (``muon_parameter``): every parameter of two or more dims inside a
numbered block (the attention and MLP matrices, the stacked routed experts, LoRA's adapters),
except the names ``optim.muon_adamw_params`` matches (the MoE router by default). AdamW steps the
rest: embeddings, the output head, norms, biases, the router — as Muon's authors and Moonlight
do. One optimizer holds both, so the schedule, clipping, checkpoints (DCP) and the resume checks
see one.

A Muon step, per matrix: the momentum ``m ← μ·m + g`` and its Nesterov form ``u = g + μ·m`` (``u
= m`` without); ``O`` ≈ the orthogonal factor of ``u`` (``orthogonalize.newton_schulz``, on one
owner rank: ``orthogonalize.Orthogonalizer``); then ``W ← W·(1 − lr·λ) − lr·s·O``, with ``s`` by
``optim.muon_scale``: ``match_adamw`` is Moonlight's ``0.2·√max(rows, cols)``, which gives the
update the RMS of AdamW's, so AdamW's learning rate and weight decay carry over; ``shape`` is
Keller Jordan's ``√max(1, rows/cols)`` (rows = out features, as ``nn.Linear`` and the stacked
experts ``[experts, out, in]`` store them), which wants a larger learning rate.
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from composer3d.optim.orthogonalize import Orthogonalizer

# Moonlight's RMS of AdamW's update that a match_adamw Muon update takes
ADAMW_RMS = 0.2


def muon_parameter(name: str, param: torch.Tensor, adamw_patterns: list[str]) -> bool:
    """Whether Muon steps the parameter ``name``: ≥ 2-D inside a numbered block
    ("layers.3.…", Hugging Face's "model.layers.3.…"), not matched by ``adamw_patterns``."""
    in_block = any(part.isdigit() for part in name.split("."))
    return (
        param.ndim >= 2
        and in_block
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in adamw_patterns)
    )


def update_scale(rows: int, cols: int, scale: str) -> float:
    """What the orthogonalized update of a rows × cols matrix is multiplied by
    (``optim.muon_scale``)."""
    if scale == "match_adamw":
        return ADAMW_RMS * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Optimizer):
    """Parameter groups with ``muon`` True are stepped by Muon (their state: ``momentum_buffer``),
    the others by AdamW (``step``, ``exp_avg``, ``exp_avg_sq``, as ``torch.optim.AdamW`` keeps
    them). The learning rate and weight decay are each group's; Muon's own settings are the
    optimizer's, so a resumed run steps with its config's, not the checkpoint's."""

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        ns_dtype: torch.dtype,
        scale: str,
        bucket_bytes: int,
        slices: list[tuple] | None = None,
    ):
        """``slices``: under ZeRO-1, where the Muon groups' parameters are each rank's slices of
        the model's, each one's group, ranges and parameter shape
        (``orthogonalize.Orthogonalizer``)."""
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.momentum, self.nesterov, self.scale = momentum, nesterov, scale
        self.muon_params = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        self.orthogonalizer = Orthogonalizer(
            self.muon_params, ns_steps, ns_dtype, bucket_bytes, slices
        )
        shapes = [s[2] for s in slices] if slices else [p.shape for p in self.muon_params]
        self._scales = [update_scale(*shape[-2:], scale) for shape in shapes]
        adamw_params = [p for g in self.param_groups if not g["muon"] for p in g["params"]]
        # fused where every device has the kernels (as optim.implementation=auto picks for AdamW
        # off the accelerator), else foreach
        self._fused = bool(adamw_params) and {p.device.type for p in adamw_params} <= set(
            _get_fused_kernels_supported_devices()
        )

    def initial_state(self, param: torch.Tensor) -> dict:
        """A parameter's state before its first step (what a checkpoint loads into)."""
        if any(param is p for p in self.muon_params):
            return {"momentum_buffer": torch.zeros_like(param)}
        # as torch.optim.AdamW keeps it: the step count on the parameter's device for fused
        return {
            "step": torch.zeros(
                (), dtype=torch.float32, device=param.device if self._fused else "cpu"
            ),
            "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param),
        }

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw(group)
        self._muon()
        return loss

    def _muon(self) -> None:
        """Every Muon parameter's update, orthogonalized together (the collectives are the
        optimizer's, so each rank calls them alike; a parameter without a gradient sends zeros
        and is not updated, as torch's optimizers skip it)."""
        updates = []
        for param in self.muon_params:
            state = self.state[param]
            if not state:
                state.update(self.initial_state(param))
            grad = _local(param.grad) if param.grad is not None else None
            buffer = _local(state["momentum_buffer"])
            if grad is None:
                updates.append(torch.zeros_like(buffer))
                continue
            buffer.mul_(self.momentum).add_(grad)
            updates.append(grad.add(buffer, alpha=self.momentum) if self.nesterov else buffer)
        if not updates:
            return
        orthogonal = self.orthogonalizer(updates)
        groups = {id(p): g for g in self.param_groups if g["muon"] for p in g["params"]}
        for param, update, scale in zip(self.muon_params, orthogonal, self._scales):
            if param.grad is None:
                continue
            group = groups[id(param)]
            lr, decay = _plain(group["lr"]), group["weight_decay"]
            weights = _local(param)
            weights.mul_(1 - lr * decay).add_(update.to(weights.dtype), alpha=-lr * scale)

    def _adamw(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state.update(self.initial_state(param))
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=not self._fused,
            fused=self._fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _plain(value) -> float:
    return float(value)
