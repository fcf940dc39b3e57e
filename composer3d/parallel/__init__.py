"""``parallelize``: the one function that knows the composition order.

1. pipeline split (this rank keeps its stages' layers), 2. tensor/sequence parallel, 3. float8 (not yet), 4. activation checkpointing
(not yet), 5. compile (not yet), 6. FSDP2 per block, then the root. TP comes before FSDP so FSDP shards the
DTensor params TP produced over the data-parallel dims (2-D DTensors).
"""

from __future__ import annotations

import torch.nn as nn

from composer3d.layout import ParallelMesh
from composer3d.models import ModelSpec
from composer3d.parallel.fsdp import apply_data_parallel, mixed_precision
from composer3d.parallel.pipeline import StageModule, default_stages_per_rank, plan_stages, prune_to_stages
from composer3d.parallel.tensor import apply_tensor_parallel


def parallelize(model: nn.Module, spec: ModelSpec, mesh: ParallelMesh, parallel_cfg, precision_cfg
                ) -> list[StageModule]:
    """Parallelize ``model`` in place; returns the pipeline stage modules this rank runs ([] without PP)."""
    stages: list[StageModule] = []
    if mesh.layout.pp > 1:
        schedule = parallel_cfg.pp_schedule
        plans = plan_stages(model, mesh["pp"].get_local_rank(), mesh.layout.pp,
                            parallel_cfg.pp_stages_per_rank or default_stages_per_rank(schedule), schedule)
        prune_to_stages(model, plans)
        stages = [StageModule(model, plan) for plan in plans]
    if mesh.layout.tp > 1:
        apply_tensor_parallel(model, spec, mesh["tp"], parallel_cfg.sequence_parallel)
    apply_data_parallel(model, mesh, parallel_cfg.zero_stage,
                        mixed_precision(precision_cfg.param_dtype, precision_cfg.reduce_dtype),
                        parallel_cfg.reshard_after_forward, roots=list(stages))
    return stages
