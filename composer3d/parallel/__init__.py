"""``parallelize``: the one function that knows the composition order.

1. pipeline split (not yet), 2. tensor/sequence parallel, 3. float8 (not yet), 4. activation checkpointing
(not yet), 5. compile (not yet), 6. FSDP2 per block, then the root. TP comes before FSDP so FSDP shards the
DTensor params TP produced over the data-parallel dims (2-D DTensors).
"""

from __future__ import annotations

import torch.nn as nn

from composer3d.layout import ParallelMesh
from composer3d.models import ModelSpec
from composer3d.parallel.fsdp import apply_data_parallel, mixed_precision
from composer3d.parallel.tensor import apply_tensor_parallel


def parallelize(model: nn.Module, spec: ModelSpec, mesh: ParallelMesh, parallel_cfg, precision_cfg) -> nn.Module:
    if mesh.layout.tp > 1:
        apply_tensor_parallel(model, spec, mesh["tp"], parallel_cfg.sequence_parallel)
    apply_data_parallel(model, mesh, parallel_cfg.zero_stage,
                        mixed_precision(precision_cfg.param_dtype, precision_cfg.reduce_dtype))
    return model
