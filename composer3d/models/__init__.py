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
    # Why the model cannot run tensor parallel at all (None: it can); checked before launch
    tensor_parallel_problem: Callable[[Any], str | None] = lambda cfg: None
    # Directory of pretrained weights to load into the shards after parallelizing (None: initialize)
    pretrained_weights: Callable[[Any], str | None] = lambda cfg: None
    # (model config, tp degree): raises ConfigError where composer3d's forward of the model, or its tensor-parallel
    # split, would not compute what its reference computes; run before launch
    check_forward: Callable[[Any, int], None] = lambda cfg, tp: None
    # (model config) -> routed experts of each MoE layer (0: dense) and why expert parallel cannot shard them (None:
    # it can); checked before launch when parallel.ep > 1
    expert_parallel: Callable[[Any], tuple[int, str | None]] = lambda cfg: (cfg.moe.experts, None)


def _llama_split_sizes(cfg) -> list[tuple[str, int]]:
    hidden = llama.ffn_hidden_dim(cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim)
    sizes = [("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.n_kv_heads or cfg.n_heads),
             ("model.vocab_size", cfg.vocab_size)]
    moe = cfg.moe
    if moe.experts == 0 or moe.dense_layers > 0:
        sizes.append(("model.ffn_hidden_dim", hidden))
    if moe.experts > 0:  # each expert's width (the shared experts' is a multiple of it)
        sizes.append(("model.moe.expert_hidden_dim", moe.expert_hidden_dim or hidden))
    return sizes


def _hf_build(cfg) -> nn.Module:
    from composer3d.models.hf import HFCausalLM

    return HFCausalLM(cfg)


def _hf_plan(model, sequence_parallel: bool, float8: bool):
    from composer3d.models.hf_tensor_parallel import tensor_parallel_plan

    return tensor_parallel_plan(model, sequence_parallel, float8)


def _hf_tp_problem(cfg) -> str | None:
    from composer3d.models.hf_tensor_parallel import tensor_parallel_problem

    return tensor_parallel_problem(cfg)


def _hf_check_forward(cfg, tp: int) -> None:
    from composer3d.models.hf_forward_check import check_forward_matches_transformers

    check_forward_matches_transformers(cfg, tp)


def _hf_expert_parallel(cfg) -> tuple[int, str | None]:
    from composer3d.models.hf_experts import expert_parallel_support

    return expert_parallel_support(cfg)


def _hf_split_sizes(cfg):
    from composer3d.models.hf_tensor_parallel import tp_split_sizes

    return tp_split_sizes(cfg)


# transformers is imported only when an "hf" model is used.
MODEL_REGISTRY: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", llama.Llama, llama.tensor_parallel_plan, _llama_split_sizes),
    "hf": ModelSpec("hf", _hf_build, _hf_plan, _hf_split_sizes, tensor_parallel_problem=_hf_tp_problem,
                    pretrained_weights=lambda cfg: cfg.path if cfg.pretrained else None,
                    check_forward=_hf_check_forward, expert_parallel=_hf_expert_parallel),
}


def build_model(cfg) -> nn.Module:
    """The model of ``cfg`` on the meta device: no memory, no initialization yet."""
    with torch.device("meta"):
        return MODEL_REGISTRY[cfg.name].build(cfg)


def count_params(model: nn.Module) -> int:
    """Parameters of the whole (unsharded) model; works on meta, sharded or plain models."""
    return sum(p.numel() for p in model.parameters())
