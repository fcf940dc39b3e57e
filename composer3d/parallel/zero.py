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

    # -- checkpointing: the same FQN-keyed, parameter-shaped form DCP's get_optimizer_state_dict gives for an
    # unsharded optimizer, so a ZeRO-1 checkpoint loads under FSDP or TP layouts and the other way round.

    def _full_local(self, piece: torch.Tensor, param: torch.Tensor, n: int) -> torch.Tensor:
        """All-gather one state slice back into the shape of the parameter's local tensor."""
        padded = torch.zeros(n, dtype=piece.dtype, device=piece.device)
        padded[:piece.numel()] = piece
        gathered = torch.empty(self.world * n, dtype=piece.dtype, device=piece.device)
        dist.all_gather_into_tensor(gathered, padded, group=self.group)
        local = _local(param)
        return gathered[:local.numel()].view(local.shape)

    def _ensure_state(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW creates its state at the first step; a checkpoint before that (or a load target) needs it now."""
        for shard in self.shards:
            if shard not in optimizer.state or not optimizer.state[shard]:
                optimizer.state[shard] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(shard),
                                          "exp_avg_sq": torch.zeros_like(shard)}

    def state_dict(self, optimizer: torch.optim.Optimizer, names: list[str]) -> dict:
        self._ensure_state(optimizer)
        state = {}
        for name, param, shard, n in zip(names, self.params, self.shards, self.slice_len):
            entry = {}
            for key, value in optimizer.state[shard].items():
                if value.ndim == 0:  # Adam's step count: the same on every rank
                    entry[key] = value.clone()
                    continue
                full = self._full_local(value, param, n)
                entry[key] = DTensor.from_local(full, param.device_mesh, param.placements, run_check=False) \
                    if isinstance(param, DTensor) else full
            state[name] = entry
        name_of = {id(shard): name for name, shard in zip(names, self.shards)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(s)] for s in g["params"]]}
                  for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, optimizer: torch.optim.Optimizer, names: list[str], loaded: dict) -> None:
        self._ensure_state(optimizer)
        for name, shard, (lo, hi) in zip(names, self.shards, self.bounds):
            for key, value in loaded["state"][name].items():
                value = _local(value)
                target = optimizer.state[shard][key]
                target.copy_(value if value.ndim == 0 else value.reshape(-1)[lo:hi])
        for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
