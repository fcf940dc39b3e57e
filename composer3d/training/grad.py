"""Global gradient-norm clipping over parameters that live on different meshes, with one reduction
per step.

After TP, FSDP and expert parallel a model mixes DTensors on several meshes (dp only; dp × tp; ep ×
tp × expert dp; …), and completing each mesh's partial norm over each of its dimensions costs a
collective per dimension and mesh, one after another. Instead each rank adds the squares of the
gradient elements it holds, each divided by the number of the job's ranks that hold that same
element (its replicas), and one all-reduce over the whole job — every mesh dimension and pipeline
stage at once — sums them into the global squared norm: every element counted once.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from composer3d.memory.optimizer_offload import HostOffloadOptimizer
from composer3d.optim.compiled_adamw import CompiledAdamW
from composer3d.parallel.mesh import Layout


def replicas(t: torch.Tensor, layout: Layout) -> int:
    """The job's ranks that hold each element of ``t`` (a parameter or its gradient): those of its
    pipeline stage, over the ranks that split it (a plain tensor is whole on every rank of its
    stage)."""
    stage_ranks = layout.world_size // layout.pp
    if not isinstance(t, DTensor):
        return stage_ranks
    # FSDP over a tensor-parallel split shards with _StridedShard, which is no Shard on every torch
    # the pins allow
    return stage_ranks // math.prod(
        t.device_mesh.size(i)
        for i, p in enumerate(t.placements)
        if p.is_shard() or isinstance(p, _StridedShard)
    )


def _held(grad: torch.Tensor) -> torch.Tensor:
    """The elements this rank holds; a Partial gradient (not yet summed over its mesh) is summed
    first."""
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(
            grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements]
        )
    return grad.to_local() if isinstance(grad, DTensor) else grad


def divides_in_step(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` can take the clip into its own step: torch's fused Adam and AdamW
    kernels divide each gradient by the optimizer's ``grad_scale`` (the attribute torch's GradScaler
    sets) as they read it, and store the quotient back. Handing them the clip saves its own pass
    over the gradients (a read and a write of each: about 1% of a 1.5B model's compiled step on an
    H100). ``CompiledAdamW`` divides as it reads and stores nothing back. An offloaded optimizer
    hands it to its host step."""
    stepper = optimizer.inner if isinstance(optimizer, HostOffloadOptimizer) else optimizer
    return isinstance(stepper, CompiledAdamW) or (
        isinstance(stepper, torch.optim.Adam | torch.optim.AdamW)
        and bool(stepper.defaults.get("fused"))
    )


@torch.no_grad()
def clip_grad_norm_(
    params: list[torch.Tensor],
    max_norm: float,
    layout: Layout,
    replica_counts: list[int] | None = None,
    uncounted: list[torch.Tensor] = (),
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm`` (0: only measure). Returns
    the norm.

    ``replica_counts``: per parameter, the ranks holding each of its gradient's elements, where its
    placements do not say (ZeRO-1's slices of replicated parameters); by default ``replicas`` of
    each gradient. ``uncounted``: parameters scaled but left out of the norm (a tied embedding's
    twin, counted as the embedding). ``optimizer``: the optimizer that steps next; where it
    ``divides_in_step``, the gradients are scaled there (by the same factor, as a divisor) and not
    here.
    """
    counts = replica_counts or [
        replicas(p.grad, layout) if p.grad is not None else 0 for p in params
    ]
    left_out = {id(p) for p in uncounted}
    by_count: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p, count in zip(params, counts):
        if p.grad is not None and p.grad.numel() > 0 and id(p) not in left_out:
            by_count[count].append(_held(p.grad))
    squares = [
        torch.nn.utils.get_total_norm(held, norm_type=2.0, foreach=True).float() ** 2 / count
        for count, held in sorted(by_count.items())
    ]
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the whole job: every mesh dimension and pipeline stage in one reduction
        dist.all_reduce(total_sq)
    total = total_sq.sqrt()
    if divides_in_step(optimizer):
        optimizer.grad_scale = (
            torch.clamp((total + 1e-6) / max_norm, min=1.0) if max_norm > 0 else None
        )
    elif max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = defaultdict(list)
        for p in params:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grads[(local.device, local.dtype)].append(local)
        for (_, dtype), group in grads.items():
            torch._foreach_mul_(group, coef.to(dtype))
    return total
