"""Layout: the parallel degrees, and the DeviceMesh they define.

Mesh dims, outer to inner: pp, dp_replicate, dp_shard, cp, tp — tensor-parallel groups are consecutive ranks
(one node, fastest links) and pipeline stages span the farthest. Dims of size 1 exist too, so code never asks
whether a dim is there. Flattened views: ``dp`` (replicate × shard, feeds data loading), ``dp_shard_cp`` (what
FSDP shards over) and ``loss`` (dp × cp, where losses and token counts are reduced).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
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

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ParallelMesh:
    """The world DeviceMesh with its named sub-meshes and flattened views (kept here, not sliced again later)."""

    def __init__(self, layout: Layout, device_type: str, timeout: timedelta | None = None):
        """``timeout``: the collective timeout of every group of the mesh (None: torch's defaults)."""
        self.layout = layout
        self.world: DeviceMesh = init_device_mesh(
            device_type, tuple(getattr(layout, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
        )
        self.dp: DeviceMesh = self.world["dp_replicate", "dp_shard"]._flatten("dp")
        self.dp_shard_cp: DeviceMesh = self.world["dp_shard", "cp"]._flatten("dp_shard_cp")
        self.loss: DeviceMesh = self.world["dp_replicate", "dp_shard", "cp"]._flatten("loss")
        if timeout is not None:
            # A mesh dim spanning the world reuses the default group (init_process_group's timeout); the others are
            # new groups, which torch gives its own default (30 min on gloo, 10 on NCCL) whatever the job asked for.
            for mesh in (*(self.world[d] for d in MESH_DIMS), self.dp, self.dp_shard_cp, self.loss):
                _set_pg_timeout(timeout, mesh.get_group())

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.world[name]

    @cached_property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def hsdp(self) -> DeviceMesh:
        """(dp_replicate, dp_shard) as a 2-D mesh for HSDP; with cp > 1 the shard dim will be dp_shard_cp."""
        return self.world["dp_replicate", "dp_shard"]


def layout_from_degrees(degrees: dict[str, int]) -> Layout:
    return Layout(**{k: degrees[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")})
