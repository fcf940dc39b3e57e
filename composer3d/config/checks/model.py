"""The model: a known architecture, sizes that fit together (heads, kv heads, RoPE pairs) and the
mixture-of-experts settings; ``resolve_model_config`` fills what model=hf reads from its
config.json."""

from __future__ import annotations

from typing import Any

from composer3d.config.checks.common import _divisors, _require
from composer3d.errors import require_hf_extra
from composer3d.models import MODEL_REGISTRY


def resolve_model_config(m: Any) -> None:
    """Fill what a model config leaves to its source: model=hf reads its sizes from
    <model.path>/config.json."""
    if m.name == "hf":
        from composer3d.models.hf import fill_model_config

        require_hf_extra("model", "model=hf (a Hugging Face model)")

        fill_model_config(m)


def _check_model(m: Any) -> None:
    _require(
        m.name in MODEL_REGISTRY,
        "model.name",
        f"unknown model {m.name!r}",
        f"Choose one of {sorted(MODEL_REGISTRY)} (or a config in the model= group)",
    )
    # sizes come from its config.json (resolve_model_config); transformers checks them
    if m.name == "hf":
        _require(
            bool(m.path), "model.path", "model=hf needs the model directory", "Set model.path=<dir>"
        )
        return
    for key in ("dim", "n_layers", "n_heads", "vocab_size"):
        value = getattr(m, key)
        _require(value >= 1, f"model.{key}", f"must be >= 1, got {value}", "Use a positive size")
    _require(
        m.head_dim in (None, m.dim // m.n_heads),
        "model.head_dim",
        f"the native llama's heads are dim / n_heads = {m.dim // m.n_heads} wide, got {m.head_dim}",
        "Use model.head_dim=null",
    )
    _require(
        m.n_kv_heads is None or m.n_kv_heads >= 1,
        "model.n_kv_heads",
        f"must be >= 1, got {m.n_kv_heads}",
        "Use null for as many kv heads as query heads",
    )
    n_kv = m.n_kv_heads or m.n_heads
    _require(
        m.dim % m.n_heads == 0,
        "model.n_heads",
        f"does not divide model.dim={m.dim}",
        f"Choose n_heads among {_divisors(m.dim)}",
    )
    _require(
        m.n_heads % n_kv == 0,
        "model.n_kv_heads",
        f"{n_kv} does not divide model.n_heads={m.n_heads} (grouped-query attention shares each kv "
        "head among a whole number of query heads)",
        f"Choose n_kv_heads among {_divisors(m.n_heads)}",
    )
    _require(
        (m.dim // m.n_heads) % 2 == 0,
        "model.n_heads",
        f"head dim {m.dim // m.n_heads} is odd; RoPE rotates pairs",
        "Choose n_heads so that dim / n_heads is even",
    )
    _check_moe(m)


def _check_moe(m: Any) -> None:
    moe = m.moe
    _require(
        moe.experts >= 0,
        "model.moe.experts",
        f"must be >= 0, got {moe.experts}",
        "Use 0 for a dense model",
    )
    if moe.experts == 0:
        return
    _require(
        1 <= moe.top_k <= moe.experts,
        "model.moe.top_k",
        f"must be between 1 and experts={moe.experts}, got {moe.top_k}",
        "Route each token to a few experts, e.g. 2",
    )
    _require(
        moe.shared_experts >= 0,
        "model.moe.shared_experts",
        f"must be >= 0, got {moe.shared_experts}",
        "Use 0 or 1",
    )
    _require(
        moe.expert_hidden_dim is None or moe.expert_hidden_dim >= 1,
        "model.moe.expert_hidden_dim",
        f"must be >= 1, got {moe.expert_hidden_dim}",
        "Use null for the dense layers' width",
    )
    _require(
        0 <= moe.dense_layers < m.n_layers,
        "model.moe.dense_layers",
        f"must be between 0 and n_layers-1={m.n_layers - 1} (at least one MoE layer), got "
        f"{moe.dense_layers}",
        "Use 0 or 1",
    )
    _require(
        moe.score_func in ("softmax", "sigmoid"),
        "model.moe.score_func",
        f"unknown {moe.score_func!r}",
        "Choose softmax or sigmoid",
    )
    _require(
        moe.score_func == "softmax" or moe.normalize_top_k or moe.top_k == 1,
        "model.moe.normalize_top_k",
        "sigmoid scores do not sum to one: unnormalized, the mixing weights of top_k > 1 experts "
        "would add up to as much as top_k",
        "Use model.moe.normalize_top_k=true with score_func=sigmoid",
    )
    for key in ("aux_loss_coef", "bias_update_rate", "capacity_factor"):
        value = getattr(moe, key)
        _require(
            value >= 0, f"model.moe.{key}", f"must be >= 0, got {value}", "Use 0 to turn it off"
        )
    _require(
        moe.route_scale > 0,
        "model.moe.route_scale",
        f"must be > 0, got {moe.route_scale}",
        "Use 1.0",
    )
