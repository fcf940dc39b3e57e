"""A Hugging Face model's config.json: where it is, what transformers reads from it, the sizes
composer3d copies into ``model.*``, and the tiny replica of it that the launch-time checks build
(forward check, expert support)."""

from __future__ import annotations

import copy
import os

from composer3d.errors import ConfigError

REPLICA_VOCAB = 256
# a sliding window shorter than the check's tokens, so that windowed attention is exercised
REPLICA_WINDOW = 16


def resolve_model_dir(path: str | None) -> str:
    """A local directory for ``model.path``: the directory itself, or a hub id's snapshot in the
    local cache."""
    if not path:
        raise ConfigError(
            "model.path: model=hf needs the Hugging Face model to train. Set model.path=<local "
            "directory with config.json and *.safetensors> (or a hub id already in the local cache)"
        )
    if os.path.isdir(path):
        return os.path.abspath(path)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)  # never downloads
    except Exception:  # noqa: BLE001 — any failure means "not available locally"
        raise ConfigError(
            f"model.path: {path!r} is neither a local directory nor a model in the local Hugging "
            "Face cache (nothing is downloaded at run time). Download it first (huggingface-cli "
            "download) or point model.path at a directory holding config.json; a run that resumes "
            "from its checkpoint (e.g. after the model directory moved) needs only config.json and "
            "the tokenizer there"
        ) from None


def load_hf_config(path: str, attn_implementation: str | None = None):
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model.path: {path} has no config.json. Point it at a Hugging Face model directory"
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (
        ValueError,
        KeyError,
        OSError,
    ) as error:  # an unknown model_type, or a config.json it cannot parse
        import transformers

        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise ConfigError(
            f"model.path: transformers {transformers.__version__} cannot read {path}/config.json "
            f"({reason}). Use a model type this transformers knows (upgrade transformers for a "
            "newer architecture), or fix config.json"
        ) from None
    if attn_implementation:
        config._attn_implementation = attn_implementation
    return config


# Where transformers' configs keep the number of routed experts (Qwen-MoE, Mixtral, DeepSeek,
# OLMoE/Granite-MoE).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_count(config) -> int:
    """Routed experts per MoE layer of a transformers config; 0 for a dense model."""
    return next(
        (getattr(config, key) for key in _EXPERT_COUNT_KEYS if getattr(config, key, None)), 0
    )


