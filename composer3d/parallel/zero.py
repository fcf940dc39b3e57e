"""ZeRO-1: replicated parameters and gradients, optimizer state sharded over the data-parallel ranks.

FSDP2 has no mode that shards only optimizer state, so this is the one piece written here. Each parameter's
local tensor is viewed flat and cut into dp equal slices (the last ranks may get less or nothing); the
optimizer steps only this rank's slices — views into the parameter, so no extra copy of the weights —
and one all-gather per step puts every rank's updated slices back into the full parameters.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class OptimizerStateSharder:
    def __init__(self, params: list[torch.Tensor], dp_mesh: DeviceMesh):
        self.params = params
        self.group = dp_mesh.get_group()
        self.world, rank = dp_mesh.size(), dp_mesh.get_local_rank()
        self.slice_len = [math.ceil(_local(p).numel() / self.world) for p in params]
        self.bounds = [(min(rank * n, _local(p).numel()), min((rank + 1) * n, _local(p).numel()))
                       for p, n in zip(params, self.slice_len)]
        # The optimizer's parameters: leaf views of this rank's slice of each parameter.
        self.shards = [_local(p).detach().view(-1)[lo:hi].requires_grad_(True) for p, (lo, hi) in zip(params, self.bounds)]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(lambda *_: self._point_shard_grads())
        optimizer.register_step_post_hook(lambda *_: self._all_gather_params())

    def _point_shard_grads(self) -> None:
        for param, shard, (lo, hi) in zip(self.params, self.shards, self.bounds):
            shard.grad = None if param.grad is None else _local(param.grad).view(-1)[lo:hi]

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        width = sum(self.slice_len)
        mine = torch.zeros(width, dtype=self.shards[0].dtype, device=self.shards[0].device)
        offset = 0
        for shard, n in zip(self.shards, self.slice_len):
            mine[offset:offset + shard.numel()] = shard
            offset += n
        gathered = torch.empty(self.world * width, dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(gathered, mine, group=self.group)
        by_rank = gathered.view(self.world, width)
        offset = 0
        for param, n in zip(self.params, self.slice_len):
            flat = _local(param).view(-1)
            flat.copy_(by_rank[:, offset:offset + n].reshape(-1)[:flat.numel()])
            offset += n
