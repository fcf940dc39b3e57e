"""Global gradient-norm clipping over parameters that live on different meshes.

After TP and FSDP a model mixes DTensors on several meshes (dp only; dp × tp; …), and DTensor's foreach ops
(used by ``torch.nn.utils.clip_grad_norm_``) refuse to mix meshes. So gradients are grouped by
(mesh, placements): each group's partial norm is completed with one collective, the squares summed into the
global norm, and each group scaled on its own.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _grads_by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[(p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None].append(p.grad)
    return list(groups.values())


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, pp_group=None,
                    uncounted: list[torch.Tensor] = ()) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm`` (0: only measure). Returns the norm.

    Under pipeline parallel each rank holds only its stages' parameters: ``pp_group`` adds up the stages.
    ``uncounted``: parameters scaled but left out of the norm (a tied embedding's twin, counted as the embedding).
    """
    groups = _grads_by_mesh(params)
    left_out = {id(p) for p in uncounted}
    squares = []
    for grads in _grads_by_mesh([p for p in params if id(p) not in left_out]):
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
