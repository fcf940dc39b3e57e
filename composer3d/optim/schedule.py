"""The learning-rate schedule: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math

import torch

from composer3d.config.schema import OptimConfig


def lr_multiplier(
    step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float
) -> float:
    """Linear warmup to 1, then decay to ``min_ratio`` at ``total_steps`` (cosine or linear), or
    stay (constant)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1 - (1 - min_ratio) * progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, optim.warmup_steps, total_steps, optim.schedule, optim.min_lr_ratio
        ),
    )
