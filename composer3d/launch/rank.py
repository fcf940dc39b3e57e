"""What every command's rank does before its process group exists: validate, pick the device,
resolve precision."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from composer3d.config.checks import validate, validate_for_device
from composer3d.config.schema import TrainConfig
from composer3d.launch import distributed
from composer3d.parallel.mesh import Layout
from composer3d.precision.autocast import auto_cast


def prepare_rank(cfg: DictConfig, env: distributed.Env | None) -> tuple[Layout, torch.device]:
    """Checks and settings every rank makes before its process group exists (training and evaluation
    alike): the layout, this rank's device, and the resolved compute dtype."""
    layout = validate(cfg, env.world_size if env else 1)
    device = distributed.resolve_device(
        cfg.launch.device, env.local_rank if env else 0, cfg.memory.expandable_segments
    )
    validate_for_device(cfg, layout, device.type)
    resolve_precision(cfg, device, env.world_size if env else 1)
    return layout, device


def resolve_precision(cfg: TrainConfig, device: torch.device, world_size: int) -> None:
    """``precision.param_dtype=auto``: bf16 where it is fast, fp32 on the CPU;
    ``precision.cast=auto``: ``precision.autocast.auto_cast``. In place, so the run's config.yaml
    records what ran."""
    if cfg.precision.param_dtype == "auto":
        cfg.precision.param_dtype = "float32" if device.type == "cpu" else "bfloat16"
    if cfg.precision.cast == "auto":
        cfg.precision.cast = auto_cast(
            distributed.is_accelerator(device),
            world_size,
            cfg.compile.enabled,
            cfg.parallel.zero_stage,
            cfg.peft.method,
        )
