"""Layout: the parallel degrees, and the DeviceMesh they define.

Mesh dims, outer to inner: pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp —
tensor-parallel groups are consecutive ranks (one node, fastest links) and pipeline stages span the
farthest. Expert parallel borrows its ranks from dp_shard × cp (as torchtitan does): under context
parallel it takes all cp ranks, so the tokens of a sequence meet at the same experts, and ep/cp more
from dp_shard (without cp, ep from dp_shard); dp_shard is split into dp_shard_mod_ep ×
dp_shard_in_ep, the ep ranks consecutive, so every other view sees the same dp_shard as without
experts. Dims of size 1 exist too, so code never asks whether a dim is there. Flattened views:
``dp_shard`` (dp_shard_mod_ep × dp_shard_in_ep), ``dp`` (replicate × shard, feeds data loading),
``dp_shard_cp`` (what FSDP shards the dense parameters over), ``loss`` (dp × cp, where losses and
token counts are reduced) and ``ep`` (dp_shard_in_ep × cp under cp); routed experts are FSDP-sharded
over ``expert_dp`` (what ep leaves of dp_shard).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

try:  # torch >= 2.14 (whose private _set_pg_timeout warns that it is deprecated)
    from torch.distributed import set_timeout
except ImportError:  # torch 2.11 to 2.13
    from torch.distributed.distributed_c10d import _set_pg_timeout as set_timeout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """The parallel degrees, ``dp_shard=-1`` resolved (config.checks.resolve_degrees): the one form
    the checks, the mesh, the trainer and the planner take."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def ep_of_dp_shard(self) -> int:
        """The ranks expert parallel takes from dp_shard: under context parallel, all of cp's come
        first."""
        return self.ep // self.cp if self.ep > 1 else 1

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ParallelMesh:
    """The world DeviceMesh with its named sub-meshes and flattened views (kept here, not sliced
    again later)."""

    def __init__(self, layout: Layout, device_type: str, timeout: timedelta | None = None):
        """``timeout``: the collective timeout of every group of the mesh (None: torch's
        defaults)."""
        self.layout, self.timeout = layout, timeout
        in_ep = layout.ep_of_dp_shard
        sizes = {
            **layout.as_dict(),
            "dp_shard_mod_ep": layout.dp_shard // in_ep,
            "dp_shard_in_ep": in_ep,
        }
        self.world: DeviceMesh = init_device_mesh(
            device_type, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
        )
        self.dp_shard: DeviceMesh = self.world["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten(
            "dp_shard"
        )
        self.dp: DeviceMesh = self.world[
            "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"
        ]._flatten("dp")
        self.dp_shard_cp: DeviceMesh = self.world[
            "dp_shard_mod_ep", "dp_shard_in_ep", "cp"
        ]._flatten("dp_shard_cp")
        self.loss: DeviceMesh = self.world[
            "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"
        ]._flatten("loss")
        self.ep: DeviceMesh = (
            self.world["dp_shard_in_ep", "cp"]._flatten("ep")
            if layout.ep > 1 and layout.cp > 1
            else self.world["dp_shard_in_ep"]
        )
        if timeout is not None:
            # A mesh dim spanning the world reuses the default group (init_process_group's timeout);
            # the others are new groups, which torch gives its own default (30 min on gloo, 10 on
            # NCCL) whatever the job asked for.
            for mesh in (
                *(self.world[d] for d in MESH_DIMS),
                self.dp_shard,
                self.dp,
                self.dp_shard_cp,
                self.loss,
                self.ep,
            ):
                set_timeout(timeout, mesh.get_group())

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.world[name]

    @cached_property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def hsdp(self) -> DeviceMesh:
        """(dp_replicate, dp_shard_cp) as a 2-D mesh for HSDP: parameters are sharded over dp_shard
        × cp."""
        return DeviceMesh._concatenate([self.world["dp_replicate"], self.dp_shard_cp])

    def experts_mesh(self, by_expert: bool, by_width: bool) -> DeviceMesh:
        """What routed experts are split over: by expert over ``ep``, by width over ``tp``, or both
        (2-D)."""
        dims = [
            d for d, split in ((self.ep.mesh_dim_names[0], by_expert), ("tp", by_width)) if split
        ]
        return self.world[tuple(dims)]

    @property
    def expert_dp(self) -> DeviceMesh:
        """What routed experts are FSDP-sharded over (ep takes the rest of dp_shard): HSDP's 2-D
        form under dp_replicate > 1."""
        if self.layout.dp_replicate > 1:
            return self.world["dp_replicate", "dp_shard_mod_ep"]
        return self.world["dp_shard_mod_ep"]

    @cached_property
    def expert_replicas(self) -> DeviceMesh:
        """``expert_dp`` as one dimension, made where asked for (ZeRO-1 under ep: the ranks its
        expert buckets reduce over)."""
        mesh = self.world["dp_replicate", "dp_shard_mod_ep"]._flatten("expert_replicas")
        if self.timeout is not None:
            set_timeout(self.timeout, mesh.get_group())
        return mesh
