"""Tensor parallel (Megatron column/row splits) and sequence parallel, from the model spec's plan."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from composer3d.models import ModelSpec


def apply_tensor_parallel(model: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          float8: bool = False) -> None:
    root_plan, block_plan = spec.tensor_parallel_plan(model, sequence_parallel, float8)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    # A pipeline stage may have dropped the embedding or the head.
    parallelize_module(model, tp_mesh, {name: style for name, style in root_plan.items() if _present(model, name)})
    if sequence_parallel and hasattr(model, "sequence_shards"):
        model.sequence_shards = tp_mesh.size()  # stages after the first see 1/tp of the sequence
    # The plan replaced the embedding and the head weights one by one; a tied model must share them again.
    model.tie_weights()


def _present(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False
