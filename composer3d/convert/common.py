"""What export and import share: the error they report, the model config they check, Hydra
overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


class ConvertError(Exception):
    """A problem with the user's input; main prints it and exits non-zero."""


def model_config(fields: dict):
    from composer3d.config.schema import ModelConfig, MoEConfig

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConvertError(f"the model config has keys ModelConfig does not know: {unknown}")
    cfg = ModelConfig(**{**fields, "moe": MoEConfig(**fields.get("moe", {}))})
    missing = [k for k in known if getattr(cfg, k) == "???"]  # omegaconf's MISSING
    if missing:
        raise ConvertError(f"the model config lacks required keys {sorted(missing)}")
    return cfg


def _override(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def hydra_overrides(model_fields: dict, checkpoint_dir: Path) -> list[str]:
    """Command-line overrides that make a run's model config equal ``model_fields`` and load
    ``checkpoint_dir``."""
    flat = {
        f"{k}.{sub}": v
        for k, group in model_fields.items()
        if isinstance(group, dict)
        for sub, v in group.items()
    }
    flat.update({k: v for k, v in model_fields.items() if not isinstance(v, dict)})
    return [f"model.{k}={_override(v)}" for k, v in flat.items()] + [
        f"checkpoint.resume={checkpoint_dir}"
    ]
