"""What the mixture-of-experts layer (``moe``) runs eagerly inside a compiled block
(``torch.compiler.disable``): the experts one by one where the grouped GEMM does not run, and expert
parallel's all-to-all exchange.

Apart from ``moe``, which imports this module where it calls these: applying the decorator imports
dynamo (about a second), and ``moe`` is imported with every model family, so also by the launcher's
config checks, which compile nothing.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


# Eager inside a compiled block: dynamo would compile the loop again for every batch's counts
@torch.compiler.disable(
    reason="experts one by one: a loop over counts read back per batch, run eagerly"
)
def experts_one_by_one(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The experts' SwiGLUs over their rows, expert by expert, where the grouped GEMM does not
    run."""
    outputs = []
    # a host sync: the loop needs the counts
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        outputs.append((F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
    return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


# Eager inside a compiled block: the all-to-alls' splits are read back each batch, and dynamo would
# compile the rest of the exchange again for every new split (the routing changes them every step)
@torch.compiler.disable(
    reason="expert parallel all-to-all: splits read back per batch, run eagerly"
)
def through_expert_parallel(
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    counts: torch.Tensor,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Send ``rows`` (sorted by global expert, ``counts`` per expert) to the ranks holding their
    experts, run them there and bring the outputs back in the same order. Rank r of the ep group
    holds experts [r·E/ep, (r+1)·E/ep). One all-to-all of counts (read back to the host: the
    splits), one of rows each way."""
    ep = dist.get_world_size(group)
    local_experts = counts.numel() // ep
    received = funcol.all_to_all_single(counts, None, None, group)  # [source rank, local expert]
    received = (
        funcol.wait_tensor(received)
        if isinstance(received, funcol.AsyncCollectiveTensor)
        else received
    )
    splits = torch.stack(
        [counts.view(ep, local_experts).sum(1), received.view(ep, local_experts).sum(1)]
    ).tolist()
    send, recv = splits
    arrived = funcol.all_to_all_single_autograd(rows, recv, send, group)
    # Arrived rows are grouped by source rank, then by local expert: regroup them by local expert.
    expert_of_row = (
        torch.arange(local_experts, device=rows.device).repeat(ep).repeat_interleave(received)
    )
    by_expert = expert_of_row.argsort(stable=True)
    computed = experts(arrived[by_expert], received.view(ep, local_experts).sum(0))
    unsorted = torch.empty_like(computed).index_copy(0, by_expert, computed)
    return funcol.all_to_all_single_autograd(unsorted, send, recv, group)
