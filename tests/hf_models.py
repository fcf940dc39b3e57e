"""Tiny random Hugging Face models and tokenizers, saved to local directories like real checkpoints.

Nothing is downloaded: configs are built with transformers' config classes, weights drawn by
``from_config`` (then norms perturbed so a swapped or skipped norm shows in the logits), and the
tokenizer trained on the spot with the ``tokenizers`` library. Shapes are chosen so tp=2 and tp=4
divide heads, kv heads, MLP width and vocab.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# model_type -> extra config fields (each architecture's own features switched on where it has them)
ARCHITECTURES = {
    "llama": {},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 24, "head_dim": 16},
    "gemma2": {
        "head_dim": 16,
        "sliding_window": 24,
        "query_pre_attn_scalar": 16,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "phi3": {"pad_token_id": 0, "original_max_position_embeddings": 256},
    # Gemma 3 (text): per-layer-type rotary embeddings (local/global bases) and per-head q/k norms.
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 24,
        "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # StableLM ships no tensor-parallel plan: composer3d derives the Llama family's (with q/k/v
    # biases split, and its attention's head counts made local, since it reshapes by them);
    # LayerNorm with biases, partial rotary.
    "stablelm": {"use_qkv_bias": True, "partial_rotary_factor": 0.25},
}

# Mixture-of-experts architectures: transformers fuses their experts in memory but saves them one by
# one.
MOE_ARCHITECTURES = {
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "mixtral": {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
    # a shared expert behind a sigmoid gate; OLMoE: per-head q/k norms over the whole projection
    "qwen2_moe": {
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "olmoe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2},
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{{ eos_token }}{% endfor %}{% if "
    "add_generation_prompt %}<|assistant|> {% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "pipeline parallel splits layers across ranks while tensor parallel splits each matmul",
    "fully sharded data parallel keeps one shard of every parameter on each rank",
    "a checkpoint written by one layout can be read back under another",
    "def train(model, data):\n    for batch in data:\n        loss = model(batch)\n        "
    "loss.backward()\n",
]


def make_tokenizer(path: Path, vocab_size: int = VOCAB):
    """A byte-level BPE tokenizer with bos/eos/pad and a chat template, saved with
    save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def hf_config(model_type: str, **overrides):
    """The tiny config of ``model_type``: COMMON, the architecture's own fields (none for one not
    listed above), then ``overrides``."""
    from transformers import AutoConfig

    fields = {**COMMON, **{**ARCHITECTURES, **MOE_ARCHITECTURES}.get(model_type, {}), **overrides}
    config = AutoConfig.for_model(model_type, **fields)
    if model_type == "qwen2":
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    return config


def make_model(
    path: Path, model_type: str, seed: int = 0, tokenizer: bool = True, **overrides
) -> Path:
    """A random ``model_type`` causal LM saved to ``path`` (safetensors), with a tokenizer; returns
    ``path``."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # ones (or zeros for Gemma) by default: perturb so every norm matters
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        make_tokenizer(path)
    return path


def reference_logits(
    path: Path, tokens: torch.Tensor, attn_implementation: str | None = None
) -> torch.Tensor:
    """transformers' own forward on the saved directory (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(tokens).logits
