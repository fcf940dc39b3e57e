"""AdamW whose update is compiled (``optim.implementation=compiled``): each block of the model one
call of a graph.

The update is memory-bound: per parameter it reads the weight, its gradient and two moments and
writes the weight and the moments back, 28 bytes in fp32. Torch's fused kernel, handed the gradient
clip (``grad_scale``), also stores each divided gradient back (32 bytes). Here torch.compile traces
torch's own multi-tensor AdamW (``torch.optim.adam.adam`` with decoupled weight decay, the same
update as ``torch.optim.AdamW``) together with the clip's division, so Inductor emits pointwise
kernels that read each gradient once and write nothing but the weights and the moments. Blocks of
one shape share a graph, so the compile costs one block's tensors rather than the model's. The state
is AdamW's (the same keys, the step count a tensor on the parameter's device as for the fused
kernel), so checkpoints move between implementations. A step whose parameters with gradients differ
from the first step's runs torch's fused kernel eagerly instead (the graphs are made for one set).
DTensor parameters step on their local shards (the update is elementwise), with each gradient first
given its parameter's placements as DTensor's own dispatch would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

log = logging.getLogger("composer3d")


def _update(groups: list[tuple], grad_scale: torch.Tensor | None) -> None:
    """Step each group — (params, grads, exp_avgs, exp_avg_sqs, steps, lr tensor, hyperparameters) —
    in place, as torch's multi-tensor AdamW does; the function that is compiled."""
    for params, grads, exp_avgs, exp_avg_sqs, steps, lr, settings in groups:
        if grad_scale is not None:  # out of place: the quotient lives only inside the fused kernels
            grads = torch._foreach_div(grads, grad_scale)
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=True,
            capturable=True,
            decoupled_weight_decay=True,
            amsgrad=False,
            maximize=False,
            lr=lr,
            **settings,
        )


def _update_eagerly(groups: list[tuple], grad_scale: torch.Tensor | None) -> None:
    """The same update, uncompiled: torch's fused kernel where the device has one (it divides each
    gradient by ``grad_scale`` in place, as the fused implementation does), else torch's loop over
    the parameters."""
    for params, grads, exp_avgs, exp_avg_sqs, steps, lr, settings in groups:
        fused = params[0].device.type in _get_fused_kernels_supported_devices()
        if grad_scale is not None and not fused:
            grads = torch._foreach_div(grads, grad_scale)
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            fused=fused,
            foreach=False,
            grad_scale=grad_scale if fused else None,
            decoupled_weight_decay=True,
            amsgrad=False,
            maximize=False,
            lr=lr if fused else float(lr),
            **settings,
        )


# Distinct chunk signatures a step compiles: well under torch.compile's recompile limit (8 graphs a
# function), which ends a fullgraph compile with an error.
MAX_GRAPHS = 4


class CompiledAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (without amsgrad or maximize) whose ``step`` runs ``_update`` compiled.
    Like the fused kernel it divides each gradient by ``grad_scale`` (the clip's divisor, or None)
    as it reads it.

    ``block_of`` names the block of the model a parameter is in (None outside the numbered blocks):
    each block's parameters step as one call of the compiled update, so blocks of one shape share
    one graph. Compiling costs time in proportion to the tensors in a graph (on the 2-core CPU box
    0.35 s a tensor, 52 s for a 1B model's 147 in one graph): chunked by block, a model of many
    blocks compiles its first block and its other parameters. Where that gives more than
    ``MAX_GRAPHS`` shapes of chunk, or without ``block_of``, all parameters step in one graph."""

    def __init__(
        self, params, block_of: Callable[[torch.Tensor], Hashable] | None = None, **settings
    ):
        super().__init__(params, foreach=True, capturable=True, **settings)
        self.grad_scale: torch.Tensor | None = None
        self._block_of = block_of or (lambda param: None)
        # static shapes (each parameter's are fixed for the run): one graph per shape of chunk
        self._compiled = torch.compile(_update, fullgraph=True, dynamic=False)
        # a float learning rate would be a constant of the graph (a recompile each time the schedule
        # moves it)
        self._lrs: dict[int, torch.Tensor] = {}
        # which parameters had gradients when the chunks were made
        self._compiled_for: tuple | None = None
        self._chunks: list[
            list[tuple[int, list[torch.Tensor]]]
        ] = []  # per chunk: (group index, its parameters)
        self._warned_eager = False

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CompiledAdamW.step takes no closure")
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError(
                    "CompiledAdamW steps plain AdamW: amsgrad and maximize are not supported"
                )
        having = tuple(tuple(p.grad is not None for p in g["params"]) for g in self.param_groups)
        if not any(map(any, having)):
            return
        for index, group in enumerate(self.param_groups):
            lr = self._lrs.get(index)
            if lr is None:
                lr = self._lrs[index] = torch.zeros(
                    (), dtype=torch.float32, device=group["params"][0].device
                )
            lr.fill_(group["lr"])  # a kernel with the value as its argument: no host-device sync
        if self._compiled_for is None:
            self._compiled_for, self._chunks = having, self._chunked()
            log.info(
                "compiling the optimizer step (optim.implementation=compiled): %d tensors in %d "
                "chunks, graphs: %d, once a run, their code cached for the next",
                sum(map(sum, having)),
                len(self._chunks),
                len({_signature(chunk) for chunk in self._chunks}),
            )
        if having == self._compiled_for:
            for chunk in self._chunks:
                self._compiled(
                    [self._arguments(index, params) for index, params in chunk], self.grad_scale
                )
            return
        # Another set of parameters has gradients than the chunks were made for. Graphs for each set
        # would soon reach torch.compile's recompile limit (an error under fullgraph): this step
        # runs eagerly instead.
        if not self._warned_eager:
            log.warning(
                "optim.implementation=compiled: other parameters have gradients than at the first "
                "step; such steps run torch's fused AdamW eagerly (the same update, 4 bytes a "
                "parameter more)"
            )
            self._warned_eager = True
        _update_eagerly(
            [self._arguments(index, params) for index, params in self._stepped()], self.grad_scale
        )

    def _chunked(self) -> list[list[tuple[int, list[torch.Tensor]]]]:
        """The parameters with gradients by block, each block's by group; all in one chunk where the
        blocks have more than ``MAX_GRAPHS`` shapes."""
        by_block: dict[Hashable, dict[int, list[torch.Tensor]]] = {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    by_block.setdefault(self._block_of(p), {}).setdefault(index, []).append(p)
        chunks = [sorted(groups.items()) for groups in by_block.values()]
        return (
            chunks
            if len({_signature(chunk) for chunk in chunks}) <= MAX_GRAPHS
            else [self._stepped()]
        )

    def _stepped(self) -> list[tuple[int, list[torch.Tensor]]]:
        """Each group's parameters with gradients (groups without any left out)."""
        stepped = [
            (index, [p for p in group["params"] if p.grad is not None])
            for index, group in enumerate(self.param_groups)
        ]
        return [(index, params) for index, params in stepped if params]

    def _arguments(self, index: int, params: list[torch.Tensor]) -> tuple:
        """``_update``'s arguments for ``params`` of group ``index``."""
        group = self.param_groups[index]
        states = [self._state(p) for p in params]
        settings = dict(
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
        )
        return (
            [_local(p) for p in params],
            [_local(_placed_like(p.grad, p)) for p in params],
            [_local(s["exp_avg"]) for s in states],
            [_local(s["exp_avg_sq"]) for s in states],
            [s["step"] for s in states],
            self._lrs[index],
            settings,
        )

    def _state(self, param: torch.Tensor) -> dict:
        """AdamW's state of ``param``, made at its first step; a step count kept on the host (a
        checkpoint of the foreach or loop implementations) moves to the parameter's device, where
        the graph counts it."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif state["step"].device != param.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(param.device, torch.float32)
        return state


def _placed_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``param``'s placements (a Partial gradient summed, as DTensor's dispatch of
    AdamW would)."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _signature(chunk: list[tuple[int, list[torch.Tensor]]]) -> tuple:
    """What a chunk's graph is specialised on: its groups and their parameters' local shapes and
    dtypes."""
    return tuple(
        (index, tuple((tuple(_local(p).shape), p.dtype) for p in params)) for index, params in chunk
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
