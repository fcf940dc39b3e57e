"""What the config's types cannot express: layouts that do not multiply to the world size, batch
sizes that do not divide, keys that only make sense together. One check function per concern,
grouped by area in this package's modules; ``validate`` runs them all.

Validation runs before any process group exists, on every rank alike (and once in the launcher
before any worker starts), so a bad config fails fast with one message naming the key instead of
hanging in a collective.

The areas: ``layout`` (parallel degrees, sharding, tensor/sequence, expert and pipeline parallel),
``model`` (the architecture and its MoE layers), ``peft`` (LoRA, QLoRA), ``training`` (batch, loop,
optimizer, precision, memory, generation), ``data``, ``preference`` (the objective: DPO and its
kin) and ``runtime`` (checkpoints, launch, logging); ``common`` holds ``_require``, through which
every check fails. This module holds the entry points and the checks no area owns: unknown keys, and
what only fails on some devices.
"""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import DictConfig, OmegaConf

from composer3d.config.checks.common import _require
from composer3d.config.checks.data import _check_data
from composer3d.config.checks.layout import (
    _check_layout,
    _check_pipeline,
    pipeline_microbatches,
    resolve_degrees,
)
from composer3d.config.checks.model import _check_model, resolve_model_config
from composer3d.config.checks.peft import _check_peft
from composer3d.config.checks.preference import _check_objective
from composer3d.config.checks.runtime import _check_checkpoint, _check_launch_and_logging
from composer3d.config.checks.training import (
    _check_batch,
    _check_generate,
    _check_loop,
    _check_memory,
    _check_optimizer,
    _check_precision,
    _check_qk_clip,
)
from composer3d.config.keys import did_you_mean
from composer3d.config.schema import TrainConfig
from composer3d.parallel.mesh import Layout

__all__ = [
    "pipeline_microbatches",
    "resolve_degrees",
    "resolve_model_config",
    "validate",
    "validate_data",
    "validate_for_device",
]


def validate(cfg: Any, world_size: int) -> Layout:
    """Check every combination types cannot express; returns the resolved layout. Raises
    ConfigError."""
    _require(
        world_size >= 1,
        "launch.nproc_per_node",
        f"world size must be >= 1, got {world_size}",
        "Use 1 or more",
    )
    _check_known_keys(cfg)
    layout = resolve_degrees(cfg.parallel, world_size)
    _check_model(cfg.model)
    _check_layout(cfg, layout)
    _check_pipeline(cfg, layout.pp, layout.dp)
    _check_batch(cfg, layout)
    _check_loop(cfg.train, cfg.eval)
    _check_generate(cfg.generate, cfg.model.name)
    _check_optimizer(cfg.optim, cfg.parallel)
    _check_qk_clip(cfg)
    _check_precision(cfg.precision, layout.tp, world_size, cfg.parallel.zero_stage, cfg.peft.method)
    _check_memory(cfg, layout)
    _check_peft(cfg, layout)
    _check_data(cfg.data, cfg.model)
    _check_objective(cfg, layout)
    _check_checkpoint(cfg.checkpoint)
    _check_launch_and_logging(cfg.launch, cfg.logging, cfg.checkpoint)
    return layout


def validate_data(cfg: Any) -> None:
    """The checks of what ``composer3d-prepare`` reads (the data and model keys); the layout is not
    its concern."""
    _check_known_keys(cfg)
    _check_model(cfg.model)
    _check_data(cfg.data, cfg.model)


def _check_known_keys(cfg: Any) -> None:
    """Hydra's ``+key=value`` adds a key the schema lacks (plain ``key=value`` is refused before
    Hydra composes: config.keys); nothing would read it, so a typo would silently change nothing."""
    if not isinstance(cfg, DictConfig):
        return
    unknown = _unknown_keys(OmegaConf.to_container(cfg, resolve=False), _schema_keys(), "")
    _require(
        not unknown,
        unknown[0] if unknown else "",
        "is not a composer3d setting (added with Hydra's +), so nothing would read it",
        f"Remove it. {did_you_mean(unknown[0]) if unknown else ''}",
    )


@functools.cache
def _schema_keys() -> dict:
    """The schema's sections and keys (read, never changed), built once: OmegaConf takes a tenth of
    a second to build the structured config."""
    return OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False)


def _unknown_keys(given: dict, schema: dict, prefix: str) -> list[str]:
    found = []
    for key, value in given.items():
        if key in schema and not (isinstance(value, dict) and isinstance(schema[key], dict)):
            continue
        # an unknown section is named by its keys, as the user typed them
        if isinstance(value, dict):
            section = schema.get(key)
            found += _unknown_keys(
                value, section if isinstance(section, dict) else {}, f"{prefix}{key}."
            )
        else:
            found.append(f"{prefix}{key}")
    return found


def validate_for_device(cfg: Any, layout: Layout, device_type: str) -> None:
    """What only fails on some devices (checked on every rank once the device is known, before any
    collective)."""
    if device_type != "cpu":
        return
    _require(
        cfg.checkpoint.async_mode != "async_pinned",
        "checkpoint.async_mode",
        "async_pinned stages into pinned host memory, which needs an accelerator; this run is on "
        "the CPU",
        "Use checkpoint.async_mode=async",
    )
    _require(
        not (cfg.compile.enabled and layout.tp > 1),
        "compile.enabled",
        "torch.compile of tensor-parallel blocks gives wrong gradients on the CPU backend in torch "
        "2.13 (the loss leaves the uncompiled curve from the second step)",
        "Use compile.enabled=false with parallel.tp>1 on CPU",
    )
