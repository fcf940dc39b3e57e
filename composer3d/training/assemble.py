"""The model a run trains or evaluates: built on meta, parallelized, then initialized or loaded into
its shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from composer3d.config.checks.preference import reference_each_step
from composer3d.config.peft_schema import PeftConfig
from composer3d.config.schema import TrainConfig
from composer3d.models import MODEL_REGISTRY, build_model, count_params
from composer3d.models.init import materialize
from composer3d.parallel.compose import parallelize
from composer3d.parallel.data_parallel.fsdp import runs_fsdp
from composer3d.parallel.mesh import ParallelMesh
from composer3d.parallel.pipeline.stages import StageModule
from composer3d.parallel.pipeline.tied import check_twins_match, init_aliases
from composer3d.parallel.tensor import keep_grads_in_param_layout
from composer3d.peft.adapter_files import load_adapters
from composer3d.peft.apply import adapter_params, saved_params, trainable_params
from composer3d.peft.base import base_source, fill_base
from composer3d.training.flops import (
    attention_layers,
    embedding_params,
    flops_per_token,
    forward_flops_per_token,
)

if TYPE_CHECKING:  # built under cp > 1 only (parallel/compose.py)
    from composer3d.parallel.context.context_parallel import ContextParallel


@dataclass
class ParallelModel:
    model: nn.Module
    stages: list[StageModule]  # this rank's pipeline stages ([] without PP)
    # the cp group's attention (None: cp = 1), as ``parallelize`` returned it
    context: ContextParallel | None
    num_params: int  # of the whole model, before any split
    # of those, what the optimizer updates (``peft``: the adapters and modules_to_save)
    trainable_params: int
    # that one token goes through (mixture of experts: only top_k routed experts a layer)
    active_params: int
    # training FLOPs per token of the whole model (``flops``; with DPO, the reference's forward too)
    flops_per_token: int


def build_parallel_model(
    cfg: TrainConfig,
    mesh: ParallelMesh,
    device: torch.device,
    from_checkpoint: bool = False,
    base: dict | None = None,
) -> ParallelModel:
    """``from_checkpoint``: a checkpoint's weights replace every parameter next, so they are only
    allocated (no init, no read of model.path's weights, which need not be there any more). A peft
    run's checkpoint holds only what trains: its frozen base is built from ``base``
    (``checkpoint.peft_base``; None: this config's source)."""
    spec = MODEL_REGISTRY[cfg.model.name]
    model = build_model(cfg.model)
    num_params = count_params(model)
    active_params = num_params - model.inactive_params()
    m = cfg.model
    matmul, embedding, trained = _matmul_params(model, active_params, cfg.peft)
    windows = spec.attention_windows(m)
    layers = attention_layers(windows, cfg.train.seq_len)
    width = m.n_heads * (m.head_dim or m.dim // m.n_heads)
    flops = flops_per_token(matmul, embedding, layers, width, cfg.train.seq_len, trained)
    if reference_each_step(cfg):
        # the reference's forward on every token: the base's matmuls (a frozen copy, or the policy
        # with LoRA's adapters off) and its attention, counted as they run (TFLOP/s, MFU)
        base_matmul = active_params - embedding
        flops += forward_flops_per_token(base_matmul, layers, width, cfg.train.seq_len)
    trainable = num_params if cfg.peft.method == "none" else trainable_params(model, cfg.peft)
    parallelized = parallelize(
        model,
        spec,
        mesh,
        device,
        parallel=cfg.parallel,
        precision=cfg.precision,
        memory=cfg.memory,
        compile=cfg.compile,
        peft=cfg.peft,
        windows=tuple(windows),
    )
    stages = parallelized.stages
    offload = cfg.parallel.offload == "cpu"
    # FSDP's CPU offload keeps the parameters in host memory and requires them there from the start.
    placement = {"fsdp_roots": stages, "compute_device": device, "aliases": init_aliases(model)}
    if cfg.peft.method != "none":
        fill_base(
            model,
            spec,
            cfg.model,
            base or base_source(cfg),
            cfg.train.seed,
            torch.device("cpu") if offload else device,
            **placement,
        )
    else:
        weights = None if from_checkpoint else spec.pretrained_weights(cfg.model)
        materialize(
            model,
            torch.device("cpu") if offload else device,
            cfg.train.seed,
            init_params=weights is None and not from_checkpoint,
            **placement,
        )
        if weights is not None:
            spec.load_pretrained(model, weights)
    # a PEFT adapter directory's adapters instead of fresh ones
    if cfg.peft.init_from and not from_checkpoint:
        load_adapters(model, cfg.peft.init_from, cfg.model)
    check_twins_match(model)
    if not runs_fsdp(mesh, cfg.parallel):  # after materialize: it makes the parameters
        keep_grads_in_param_layout(model)
    return ParallelModel(
        model, stages, parallelized.context, num_params, trainable, active_params, flops
    )


def _matmul_params(
    model: nn.Module, active_params: int, peft: PeftConfig
) -> tuple[int, int, int | None]:
    """``flops_per_token``'s counts, on the whole model before any split: (the active parameters,
    with LoRA's adapters; the embedding tables'; with peft, those that get a weight gradient in a
    matmul: the adapters and the saved modules but an embedding table, else None: all)."""
    embedding = embedding_params(model)
    if peft.method == "none":
        return active_params, embedding, None
    adapters = adapter_params(model, peft)
    tables = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    saved = sum(p.numel() for key, p in saved_params(model, peft).items() if key not in tables)
    return active_params + adapters, embedding, adapters + saved
