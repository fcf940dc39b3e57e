"""Mixture-of-experts feed-forward layer of the native llama: router, routed experts, shared
experts.

A router scores every token against every expert (in fp32), each token goes to its ``top_k`` experts
and the experts' outputs are mixed by the chosen scores; shared experts see every token. Routed
experts are stacked tensors (``[experts, ...]``), so expert parallel shards them by expert
(``parallel.experts``), and their compute is one grouped GEMM per projection where the device has it
(``torch.nn.functional.grouped_mm``), an exact loop over experts elsewhere.

Load balancing, both optional (``model.moe``): the sequence-wise auxiliary loss of DeepSeek-V3,
which is 1.0 when the load is balanced and reaches the gradients through ``AttachAuxLoss`` (so it
works inside pipeline stages, whose loss only the last stage sees), and DeepSeek-V3's
auxiliary-loss-free bias, added to the scores only to choose the experts and moved after each step
(``expert_load``). Both are per sequence or over the global batch, so neither depends on the layout.

Under tensor parallel (``parallel.experts``) every expert and the shared experts are split
Megatron-style over the hidden width: all tensor-parallel ranks route the same (gathered) tokens,
each computes its slice of the hidden width, and the partial outputs are summed once for the whole
layer. Under expert parallel the tokens travel to the rank holding their expert and back with
all-to-all over the ``ep`` group. Under context parallel a rank routes its share of each sequence;
the sequence-wise auxiliary loss counts the choices over the cp group.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor under TP/EP); gradients flow back to the DTensor's
    shard."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class AttachAuxLoss(torch.autograd.Function):
    """Returns ``hidden`` unchanged; in backward, ``aux_loss`` receives the gradient ``scale``
    (Megatron's trick).

    The auxiliary loss then trains the router wherever its layer runs (a pipeline stage included)
    without being carried to the training loss; ``scale`` is what the training loss's gradient would
    give it: the coefficient, over the global batch's sequences, times the fp16 loss scale.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` runs these operands: on the CPU (any float dtype eagerly;
    torch.compile's shape rules accept only bf16), on CUDA in bf16 from compute capability 8.0; rows
    16-byte aligned (its kernels' rule)."""
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], weight.shape[-2]))
    if x.device.type == "cpu":
        return aligned and (x.dtype == torch.bfloat16 or not torch.compiler.is_compiling())
    if x.device.type == "cuda":
        return (
            aligned
            and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0)
        )
    return False


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU experts as stacked weights: w1, w3 [experts, hidden, dim], w2 [experts,
    dim, hidden]."""

    # The dim tensor parallel splits in each weight: the hidden width
    # (``models.interface.ComposerModel``).
    tp_dims = {"w1": 1, "w3": 1, "w2": 2}

    def __init__(self, experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's rows sorted by its local experts, ``counts[e]`` of them for local
        expert e."""
        # one device, no FSDP: compute in autocast's dtype, as linears do
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        w1, w2, w3 = (local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if grouped_mm_fits(x, w1) and grouped_mm_fits(x, w2.transpose(-2, -1)):
            offsets = counts.cumsum(0).to(torch.int32)
            hidden = F.silu(F.grouped_mm(x, w1.transpose(-2, -1), offs=offsets)) * F.grouped_mm(
                x, w3.transpose(-2, -1), offs=offsets
            )
            return F.grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)
        # imported here, not at the top: see moe_eager
        from composer3d.models.moe_eager import experts_one_by_one

        return experts_one_by_one(x, counts, w1, w2, w3)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, moe_cfg):
        super().__init__()
        # plain values (model.moe as its dataclass): a compiled block reads them as constants, where
        # OmegaConf's attribute lookups broke its graph and sent the router back to eager
        self.cfg = OmegaConf.to_object(moe_cfg) if isinstance(moe_cfg, DictConfig) else moe_cfg
        self.n_experts = moe_cfg.experts
        self.gate = nn.Linear(dim, self.n_experts, bias=False)
        self.experts = GroupedExperts(self.n_experts, dim, hidden_dim)
        shared_hidden = hidden_dim * moe_cfg.shared_experts
        self.shared_w1 = nn.Linear(dim, shared_hidden, bias=False) if shared_hidden else None
        self.shared_w2 = nn.Linear(shared_hidden, dim, bias=False) if shared_hidden else None
        self.shared_w3 = nn.Linear(dim, shared_hidden, bias=False) if shared_hidden else None
        # Checkpointed: it decides the routing, and moves with training (bias_update_rate > 0).
        self.register_buffer("expert_bias", torch.zeros(self.n_experts), persistent=True)
        # This step's routed tokens per expert and summed sequence aux losses (training forwards
        # only).
        self.register_buffer("routed_tokens", torch.zeros(self.n_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.aux_grad_scale = 0.0  # set each step by the trainer (``ExpertLoad.before_step``)
        # off while a pipeline stage infers its shapes (``routing_unrecorded``)
        self.recording = True
        # Set by ``parallel.experts`` under tensor / expert parallel.
        self.tp_mesh: DeviceMesh | None = None
        self.sequence_parallel = False
        self.ep_group: dist.ProcessGroup | None = None
        # under context parallel: the ranks holding the same sequences
        self.cp_group: dist.ProcessGroup | None = None

    def init_buffers(self) -> None:
        for buffer in (self.expert_bias, self.routed_tokens, self.aux_loss_sum):
            buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # route whole sequences on every TP rank
        if self.tp_mesh is not None and self.sequence_parallel:
            # the sequence-parallel norm hands over a DTensor, or its local shard
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, self.tp_mesh, (Shard(1),), run_check=False)
            x = x.redistribute(placements=(Replicate(),)).to_local()
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, chosen, scores = self.route(tokens)
        if self.training and torch.is_grad_enabled():
            aux = self._sequence_aux_losses(scores, chosen, batch, seq)
            self._record(chosen, aux)
        else:
            aux = None
        keep = self._within_capacity(chosen, batch, seq) if self.cfg.capacity_factor > 0 else None
        expert_input = tokens
        if self.tp_mesh is not None:
            # Each TP rank's experts see only their slice of the hidden width, so the gradients they
            # send back to the tokens and to the mixing weights are partial sums: reduce them over
            # TP (Megatron's "f").
            expert_input, weights = (_sum_grad_over(t, self.tp_mesh) for t in (tokens, weights))
        out = self._routed(expert_input, weights, chosen, keep)
        if self.shared_w1 is not None:
            out = out + F.linear(
                F.silu(F.linear(expert_input, local(self.shared_w1.weight)))
                * F.linear(expert_input, local(self.shared_w3.weight)),
                local(self.shared_w2.weight),
            )
        out = out.view(batch, seq, dim)
        if self.tp_mesh is not None:  # the partial sums of every TP rank, once for the whole layer
            out = (
                DTensor.from_local(out, self.tp_mesh, (Partial(),), run_check=False)
                .redistribute(placements=(Shard(1) if self.sequence_parallel else Replicate(),))
                .to_local()
            )
        if aux is not None and self.aux_grad_scale:
            out = AttachAuxLoss.apply(out, aux.sum(), self.aux_grad_scale)
        return out

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mixing weights (tokens, top_k) in fp32, chosen experts (tokens, top_k), and all scores
        (tokens, experts).

        In fp32 whatever the compute dtype (also under autocast): near-ties between experts would
        otherwise flip with the rounding of the low-precision logits."""
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), local(self.gate.weight).float())
        scores = logits.softmax(-1) if self.cfg.score_func == "softmax" else logits.sigmoid()
        selection = scores + self.expert_bias if self.cfg.bias_update_rate > 0 else scores
        chosen = selection.topk(self.cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.cfg.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.cfg.route_scale, chosen, scores

    def _sequence_aux_losses(
        self, scores: torch.Tensor, chosen: torch.Tensor, batch: int, seq: int
    ) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss per sequence: sum_i f_i · P_i, f_i the fraction
        of the sequence's choices that went to expert i times experts / top_k, P_i its mean
        normalized score; 1.0 when balanced.

        Under context parallel a rank holds seq of the sequence's tokens: the choices are counted
        over the cp group (f_i is the whole sequence's, and takes no gradient), and each rank
        returns its tokens' share of P_i's sum, so the shares add up over cp to the sequence's loss,
        and so do their gradients."""
        experts, k = self.n_experts, self.cfg.top_k
        probs = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, experts)
        hits = torch.zeros_like(scores).scatter_(1, chosen, 1.0).view(batch, seq, experts).sum(1)
        if self.cp_group is not None:
            hits = funcol.wait_tensor(funcol.all_reduce(hits, "sum", self.cp_group))
            seq *= dist.get_world_size(self.cp_group)
        fraction = hits * experts / (k * seq)
        return (fraction * probs.sum(1) / seq).sum(-1)

    def _record(self, chosen: torch.Tensor, aux: torch.Tensor) -> None:
        """Count this forward's routing, once (``recorded_forward``); in place, as buffers (a
        reassigned attribute would be a side effect dynamo cannot trace inside a checkpointed
        region)."""
        if not recorded_forward(self):
            return
        with torch.no_grad():
            self.routed_tokens.add_(
                per_expert(chosen.flatten(), self.n_experts).to(self.routed_tokens)
            )
            self.aux_loss_sum.add_(aux.detach().sum())

    def _within_capacity(self, chosen: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """(tokens, top_k) bools: the choices an expert takes under model.moe.capacity_factor, per
        sequence, first choices before second ones and earlier positions first."""
        k, experts = self.cfg.top_k, self.n_experts
        capacity = math.ceil(self.cfg.capacity_factor * seq * k / experts)
        # slot-major priority
        in_order = chosen.view(batch, seq, k).transpose(1, 2).reshape(batch, k * seq)
        onehot = F.one_hot(in_order, experts)
        place = (onehot.cumsum(1) * onehot).sum(-1) - 1  # this choice's place in its expert's queue
        return (place < capacity).view(batch, k, seq).transpose(1, 2).reshape(-1, k)

    def _routed(
        self,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        chosen: torch.Tensor,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        return mix_routed(
            tokens, weights, chosen, self.n_experts, self.experts, self.ep_group, keep
        )


def per_expert(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``chosen`` (expert indices) go to each expert: bincount's result, in a shape that
    does not depend on the data (compiled graphs trace it; bincount's output size is its largest
    index's)."""
    return chosen.new_zeros(num_experts).index_add_(0, chosen, torch.ones_like(chosen))


def mix_routed(
    tokens: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    num_experts: int,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ep_group: dist.ProcessGroup | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts (``chosen``, weights ``weights``: tokens × top_k) of
    weight × expert(token), in fp32, cast back to the tokens' dtype; ``keep`` drops choices over
    capacity.

    ``experts(rows, counts)`` runs rows sorted by (local) expert, ``counts[e]`` for expert e; under
    expert parallel (``ep_group``) the rows travel to the ranks holding their experts and back
    (``moe_eager.through_expert_parallel``)."""
    k = chosen.shape[-1]
    flat = chosen.flatten()
    source = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(k)
    mix = weights.flatten()
    if keep is not None:
        kept = keep.flatten()
        flat, source, mix = flat[kept], source[kept], mix[kept]
    order = flat.argsort(stable=True)
    counts = per_expert(flat, num_experts)
    rows = tokens[source[order]]
    if ep_group is None:
        out_rows = experts(rows, counts)
    else:
        # imported here, not at the top: see moe_eager
        from composer3d.models.moe_eager import through_expert_parallel

        out_rows = through_expert_parallel(experts, rows, counts, ep_group)
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    out.index_add_(0, source[order], out_rows.float() * mix[order].unsqueeze(-1))
    return out.to(tokens.dtype)


def _sum_grad_over(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over ``mesh`` (DTensor: Partial →
    Replicate)."""
    return DTensor.from_local(tensor, mesh, (Replicate(),), run_check=False).to_local(
        grad_placements=(Partial(),)
    )


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def recorded_forward(module: nn.Module) -> bool:
    """Whether this forward of ``module`` is one whose routing is recorded: a training forward, not
    a pipeline stage's shape inference (``recording`` off), and not activation checkpointing's rerun
    inside backward (an autograd graph task is then running), which must not count again. Traced by
    torch.compile it is never such a rerun: a compiled checkpointed region is recomputed by the
    compiled backward, which replays no buffer mutation, and a region dynamo could not trace is
    checkpointed eagerly and recomputed outside any compiled frame, where the task check runs
    (asking for the task inside a graph would break it, and then the whole checkpointed block would
    run eagerly)."""
    if not (module.training and torch.is_grad_enabled() and getattr(module, "recording", True)):
        return False
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1


def routing_counters(model: nn.Module) -> list[nn.Module]:
    """``model``'s modules that count the tokens routed to each expert (``routed_tokens``, while
    ``recording``): its MoE layers, and transformers' experts modules once ``track_routing`` gave
    them the count."""
    return [m for m in model.modules() if hasattr(m, "routed_tokens")]


@contextlib.contextmanager
def routing_unrecorded(model: nn.Module):
    """Forwards of ``model`` that are no training (a pipeline stage's shape inference) leave the
    counts alone."""
    layers = routing_counters(model)
    for layer in layers:
        layer.recording = False
    try:
        yield
    finally:
        for layer in layers:
            layer.recording = True


def inactive_expert_params(model: nn.Module) -> int:
    """Parameters of routed experts a token does not go through: (experts - top_k) of every MoE
    layer's experts, whole (also when sharded). FLOPs per token count the active parameters only."""
    inactive = 0
    for moe in moe_layers(model):
        per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.n_experts
        inactive += per_expert * (moe.n_experts - moe.cfg.top_k)
    return inactive
