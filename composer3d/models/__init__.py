"""Model registry: a ModelSpec says how to build a model on meta and how to tensor-parallelize it.

A model built from a spec offers ``init_rule(name)`` and ``init_buffers(device)`` (see ``models.init``),
``tie_weights()``, and ``layers`` (an ``nn.ModuleDict`` of blocks: the unit of FSDP wrapping, and later of
activation checkpointing and pipeline splitting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from composer3d.models import llama


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[Any], nn.Module]
    # (model, sequence_parallel, float8) -> (plan for root modules, plan for each block)
    tensor_parallel_plan: Callable[[nn.Module, bool, bool], tuple[dict, dict]]
    # Sizes that tensor parallel splits, for validation: (config key, value) pairs
    tp_split_sizes: Callable[[Any], list[tuple[str, int]]]


def _llama_split_sizes(cfg) -> list[tuple[str, int]]:
    hidden = llama.ffn_hidden_dim(cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim)
    return [("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.n_kv_heads or cfg.n_heads),
            ("model.vocab_size", cfg.vocab_size), ("model.ffn_hidden_dim", hidden)]


MODEL_REGISTRY: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", llama.Llama, llama.tensor_parallel_plan, _llama_split_sizes),
}


def build_model(cfg) -> nn.Module:
    """The model of ``cfg`` on the meta device: no memory, no initialization yet."""
    with torch.device("meta"):
        return MODEL_REGISTRY[cfg.name].build(cfg)


def count_params(model: nn.Module) -> int:
    """Parameters of the whole (unsharded) model; works on meta, sharded or plain models."""
    return sum(p.numel() for p in model.parameters())
