"""ZeRO-1: replicated parameters, gradients reduce-scattered and optimizer state sharded over the
data-parallel ranks.

FSDP2 has no mode that shards only optimizer state, so this is the one piece written here, with the
ZeRO paper's traffic: the gradients are reduce-scattered in buckets during the backward
(``zero_buckets``), so each rank gets the summed gradient of the slices it owns; the optimizer steps
only those slices — views into the parameters, so no extra copy of the weights — and one all-gather
per bucket puts every rank's updated slices back into the full parameters. 2Φ(N−1)/N bytes a step
leave each rank (Φ the parameter bytes), where an all-reduce of the gradients and an all-gather of
the parameters moved 3Φ(N−1)/N.

With a compute dtype narrower than the parameters' fp32 (``gather_dtype``: precision.param_dtype
bf16 or fp16) the gather carries that dtype, as FSDP2's mixed precision and Megatron's distributed
optimizer do: half the bytes. The ranks must still compute from identical parameters, so the
optimizer steps fp32 master copies of this rank's slices (tensors of their own: Φ·4/N more memory)
and every rank's parameters hold the gathered values, the masters rounded to the compute dtype (in
their fp32 storage). Matmuls under autocast round their weights so anyway; norms' weights and the
embedding now compute from rounded values too, as under FSDP's param_dtype. A checkpoint saves the
masters (``with_masters``), and a load takes them back from the loaded parameters
(``take_masters``).

Under expert parallel the routed experts are not replicated over every data-parallel rank: each ep
rank holds its own. Each parameter is sharded over the ranks that hold the same values
(``replica_meshes``): the dense ones over all data-parallel ranks, the experts over what ep leaves
of them (``ParallelMesh.expert_replicas``), each set of parameters in buckets of its own, as
Megatron's distributed optimizer does with its expert data-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from composer3d.parallel.data_parallel.zero_buckets import GradientBuckets, all_gather
from composer3d.parallel.data_parallel.zero_buckets import local as _local
from composer3d.parallel.mesh import ParallelMesh


def replica_mesh(model: nn.Module, mesh: ParallelMesh) -> Callable[[torch.Tensor], DeviceMesh]:
    """Each of ``model``'s parameters to the ranks holding the same values: under expert parallel
    the routed experts' to ``expert_replicas``, every other parameter's to all data-parallel ranks
    (dp × cp)."""
    if mesh.layout.ep == 1:
        return lambda param: mesh.loss
    experts = {id(p) for module in model.routed_experts() for p in module.parameters(recurse=False)}
    return lambda param: mesh.expert_replicas if id(param) in experts else mesh.loss


class OptimizerStateSharder:
    def __init__(
        self,
        params: list[torch.Tensor],
        replica_meshes: list[DeviceMesh],
        reduce_dtype: torch.dtype = torch.float32,
        bucket_bytes: int = 40 * 2**20,
        backwards_per_step: int = 1,
        gather_dtype: torch.dtype = torch.float32,
    ):
        """``replica_meshes``: per parameter, the 1-D mesh of the ranks holding the same values,
        which shard its gradient and optimizer state. ``backwards_per_step``: the micro-batches of a
        step (gradient accumulation or pipeline micro-batches); only the last one's gradients are
        reduced. ``gather_dtype``: what the updated parameters travel in."""
        self.params = params
        # one set of buckets per group, with the indices of its parameters
        by_mesh: dict[DeviceMesh, list[int]] = {}
        for index, mesh in enumerate(replica_meshes):
            by_mesh.setdefault(mesh, []).append(index)
        self.parts = [
            (
                GradientBuckets(
                    [params[i] for i in indices],
                    mesh.get_group(),
                    reduce_dtype,
                    bucket_bytes,
                    backwards_per_step,
                ),
                indices,
            )
            for mesh, indices in by_mesh.items()
        ]
        # each parameter's set of buckets and its index in the set
        place = {
            index: (buckets, position)
            for buckets, indices in self.parts
            for position, index in enumerate(indices)
        }
        self._place = place
        self.groups = [place[i][0].group for i in range(len(params))]
        self.group_sizes = [place[i][0].ranks for i in range(len(params))]
        self.owned = [place[i][0].owned(place[i][1]) for i in range(len(params))]
        self.bounds = [(lo, hi) for lo, hi, _, _ in self.owned]
        self.gather_dtype = gather_dtype
        # a narrower gather than the parameters' dtype: the rounding would lose the updates' low
        # bits, so the optimizer keeps them in masters of its own
        self.keeps_masters = gather_dtype.itemsize < self.parts[0][0].dtype.itemsize
        # The optimizer's parameters: leaf views of this rank's slice of each parameter, or their
        # master copies.
        views = [_local(p).detach().view(-1)[lo:hi] for p, (lo, hi) in zip(params, self.bounds)]
        self.shards = [(v.clone() if self.keeps_masters else v).requires_grad_(True) for v in views]
        self._round_params()

    def slices(self, index: int) -> tuple[dist.ProcessGroup, list[tuple[int, int]]]:
        """Parameter ``index``'s group, and the (lo, hi) of its flat local tensor each rank of the
        group owns (in group rank order): what an optimizer that needs whole matrices gathers."""
        buckets, position = self._place[index]
        return buckets.group, [buckets.owned_by(position, r) for r in range(buckets.ranks)]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(lambda *_: self._all_gather_params())

    def finish_reduction(self) -> None:
        """Wait for the step's reduce-scatters; each shard's gradient is then its slice of the
        summed gradient."""
        for buckets, _ in self.parts:
            buckets.finish()
        for shard, (lo, hi, bucket, start) in zip(self.shards, self.owned):
            shard.grad = bucket.reduced[start : start + hi - lo]

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers (the parameters' own .grad are freed into them)."""
        return sum(buckets.buffer_bytes() for buckets, _ in self.parts)

    def master_bytes(self) -> int:
        """Bytes of the fp32 masters (none when the optimizer steps views of the parameters)."""
        return sum(s.numel() * s.element_size() for s in self.shards) if self.keeps_masters else 0

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        pending = []
        for buckets, indices in self.parts:
            for bucket in buckets.buckets:
                width = bucket.length // buckets.ranks
                mine = torch.zeros(width, dtype=self.gather_dtype, device=bucket.buffer.device)
                for position in bucket.members:
                    lo, hi, _, start = self.owned[indices[position]]
                    mine[start : start + hi - lo] = self.shards[
                        indices[position]
                    ]  # rounded to the gather dtype here
                # the gradients were reduced: the buffer carries the gathered parameters until the
                # next backward (a narrower dtype in the front of its storage)
                gathered = bucket.buffer.view(self.gather_dtype)[: bucket.length]
                if buckets.ranks == 1:  # this rank owns the whole bucket
                    pending.append((bucket, indices, gathered.copy_(mine), None))
                else:
                    pending.append(
                        (bucket, indices, gathered, all_gather(gathered, mine, buckets.group))
                    )
        for bucket, indices, gathered, work in pending:
            if work is not None:
                work.wait()
            for position, offset in zip(bucket.members, bucket.offsets):
                flat = _local(self.params[indices[position]]).view(-1)
                flat.copy_(gathered[offset : offset + flat.numel()])

    @torch.no_grad()
    def _round_params(self) -> None:
        """The parameters as the gather leaves them: rounded to its dtype (the same on every rank,
        which all start from the same values)."""
        if self.keeps_masters:
            for param in self.params:
                _local(param).copy_(_local(param).to(self.gather_dtype))

    @torch.no_grad()
    def take_masters(self) -> None:
        """After the parameters were loaded (a checkpoint's fp32 values): the masters from them, the
        parameters rounded."""
        if self.keeps_masters:
            for shard, param, (lo, hi) in zip(self.shards, self.params, self.bounds):
                shard.copy_(_local(param).view(-1)[lo:hi])
            self._round_params()

    @torch.no_grad()
    def with_masters(self, state: dict) -> dict:
        """A model state dict as DCP's ``get_model_state_dict`` gives it (its values share the
        parameters' storage) with each whole fp32 master, in its parameter's layout, in place of the
        rounded parameter: what a checkpoint saves. Collective over the data-parallel ranks;
        ``state`` itself when there are no masters."""
        if not self.keeps_masters:
            return state
        masters = {}
        for index, (param, shard) in enumerate(zip(self.params, self.shards)):
            value = self._full_local(shard.detach(), index)
            masters[_local(param).data_ptr()] = (
                DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)
                if isinstance(param, DTensor)
                else value
            )
        replaced = {k: masters.get(_local(v).data_ptr(), v) for k, v in state.items()}
        found = {_local(v).data_ptr() for v in state.values()}
        missing = [
            i
            for i, p in enumerate(self.params)
            if _local(p).numel() and _local(p).data_ptr() not in found
        ]
        if missing:
            raise RuntimeError(
                f"the model state dict holds copies of ZeRO-1's parameters {missing}, not the "
                "parameters: their masters would not be saved"
            )
        return replaced

    # -- checkpointing: the same FQN-keyed, parameter-shaped form DCP's get_optimizer_state_dict
    # gives for an unsharded optimizer, so a ZeRO-1 checkpoint loads under FSDP or TP layouts and
    # the other way round.

    def _full_local(self, piece: torch.Tensor, index: int) -> torch.Tensor:
        """One state slice of parameter ``index`` back in the shape of its local tensor: every rank
        holding that tensor adds its slice into zeros (the slices do not overlap, so the sum is
        exact)."""
        param, (lo, hi) = self.params[index], self.bounds[index]
        full = torch.zeros(_local(param).numel(), dtype=piece.dtype, device=piece.device)
        full[lo:hi] = piece
        dist.all_reduce(full, group=self.groups[index])
        return full.view(_local(param).shape)

    def _ensure_state(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW creates its state at the first step; a checkpoint before that (or a load target)
        needs it now."""
        # the step count where torch's AdamW keeps it: on the device for its fused and capturable
        # kernels
        on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
        # an optimizer whose state is not AdamW's (Muon) says what its state starts as
        initial = getattr(optimizer, "initial_state", None)
        for shard in self.shards:
            if initial is not None and (shard not in optimizer.state or not optimizer.state[shard]):
                optimizer.state[shard] = initial(shard)
            elif shard not in optimizer.state or not optimizer.state[shard]:
                optimizer.state[shard] = {
                    "step": torch.zeros((), device=shard.device if on_device else None),
                    "exp_avg": torch.zeros_like(shard),
                    "exp_avg_sq": torch.zeros_like(shard),
                }

    def state_dict(self, optimizer: torch.optim.Optimizer, names: list[str]) -> dict:
        self._ensure_state(optimizer)
        state = {}
        for index, (name, param, shard) in enumerate(zip(names, self.params, self.shards)):
            entry = {}
            for key, value in optimizer.state[shard].items():
                if value.ndim == 0:  # Adam's step count: the same on every rank
                    entry[key] = value.clone()
                    continue
                full = self._full_local(value, index)
                entry[key] = (
                    DTensor.from_local(full, param.device_mesh, param.placements, run_check=False)
                    if isinstance(param, DTensor)
                    else full
                )
            state[name] = entry
        name_of = {id(shard): name for name, shard in zip(names, self.shards)}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [name_of[id(s)] for s in g["params"]],
            }
            for g in optimizer.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(
        self, optimizer: torch.optim.Optimizer, names: list[str], loaded: dict
    ) -> None:
        self._ensure_state(optimizer)
        for name, shard, (lo, hi) in zip(names, self.shards, self.bounds):
            for key, value in loaded["state"][name].items():
                value = _local(value)
                target = optimizer.state[shard][key]
                target.copy_(value if value.ndim == 0 else value.reshape(-1)[lo:hi])
        for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
