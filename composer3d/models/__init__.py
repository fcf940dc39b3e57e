"""The model families, by ``model.name``: each a ``ModelSpec`` (what it is from its config) whose
models offer ``ComposerModel`` (what a built model gives parallel/ and the trainer); both in
``models.interface``.

Families: ``llama`` (composer3d's own transformer, dense or mixture-of-experts: ``llama``, ``moe``)
and ``hf`` (any Hugging Face causal LM: the package ``hf``, reached only through its ``__init__``).
``init`` materializes any of them, layout-independently.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from composer3d.config.schema import ModelConfig
from composer3d.models import hf, llama
from composer3d.models.interface import ComposerModel, ModelSpec, Routing

MODEL_REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in (llama.SPEC, hf.SPEC)}


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of ``cfg`` on the meta device: no memory, no initialization yet."""
    with torch.device("meta"):
        return MODEL_REGISTRY[cfg.name].build(cfg)


def count_params(model: nn.Module) -> int:
    """Parameters of the whole (unsharded) model; works on meta, sharded or plain models."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODEL_REGISTRY", "ComposerModel", "ModelSpec", "Routing", "build_model", "count_params"]
