"""Context parallel: each of the ``cp`` ranks holds 1/cp of every sequence's tokens, and attention spans all of them.

The sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp−1−r (head-tail, as Megatron and torchtitan
balance causal attention): under a causal mask the early chunks attend to few keys and the late ones to many, so
each rank gets one of each and the same work. Inputs, targets and positions are cut alike (``shard``); RoPE takes
each token's global position. Attention takes its queries locally and the keys and values of the whole sequence,
all-gathered over the cp ranks with autograd (the backward reduce-scatters their gradients) — the ``allgather``
style: exact, cheapest for short sequences and few KV heads, and the same kernel as without cp (SDPA with a mask
over global token indices and document ids). The token loss of each rank's targets is summed over dp × cp (the
``loss`` mesh) and FSDP reduces gradients over ``dp_shard_cp``, so the curve is the single-process one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

# torch 2.13 names it all_gather_single_autograd (the older all_gather_tensor_autograd warns there); older only so.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class ContextParallel:
    """The cp group of this rank: which tokens it holds, and the collectives attention needs across the group."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.group = cp_mesh.get_group()
        self.size, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def _held(self, rank: int, seq_len: int) -> torch.Tensor:
        chunk = seq_len // (2 * self.size)
        head, tail = rank * chunk, (2 * self.size - 1 - rank) * chunk
        return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])

    def token_index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Global indices (0..seq_len-1) of the tokens this rank holds, in the order it holds them."""
        return self._held(self.rank, seq_len).to(device)

    def gathered_index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Global indices of the tokens ``gather`` returns: every rank's, in rank order."""
        return torch.cat([self._held(rank, seq_len) for rank in range(self.size)]).to(device)

    def shard(self, tensor: torch.Tensor | None, dim: int = 1) -> torch.Tensor | None:
        """This rank's tokens of a whole-sequence tensor (inputs, targets, positions); None stays None."""
        if tensor is None:
            return None
        return tensor.index_select(dim, self.token_index(tensor.shape[dim], tensor.device))

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's tokens along ``dim``, in rank order (``gathered_index``); gradients flow back to each owner."""
        return _all_gather_autograd(tensor.contiguous(), gather_dim=dim, group=self.group)

    def whole(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence in global order, from each rank's tokens (no gradient: positions and ids)."""
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(gathered, tensor.contiguous(), group=self.group)
        stacked = torch.cat(gathered, dim)
        seq_len = stacked.shape[dim]
        order = self.gathered_index(seq_len, tensor.device).argsort()
        return stacked.index_select(dim, order)

    def attention_mask(self, seq_len: int, documents: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Which gathered keys each local query attends to, (batch or 1, 1, local tokens, seq_len): keys at or
        before the query's global index and, with ``documents`` (batch, seq_len) in global order, in its document."""
        queries, keys = self.token_index(seq_len, device), self.gathered_index(seq_len, device)
        mask = (keys[None, :] <= queries[:, None]).unsqueeze(0)
        if documents is not None:
            mask = mask & (documents[:, queries, None] == documents[:, None, keys])
        return mask.unsqueeze(1)
