"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from composer3d.parallel.zero import OptimizerStateSharder


def build_optimizer(model: nn.Module, cfg, zero1_mesh: DeviceMesh | None = None
                    ) -> tuple[torch.optim.Optimizer, OptimizerStateSharder | None]:
    """AdamW with weight decay on matrices only (not norms). With ``zero1_mesh`` its state is sharded (ZeRO-1)
    and the sharder, which also saves and loads that state, is returned with it."""
    params = list(model.parameters())
    decays = [p.ndim >= 2 for p in params]
    sharder = OptimizerStateSharder(params, zero1_mesh) if zero1_mesh is not None else None
    targets = sharder.shards if sharder else params
    groups = [
        {"params": [t for t, d in zip(targets, decays) if d], "weight_decay": cfg.weight_decay},
        {"params": [t for t, d in zip(targets, decays) if not d], "weight_decay": 0.0},
    ]
    optimizer = optimizer_class(cfg.name)([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas),
                                          eps=cfg.eps)
    if sharder:
        sharder.attach(optimizer)
    return optimizer, sharder


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """AdamW, or torchao's low-bit AdamW whose moments are stored in 8 bit, 4 bit or float8 (block-quantized)."""
    if name == "adamw":
        return torch.optim.AdamW
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

    # torchao compiles its optimizer step over quantized-state subclasses; with torch 2.13 the on-disk inductor
    # caches hand back a graph compiled for other parameter shapes ("wrong number of dimensions" asserts, or a
    # missing attribute for fp8 state). Compiling afresh in each process avoids that.
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    return {"adamw_8bit": AdamW8bit, "adamw_4bit": AdamW4bit, "adamw_fp8": AdamWFp8}[name]


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup to 1, then decay to ``min_ratio`` at ``total_steps`` (cosine or linear), or stay (constant)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1 - (1 - min_ratio) * progress


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg.warmup_steps, total_steps, cfg.schedule, cfg.min_lr_ratio)
    )
