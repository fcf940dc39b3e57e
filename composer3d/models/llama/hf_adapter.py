"""The native Llama <-> Hugging Face LlamaForCausalLM mapping: parameter names, RoPE layout and
config fields.

For composer3d-convert (``composer3d.convert``, whose Mixtral export builds on it:
``convert.mixtral``) and for any later loader of Hugging Face models. Plain tensors and dicts in,
plain tensors and dicts out: no transformers import.
"""

from __future__ import annotations

import torch

from composer3d.config.schema import ModelConfig
from composer3d.models.llama.model import ffn_hidden_dim

# Per-layer names: native suffix -> Hugging Face suffix (w1 is the gate, w3 the up projection, w2
# the down one).
HF_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
HF_ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Native parameter name -> Hugging Face name for every parameter of ``cfg``'s model.

    With tied embeddings ``output.weight`` is the embedding itself and has no Hugging Face name of
    its own.
    """
    names = {
        k: v for k, v in HF_ROOT_NAMES.items() if not (cfg.tie_embeddings and k == "output.weight")
    }
    for i in range(cfg.n_layers):
        names.update(
            {f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in HF_LAYER_NAMES.items()}
        )
    return names


def rope_interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q or k projection, per head, from RoPE on interleaved pairs
    (x[2i], x[2i+1]), as this model and Meta's code rotate, to pairs (x[i], x[i + head_dim/2]), as
    Hugging Face's rotate_half does. The same permutation as transformers'
    ``convert_llama_weights_to_hf.py``."""
    rows, cols = weight.shape
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    )


def rope_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``rope_interleaved_to_half``."""
    rows, cols = weight.shape
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)
    )


def _rope_heads(native_name: str, cfg: ModelConfig) -> int | None:
    """Heads whose rows RoPE rotates in this weight (q or k projections), else None."""
    if native_name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if native_name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads or cfg.n_heads
    return None


def hf_state_dict_from_native(
    state: dict[str, torch.Tensor], cfg, names: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """A native model state dict (whole tensors) as LlamaForCausalLM's: renamed, q/k rows permuted
    for rotate_half.

    ``lm_head.weight`` is left out under tied embeddings (Hugging Face ties it to the embedding on
    load). ``names`` (native → Hugging Face) maps a subset (another architecture's shared part),
    else ``hf_names(cfg)``. Raises KeyError naming any parameter ``state`` lacks; extra entries
    (such as a tied ``output.weight``) are ignored.
    """
    names = hf_names(cfg) if names is None else names
    missing = [k for k in names if k not in state]
    if missing:
        raise KeyError(
            f"the model state lacks {len(missing)} parameters of the config, e.g. {missing[:3]}"
        )
    out = {}
    for native, hf in names.items():
        heads = _rope_heads(native, cfg)
        out[hf] = state[native] if heads is None else rope_interleaved_to_half(state[native], heads)
    return out


def native_state_dict_from_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict as the native model's (the inverse of
    ``hf_state_dict_from_native``).

    Under tied embeddings ``output.weight`` is the embedding tensor again (``model.state_dict()``
    has both names), and a ``lm_head.weight`` in ``state`` is ignored. RoPE ``inv_freq`` buffers
    some old checkpoints hold are ignored; raises KeyError naming missing or unexpected parameters.
    """
    names = hf_names(cfg)
    expected = set(names.values())
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = sorted(expected - set(state))
    unexpected = sorted(
        k
        for k in state
        if k not in expected and k not in ignored and not k.endswith("rotary_emb.inv_freq")
    )
    if missing or unexpected:
        raise KeyError(
            f"the Hugging Face state does not match the config: missing {missing[:3]} "
            f"({len(missing)} in all), unexpected {unexpected[:3]} ({len(unexpected)} in all)"
        )
    out = {}
    for native, hf in names.items():
        heads = _rope_heads(native, cfg)
        out[native] = state[hf] if heads is None else rope_half_to_interleaved(state[hf], heads)
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config_from_native(cfg: ModelConfig) -> dict:
    """LlamaConfig keyword arguments (transformers 5 spelling: RoPE under ``rope_parameters``) for
    ``cfg``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_dim(
            cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim
        ),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
    }


def native_config_from_hf(hf: dict, ignore_rope_scaling: bool = False) -> dict:
    """ModelConfig fields (``ffn_hidden_dim`` explicit) for a Hugging Face Llama ``config.json`` (as
    a dict).

    Reads both transformers 5 (``rope_parameters``) and 4 (``rope_theta``, ``rope_scaling``)
    spellings. Raises ValueError naming what this model cannot represent: another architecture,
    biases, another activation, a head dim other than hidden_size / heads, or RoPE scaling (e.g.
    Llama-3.1's "llama3" rope type) unless ``ignore_rope_scaling``, which drops it (the model then
    differs from the original beyond the base frequencies).
    """
    if hf.get("model_type") != "llama":
        raise ValueError(
            f"model_type is {hf.get('model_type')!r}, not 'llama': only Llama models "
            "(LlamaForCausalLM) convert to composer3d's llama"
        )
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (the model uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (the model has no biases)")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // n_heads) or dim % n_heads:
        problems.append(
            f"head_dim={hf.get('head_dim')} with hidden_size={dim} and {n_heads} heads (the model "
            "needs head_dim = hidden_size / num_attention_heads)"
        )
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    rope_type = (
        rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if rope_type != "default" and not ignore_rope_scaling:
        problems.append(
            f"RoPE type {rope_type!r} (the model implements plain RoPE only; pass "
            "--ignore-rope-scaling to drop the scaling and keep the base frequency)"
        )
    if problems:
        raise ValueError(
            "this Llama config uses features composer3d's llama lacks: " + "; ".join(problems)
        )
    return {
        "name": "llama",
        "dim": dim,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "vocab_size": hf["vocab_size"],
        "ffn_hidden_dim": hf["intermediate_size"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
