"""``parallelize``: the one function that knows the composition order.

1. pipeline split (this rank keeps its stages' layers), then LoRA adapters around the targeted
   linears (``peft``),
the rest frozen, 2. float8 conversion, 3. tensor/sequence parallel, then the experts of
mixture-of-experts layers by expert (ep) and width (tp), then context parallel's attention over the
cp ranks' shares of the sequence, then the feed-forwards in sequence tiles (``tiling``), 4.
activation checkpointing, 5. compile per block, then activation offload around each block's call
(outside its compiled graph and FSDP's hooks), 6. FSDP2 per block, then per root — where a
data-parallel dim (or cp) has more than one rank (or for CPU offload), and not under ZeRO-1 (its own
gradient buckets, ``zero``); on a world of one rank with ``precision.cast=params``, each parameter
cast once a forward (``cast_once``); otherwise autocast gives fp32-master, low-precision compute by
casting at every op. TP comes before FSDP so FSDP shards the DTensor params TP produced over the
data-parallel dims (2-D DTensors); float8 comes before TP because torchao's float8 TP styles shard
Float8Linear modules (the design card's order had it after TP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from composer3d.config.peft_schema import PeftConfig
from composer3d.config.schema import CompileConfig, MemoryConfig, ParallelConfig, PrecisionConfig
from composer3d.dtypes import DTYPES
from composer3d.memory.activation_checkpointing import apply_activation_checkpointing
from composer3d.memory.activation_offload import apply_activation_offload
from composer3d.memory.tiling import tile_feed_forwards
from composer3d.models import ModelSpec
from composer3d.parallel.data_parallel.fsdp import apply_data_parallel, mixed_precision, runs_fsdp
from composer3d.parallel.experts import shard_experts
from composer3d.parallel.mesh import ParallelMesh
from composer3d.parallel.pipeline.schedules import default_stages_per_rank
from composer3d.parallel.pipeline.stages import StageModule, plan_stages, prune_to_stages
from composer3d.parallel.pipeline.tied import split_tied_embedding
from composer3d.parallel.tensor import apply_tensor_parallel
from composer3d.peft.apply import apply_peft
from composer3d.precision.autocast import autocast_forward

if TYPE_CHECKING:  # built under cp > 1 only (below)
    from composer3d.parallel.context.context_parallel import ContextParallel
from composer3d.precision.cast_once import CastOnce, casts_once
from composer3d.precision.float8 import convert_to_float8


@dataclass
class Parallelized:
    """What the trainer needs of the dimensions ``parallelize`` applied; it never reaches into the
    model for them."""

    # this rank's pipeline stages ([] without PP)
    stages: list[StageModule] = field(default_factory=list)
    # the cp group's attention, which the model's attention also holds: the trainer places each
    # batch on it (``place``) and cuts its share of the rows before the forward reads that placement
    # (None: cp = 1)
    context: ContextParallel | None = None


def parallelize(
    model: nn.Module,
    spec: ModelSpec,
    mesh: ParallelMesh,
    device: torch.device,
    *,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    memory: MemoryConfig,
    compile: CompileConfig,
    peft: PeftConfig,
    windows: tuple[int, ...],
) -> Parallelized:
    """Parallelize ``model`` in place per the run's sections; returns what the trainer needs of it.
    ``precision.param_dtype`` must be resolved (not "auto"); ``windows``: each layer's sliding
    attention window (``ModelSpec.attention_windows``), which context parallel balances."""
    stages: list[StageModule] = []
    context = None
    if mesh.layout.pp > 1:
        schedule = parallel.pp_schedule
        plans = plan_stages(
            model,
            mesh["pp"].get_local_rank(),
            mesh.layout.pp,
            parallel.pp_stages_per_rank or default_stages_per_rank(schedule),
            schedule,
        )
        # a tied head becomes the embedding's twin on the last stage (``tied``)
        split_tied_embedding(model, mesh.world.mesh, device, mesh.timeout)
        prune_to_stages(model, plans)
        stages = [StageModule(model, plan) for plan in plans]
    if peft.method != "none":  # adapters before TP, which splits each with its base linear
        apply_peft(model, peft)
    float8 = precision.float8.enabled
    if float8:
        convert_to_float8(
            model,
            precision.float8.recipe,
            device,
            fsdp_float8_all_gather=mesh.layout.dp_shard > 1 and parallel.zero_stage != 1,
        )
    if mesh.layout.tp > 1:
        # float8 TP styles all-gather float8 tensors, which gloo cannot carry: plain styles on the
        # CPU.
        apply_tensor_parallel(
            model,
            spec,
            mesh["tp"],
            parallel.sequence_parallel,
            float8=float8 and precision.float8.recipe == "tensorwise" and device.type != "cpu",
        )
    shard_experts(model, mesh, parallel.sequence_parallel)
    if mesh.layout.cp > 1:  # attention over the whole sequence from each rank's share of it
        # here: its compile boundary (torch.compiler.disable) imports dynamo, a second of each
        # worker's start that a run without cp or compile has no use for
        from composer3d.parallel.context.context_parallel import ContextParallel

        context = ContextParallel(
            mesh["cp"], parallel.cp_style, parallel.cp_balance, windows, parallel.cp_ulysses
        )
        model.use_context_parallel(context)
    # before checkpointing, which then recomputes a block around its tiles; after TP, whose hooks
    # run per tile
    tile_feed_forwards(model, memory.tile_mlp)
    apply_activation_checkpointing(
        model,
        memory.activation_checkpointing,
        memory.ac_every,
        memory.ac_policy,
        memory.ac_save_gathers,
    )
    if compile.enabled:
        for block in model.layers.values():
            block.compile()  # in place: parameter names unchanged
    # around each block's call: outside its compiled graph and FSDP's hooks
    if memory.activation_offload:
        apply_activation_offload(model, device)
    if runs_fsdp(mesh, parallel):
        apply_data_parallel(
            model,
            mesh,
            parallel.zero_stage,
            mixed_precision(precision.param_dtype, precision.reduce_dtype),
            parallel.reshard_after_forward,
            roots=list(stages),
            offload=parallel.offload == "cpu",
        )
    elif casts_once(mesh.layout.world_size, precision, parallel.offload):
        CastOnce(model, DTYPES[precision.param_dtype]).attach(model)
    # no data-parallel dim, or ZeRO-1, or cast=autocast: fp32 parameters, low-precision compute by
    # autocast
    else:
        autocast_forward(stages or [model], precision.param_dtype, device)
    return Parallelized(stages, context)