def layer_types(config) -> list[str]:
    """Each decoder layer's attention type as transformers masks it: its ``layer_types``, else a
    sliding window on every layer where the config has one (Mistral), else full attention."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers


def attention_windows(config) -> list[int]:
    """Each layer's sliding window in keys a query sees, itself included (transformers'
    sliding_window); 0: every earlier key."""
    window = getattr(config, "sliding_window", None) or 0
    return [window if kind == "sliding_attention" else 0 for kind in layer_types(config)]


def moe_sizes(config) -> tuple[dict | None, str | None]:
    """A transformers config's mixture of experts in composer3d's terms (``model.moe``'s keys:
    experts, top_k, shared_experts, expert_hidden_dim, dense_layers), or (None, None) for a dense
    model; (None, why) where its MoE layers or attention are not laid out so (MoE layers after a run
    of dense ones; GQA attention)."""
    experts = expert_count(config)
    if not experts:
        return None, None
    if getattr(config, "kv_lora_rank", None):
        return (
            None,
            "its attention is multi-head latent attention (kv_lora_rank), not grouped-query "
            "attention",
        )
    hidden = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared_width = (
        getattr(config, "shared_expert_intermediate_size", None)
        or (getattr(config, "n_shared_experts", None) or 0) * hidden
    )
    if shared_width % hidden:
        return (
            None,
            f"its shared expert ({shared_width} wide) is not a whole number of experts ({hidden} "
            "wide)",
        )
    dense = getattr(config, "first_k_dense_replace", None) or 0
    only_mlp, step = (
        list(getattr(config, "mlp_only_layers", None) or []),
        getattr(config, "decoder_sparse_step", 1),
    )
    if only_mlp or (step or 1) > 1:
        dense = len(only_mlp)
        if only_mlp != list(range(dense)) or (step or 1) > 1:
            return None, (
                f"its dense layers (mlp_only_layers={only_mlp}, decoder_sparse_step={step}) are "
                "not the first layers of the stack"
            )
    return {
        "experts": experts,
        "top_k": config.num_experts_per_tok,
        "shared_experts": shared_width // hidden,
        "expert_hidden_dim": hidden,
        "dense_layers": dense,
    }, None


def fill_model_config(m) -> None:
    """Resolve ``model.path`` and copy the sizes from its config.json into the model config (what
    validation, pipeline splitting and logging read). Runs at launch, in the launcher and in every
    worker alike."""
    m.path = resolve_model_dir(m.path)
    c = load_hf_config(m.path)
    missing = [
        key
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if not isinstance(getattr(c, key, None), int)
    ]
    if missing:
        raise ConfigError(
            f"model.path: {m.path}/config.json ({c.model_type}) has no {missing} at its top level: "
            "composer3d trains decoder-only text models; a multimodal model's config nests its "
            "text model (text_config). Use a text-only causal LM"
        )
    sizes = {
        "dim": c.hidden_size,
        "n_layers": c.num_hidden_layers,
        "n_heads": c.num_attention_heads,
        "n_kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "vocab_size": c.vocab_size,
        "ffn_hidden_dim": getattr(c, "intermediate_size", None),
    }
    # unset: model=hf's zeros, the schema's None (a config filled before holds config.json's own)
    given = {k: getattr(m, k) for k in sizes if getattr(m, k) not in (0, None)}
    changed = [k for k, v in given.items() if v != sizes[k]]
    if changed:
        raise ConfigError(
            f"model.{changed[0]}: model=hf builds the model {m.path}/config.json describes ("
            + " ".join(f"{k}={sizes[k]}" for k in changed)
            + "), so the "
            + " ".join(f"model.{k}={given[k]}" for k in changed)
            + " given would be dropped. Leave the model.* sizes out, or give model.path a "
            "directory whose config.json has the sizes you want"
        )
    for key, value in sizes.items():
        setattr(m, key, value)
    m.max_seq_len = getattr(c, "max_position_embeddings", None) or m.max_seq_len
    m.tie_embeddings = bool(getattr(c, "tie_word_embeddings", False))


# -------------------------------------------------------------------------------------------- model


def tiny_replica(config, tensor_parallel: int = 1):
    """``config`` shrunk to a few million parameters, everything else kept. The head size stays
    (rotary scaling tables are sized by it); widths follow from the number of heads, which
    ``tensor_parallel`` ranks can split."""
    replica = copy.deepcopy(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    replica_kv = tensor_parallel if tensor_parallel > 1 else 1 if kv_heads == 1 else 2
    replica.num_attention_heads = replica_kv * (2 if kv_heads < heads else 1)
    if hasattr(config, "num_key_value_heads"):
        replica.num_key_value_heads = replica_kv
    replica.head_dim = head_dim
    replica.hidden_size = replica.num_attention_heads * head_dim
    if hasattr(config, "intermediate_size"):
        replica.intermediate_size = 2 * replica.hidden_size
    replica.vocab_size = REPLICA_VOCAB
    for special in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, special, None)
        if isinstance(value, int) and value >= REPLICA_VOCAB or isinstance(value, list):
            setattr(replica, special, None)
    layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # the first layer of each type, in their order
        kept = sorted({kind: i for i, kind in reversed(list(enumerate(layer_types)))}.values())
    else:
        kept = list(range(min(layers, 2)))
    replica.num_hidden_layers = len(kept)
    # per-layer lists (layer_types, mlp_layer_types, …) follow the layers
    for key, value in vars(config).items():
        if isinstance(value, list) and len(value) == layers and layers > 1:
            setattr(replica, key, [value[i] for i in kept])
    if getattr(config, "sliding_window", None):
        replica.sliding_window = min(config.sliding_window, REPLICA_WINDOW)
    return replica
