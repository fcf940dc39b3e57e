"""ZeRO-1: replicated parameters, gradients reduce-scattered and optimizer state sharded over the data-parallel ranks.

FSDP2 has no mode that shards only optimizer state, so this is the one piece written here, with the ZeRO paper's
traffic: the gradients are reduce-scattered in buckets during the backward (``zero_buckets``), so each rank gets the
summed gradient of the slices it owns; the optimizer steps only those slices — views into the parameters, so no
extra copy of the weights — and one all-gather per bucket puts every rank's updated slices back into the full
parameters. 2Φ(N−1)/N bytes a step leave each rank (Φ the parameter bytes), where an all-reduce of the gradients
and an all-gather of the parameters moved 3Φ(N−1)/N.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from composer3d.parallel.zero_buckets import GradientBuckets, all_gather
from composer3d.parallel.zero_buckets import local as _local


class OptimizerStateSharder:
    def __init__(self, params: list[torch.Tensor], dp_mesh: DeviceMesh, reduce_dtype: torch.dtype = torch.float32,
                 bucket_bytes: int = 40 * 2**20, backwards_per_step: int = 1):
        """``backwards_per_step``: the micro-batches of a step (gradient accumulation or pipeline micro-batches);
        only the last one's gradients are reduced."""
        self.params = params
        self.group = dp_mesh.get_group()
        self.buckets = GradientBuckets(params, self.group, reduce_dtype, bucket_bytes, backwards_per_step)
        self.owned = [self.buckets.owned(i) for i in range(len(params))]
        self.bounds = [(lo, hi) for lo, hi, _, _ in self.owned]
        # The optimizer's parameters: leaf views of this rank's slice of each parameter.
        self.shards = [_local(p).detach().view(-1)[lo:hi].requires_grad_(True) for p, (lo, hi) in zip(params, self.bounds)]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(lambda *_: self._all_gather_params())

    def finish_reduction(self) -> None:
        """Wait for the step's reduce-scatters; each shard's gradient is then its slice of the summed gradient."""
        self.buckets.finish()
        for shard, (lo, hi, bucket, start) in zip(self.shards, self.owned):
            shard.grad = bucket.reduced[start:start + hi - lo]

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers (the parameters' own .grad are freed into them)."""
        return self.buckets.buffer_bytes()

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        ranks = self.buckets.ranks
        pending = []
        for bucket in self.buckets.buckets:
            width = bucket.length // ranks
            mine = torch.zeros(width, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
            for index in bucket.members:
                lo, hi, _, start = self.owned[index]
                mine[start:start + hi - lo] = self.shards[index]
            # the gradients were reduced: the buffer carries the gathered parameters until the next backward
            pending.append((bucket, mine, all_gather(bucket.buffer, mine, self.group)))
        for bucket, _, work in pending:
            work.wait()
            for index, offset in zip(bucket.members, bucket.offsets):
                flat = _local(self.params[index]).view(-1)
                flat.copy_(bucket.buffer[offset:offset + flat.numel()])

    # -- checkpointing: the same FQN-keyed, parameter-shaped form DCP's get_optimizer_state_dict gives for an
    # unsharded optimizer, so a ZeRO-1 checkpoint loads under FSDP or TP layouts and the other way round.

    def _full_local(self, piece: torch.Tensor, param: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
        """One state slice back in the shape of the parameter's local tensor: every rank adds its slice into
        zeros (the slices do not overlap, so the sum is exact)."""
        full = torch.zeros(_local(param).numel(), dtype=piece.dtype, device=piece.device)
        full[bounds[0]:bounds[1]] = piece
        dist.all_reduce(full, group=self.group)
        return full.view(_local(param).shape)

    def _ensure_state(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW creates its state at the first step; a checkpoint before that (or a load target) needs it now."""
        for shard in self.shards:
            if shard not in optimizer.state or not optimizer.state[shard]:
                optimizer.state[shard] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(shard),
                                          "exp_avg_sq": torch.zeros_like(shard)}

    def state_dict(self, optimizer: torch.optim.Optimizer, names: list[str]) -> dict:
        self._ensure_state(optimizer)
        state = {}
        for name, param, shard, bounds in zip(names, self.params, self.shards, self.bounds):
            entry = {}
            for key, value in optimizer.state[shard].items():
                if value.ndim == 0:  # Adam's step count: the same on every rank
                    entry[key] = value.clone()
                    continue
                full = self._full_local(value, param, bounds)
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
