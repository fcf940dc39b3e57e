"""A native mixture-of-experts llama as Hugging Face's Mixtral (``MixtralForCausalLM``).

Mixtral is the transformers architecture whose layers are composer3d's MoE layer as it is: Llama
attention, and in every layer a router whose softmax scores (fp32) choose the top-k SwiGLU experts,
their scores renormalized to sum to one as the mixing weights; no shared experts, no routing bias,
no token dropped. A native model configured otherwise has no Mixtral form (``mixtral_mismatches``
names why). Each expert's weights are tensors of their own in Mixtral's checkpoints
(``block_sparse_moe.experts.<e>.w1``: Mistral's w1/w3/w2, the native names too), which transformers
fuses while loading.
"""

from __future__ import annotations

import torch

from composer3d.config.schema import ModelConfig
from composer3d.models import llama


def mixtral_mismatches(cfg: ModelConfig) -> list[str]:
    """What of model config ``cfg`` (a native MoE llama) Mixtral cannot express; empty if it can."""
    moe = cfg.moe
    checks = [
        (
            moe.shared_experts == 0,
            f"model.moe.shared_experts={moe.shared_experts} (Mixtral has no shared experts)",
        ),
        (
            moe.dense_layers == 0,
            (
                f"model.moe.dense_layers={moe.dense_layers} (every Mixtral layer is a mixture of "
                "experts)"
            ),
        ),
        (
            moe.score_func == "softmax",
            f"model.moe.score_func={moe.score_func} (Mixtral's router is a softmax)",
        ),
        (
            moe.normalize_top_k,
            "model.moe.normalize_top_k=false (Mixtral renormalizes the chosen experts' scores)",
        ),
        (
            moe.route_scale == 1.0,
            (
                f"model.moe.route_scale={moe.route_scale} (Mixtral does not scale the mixing "
                "weights)"
            ),
        ),
        (
            moe.capacity_factor == 0,
            f"model.moe.capacity_factor={moe.capacity_factor} (Mixtral drops no token)",
        ),
    ]
    return [reason for ok, reason in checks if not ok]


def expert_hidden_dim(cfg: ModelConfig) -> int:
    return cfg.moe.expert_hidden_dim or llama.ffn_hidden_dim(
        cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim
    )


def _attention_and_root_names(cfg: ModelConfig) -> dict[str, str]:
    """The dense mapping (native → Hugging Face) without its feed-forwards: embeddings, attention,
    norms, head."""
    return {k: v for k, v in llama.hf_names(cfg).items() if ".feed_forward." not in k}


def native_names(cfg: ModelConfig) -> list[str]:
    """The native tensors a Mixtral export reads: the dense mapping's without the dense
    feed-forwards, each MoE layer's router and stacked experts, and its routing bias (checked to be
    zero)."""
    names = list(_attention_and_root_names(cfg))
    for i in range(cfg.n_layers):
        names += [
            f"layers.{i}.moe.gate.weight",
            f"layers.{i}.moe.expert_bias",
            *(f"layers.{i}.moe.experts.{w}" for w in ("w1", "w2", "w3")),
        ]
    return names


def mixtral_state_from_native(
    state: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Whole native tensors (``native_names``) under Mixtral's checkpoint names; q/k rows permuted
    as for Llama. Raises ValueError if a layer's routing bias is not zero: Mixtral chooses experts
    by their scores alone."""
    out = llama.hf_state_dict_from_native(state, cfg, _attention_and_root_names(cfg))
    for i in range(cfg.n_layers):
        bias = state[f"layers.{i}.moe.expert_bias"]
        if bias.abs().max() > 0:
            raise ValueError(
                f"layer {i}'s routing bias (model.moe.bias_update_rate={cfg.moe.bias_update_rate}) "
                f"is not zero (largest {bias.abs().max().item():.3g}): it changes which experts "
                "are chosen, and Mixtral chooses by the router's scores alone"
            )
        prefix = f"model.layers.{i}.block_sparse_moe"
        out[f"{prefix}.gate.weight"] = state[f"layers.{i}.moe.gate.weight"]
        for w in ("w1", "w2", "w3"):
            for e, weight in enumerate(state[f"layers.{i}.moe.experts.{w}"]):
                # safetensors writes no shared storage
                out[f"{prefix}.experts.{e}.{w}.weight"] = weight.clone()
    return out


def mixtral_config_from_native(cfg: ModelConfig) -> dict:
    """MixtralConfig keyword arguments for ``cfg`` (transformers 5 spelling, as
    ``llama.hf_config_from_native``)."""
    dense = llama.hf_config_from_native(cfg)
    for key in ("attention_bias", "mlp_bias"):  # Mixtral has neither option: no biases
        dense.pop(key)
    return {
        **dense,
        "architectures": ["MixtralForCausalLM"],
        "intermediate_size": expert_hidden_dim(cfg),
        "num_local_experts": cfg.moe.experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }
