"""Tensor parallel (Megatron column/row splits) and sequence parallel, from the model spec's
plan."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from composer3d.models import ModelSpec
from composer3d.models.interface import has_submodule
from composer3d.peft.apply import tensor_parallel_styles


def apply_tensor_parallel(
    model: nn.Module,
    spec: ModelSpec,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    float8: bool = False,
) -> None:
    root_plan, block_plan = spec.tensor_parallel_plan(model, sequence_parallel, float8)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    for block in model.layers.values():
        # A mixture-of-experts block has no dense feed-forward: its experts are split by
        # ``parallel.experts``. LoRA adapters are split with their base linears (``peft``)
        parallelize_module(
            block,
            tp_mesh,
            tensor_parallel_styles(
                block,
                {
                    name: style
                    for name, style in block_plan.items()
                    if "*" in name or has_submodule(block, name)
                },
            ),
        )
    # A pipeline stage may have dropped the embedding or the head.
    parallelize_module(
        model,
        tp_mesh,
        {name: style for name, style in root_plan.items() if has_submodule(model, name)},
    )
    if sequence_parallel and hasattr(model, "sequence_shards"):
        model.sequence_shards = tp_mesh.size()  # stages after the first see 1/tp of the sequence
    # The plan replaced the embedding and the head weights one by one; a tied model must share them
    # again.
    model.tie_weights()
    # SequenceParallel (and distribute_module) make new parameters that require gradients: frozen
    # ones stay frozen
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def keep_grads_in_param_layout(model: nn.Module) -> None:
    """DTensor's embedding backward returns the vocab-sharded weight's gradient replicated: whole on
    every rank. FSDP's reduce-scatter re-shards it; where FSDP does not run (TP-only layouts) it
    would stay whole, 4x the shard's bytes at tp=4. Slice it back to the parameter's layout as it
    accumulates (Replicate -> Shard is local)."""
    for param in model.parameters():
        # frozen ones (peft's base) get no gradient
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_grad_to_param_layout)


def _grad_to_param_layout(param: DTensor) -> None:
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)
