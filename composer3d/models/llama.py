"""Native Llama-3 style decoder: RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU, optional tied head.

Built on the meta device; weights are filled later by ``composer3d.models.init`` from per-parameter rules
this module declares (``init_rule``), so the values do not depend on how the parameters get sharded.
Attention reads its head count from the tensor it receives, so the same code runs whole or
tensor-parallel (where each rank holds n_heads / tp heads). Packed documents (``position_ids`` that restart, as
``data.document_masking`` makes them) attend only within themselves, as in Hugging Face models: RoPE at the given
positions and block-causal attention (``document_mask``).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._triton import has_triton

from composer3d.models.init import InitRule, normal, ones
from composer3d.models.moe import MoE


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None, explicit: int | None) -> int:
    """Llama-3's SwiGLU width: 2/3 of 4·dim, scaled, rounded up to a multiple of ``multiple_of``."""
    if explicit:
        return explicit
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of the head dim: x is (batch, seq, heads, head_dim).

    ``cos``/``sin``: the whole tables (positions 0..seq-1 are used) or, gathered at each row's position_ids,
    (batch, seq, head_dim / 2)."""
    if cos.dim() == 2:
        cos, sin = cos[: x.shape[1]], sin[: x.shape[1]]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x_even, x_odd = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document index in its row, (batch, seq): a document starts wherever the position does not go on
    +1 from the previous token's, transformers' rule for packed sequences (``find_packed_sequence_indices``)."""
    return F.pad((position_ids[:, 1:] != position_ids[:, :-1] + 1).cumsum(-1), (1, 0))


@functools.cache
def _flex_fits(device_type: str) -> bool:
    """Whether attention on this device type takes flex attention: where inductor compiles it to Triton kernels (the
    accelerator, when Triton supports it). Elsewhere its kernels are slow or missing (torch 2.13's flex attention has
    no backward on the CPU), and the exact SDPA mask is used."""
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and device_type == accelerator.type and has_triton()


# flex_attention and create_block_mask compiled, made on first use (torch.compile costs seconds to import): eager,
# the one materializes every score and the other a (batch, seq, seq) mask.
_compiled_flex: tuple | None = None


def document_mask(documents: torch.Tensor) -> BlockMask | torch.Tensor:
    """Block-causal attention over ``document_ids``: token i attends to token j iff j <= i in the same document.

    A flex-attention BlockMask where flex fits the device (``_flex_fits``), else a boolean mask for SDPA,
    (batch, 1, seq, seq): exact, with memory quadratic in the sequence.
    """
    global _compiled_flex
    batch, seq = documents.shape
    if _flex_fits(documents.device.type):
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention), torch.compile(create_block_mask)

        def same_document_causal(b, h, q, kv):
            return (kv <= q) & (documents[b, q] == documents[b, kv])
        return _compiled_flex[1](same_document_causal, batch, None, seq, seq, device=documents.device)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                mask: BlockMask | torch.Tensor | None) -> torch.Tensor:
        """``mask``: None for causal attention, else ``document_mask``'s."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads (the mask has no head dim).
        q = apply_rope(self.wq(x).view(bsz, seq, -1, self.head_dim), rope_cos, rope_sin).transpose(1, 2)
        k = apply_rope(self.wk(x).view(bsz, seq, -1, self.head_dim), rope_cos, rope_sin).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, BlockMask):
            out = _compiled_flex[0](q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Attention, then a dense SwiGLU (``feed_forward``) or, given ``moe_cfg``, a mixture of experts (``moe``)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden_dim: int, norm_eps: float,
                 moe_cfg=None, expert_hidden_dim: int | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        if moe_cfg is None:
            self.feed_forward = FeedForward(dim, hidden_dim)
        else:
            self.moe = MoE(dim, expert_hidden_dim or hidden_dim, moe_cfg)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                mask: BlockMask | torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, mask)
        return h + (self.moe if hasattr(self, "moe") else self.feed_forward)(self.ffn_norm(h))


def is_moe_layer(cfg, layer: int) -> bool:
    """Whether layer ``layer`` of model config ``cfg`` is a mixture of experts (after moe.dense_layers dense ones)."""
    moe = getattr(cfg, "moe", None)
    return moe is not None and moe.experts > 0 and layer >= moe.dense_layers


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        hidden = ffn_hidden_dim(cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A dict keyed by layer index keeps parameter names stable when a pipeline stage drops layers.
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(cfg.dim, cfg.n_heads, n_kv_heads, hidden, cfg.norm_eps,
                                     *((cfg.moe, cfg.moe.expert_hidden_dim) if is_moe_layer(cfg, i) else ()))
            for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device="meta")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the head with the embedding; re-run after tensor parallel replaced them (both shard the vocab dim)."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self, device: torch.device) -> None:
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()

    def init_rule(self, name: str) -> InitRule:
        """How to initialize parameter ``name``; residual projections are scaled down with depth (GPT-2 style)."""
        std = self.cfg.init_std
        if name.endswith("norm.weight"):
            return ones()
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "moe.experts.w2", "moe.shared_w2.weight")):
            return normal(std / math.sqrt(2 * self.cfg.n_layers))
        return normal(std)

    def forward(self, x: torch.Tensor, layer_ids: list[str] | None = None, embed: bool = True,
                head: bool = True, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens → logits; a pipeline stage runs a slice: its ``layer_ids``, with or without embedding and head.

        ``position_ids`` (batch, seq) that restart mark packed documents: each attends only within itself, with RoPE
        at its positions. Without a restart (or without position_ids) attention is causal over the whole row.
        """
        h = self.tok_embeddings(x) if embed else x
        rope, mask = (self.rope_cos, self.rope_sin), None
        if position_ids is not None:
            documents = document_ids(position_ids)
            # Flex attention takes the mask whatever it holds: no read of the device (a host sync would stall the
            # step). The exact fallback runs where the device is the host or synchronous anyway; a batch without a
            # restart keeps the causal kernel and the tables from 0 there (RoPE sees only relative positions).
            if _flex_fits(documents.device.type) or documents[:, -1].any():
                rope, mask = (self.rope_cos[position_ids], self.rope_sin[position_ids]), document_mask(documents)
        for layer_id in self.layers.keys() if layer_ids is None else layer_ids:
            h = self.layers[layer_id](h, *rope, mask)
        return self.output(self.norm(h)) if head else h


def tensor_parallel_plan(model: Llama, sequence_parallel: bool, float8: bool = False
                         ) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """Megatron splits: (plan for the root modules, plan applied to every block).

    Column-parallel q/k/v and w1/w3, row-parallel wo and w2 (mixture-of-experts layers split their experts
    themselves: ``parallel.experts``); a vocab-parallel embedding; a column-parallel head
    whose output stays sharded on the vocab dim (a DTensor) so the loss (``composer3d.loss``) runs on the shards
    without gathering full-vocabulary logits. With sequence parallel the residual stream and the norms hold a slice of
    the sequence; attention and MLP inputs are all-gathered on entry and reduce-scattered on exit. With float8
    the block's layers use torchao's float8 styles (the all-gathers then move float8 activations).
    """
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as Colwise,
            Float8RowwiseParallel as Rowwise,
            PrepareFloat8ModuleInput as PrepareInput,
        )
    else:
        Colwise, Rowwise, PrepareInput = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    residual = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": Colwise(),
        "attention.wk": Colwise(),
        "attention.wv": Colwise(),
        "attention.wo": Rowwise(output_layouts=residual),
        "feed_forward.w1": Colwise(),
        "feed_forward.w3": Colwise(),
        "feed_forward.w2": Rowwise(output_layouts=residual),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # (x, rope_cos, rope_sin, mask): the sequence is gathered, so RoPE tables and mask cover all of it
            "attention": PrepareInput(input_layouts=(Shard(1), None, None, None),
                                      desired_input_layouts=(Replicate(), None, None, None)),
            "feed_forward": PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return root, block


# ------------------------------------------------------------------------ Hugging Face LlamaForCausalLM mapping
# Names, RoPE layout and config fields of transformers' LlamaForCausalLM, for composer3d-convert and for any
# later loader of Hugging Face models. Plain tensors and dicts in, plain tensors and dicts out: no transformers import.

# Per-layer names: native suffix -> Hugging Face suffix (w1 is the gate, w3 the up projection, w2 the down one).
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
HF_ROOT_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def hf_names(cfg) -> dict[str, str]:
    """Native parameter name -> Hugging Face name for every parameter of ``cfg``'s model.

    With tied embeddings ``output.weight`` is the embedding itself and has no Hugging Face name of its own.
    """
    names = {k: v for k, v in HF_ROOT_NAMES.items() if not (cfg.tie_embeddings and k == "output.weight")}
    for i in range(cfg.n_layers):
        names.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in HF_LAYER_NAMES.items()})
    return names


def rope_interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q or k projection, per head, from RoPE on interleaved pairs (x[2i], x[2i+1]),
    as this model and Meta's code rotate, to pairs (x[i], x[i + head_dim/2]), as Hugging Face's rotate_half does.
    The same permutation as transformers' ``convert_llama_weights_to_hf.py``."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``rope_interleaved_to_half``."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(native_name: str, cfg) -> int | None:
    """Heads whose rows RoPE rotates in this weight (q or k projections), else None."""
    if native_name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if native_name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads or cfg.n_heads
    return None


def hf_state_dict_from_native(state: dict[str, torch.Tensor], cfg,
                              names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A native model state dict (whole tensors) as LlamaForCausalLM's: renamed, q/k rows permuted for rotate_half.

    ``lm_head.weight`` is left out under tied embeddings (Hugging Face ties it to the embedding on load).
    ``names`` (native → Hugging Face) maps a subset (another architecture's shared part), else ``hf_names(cfg)``.
    Raises KeyError naming any parameter ``state`` lacks; extra entries (such as a tied ``output.weight``) are ignored.
    """
    names = hf_names(cfg) if names is None else names
    missing = [k for k in names if k not in state]
    if missing:
        raise KeyError(f"the model state lacks {len(missing)} parameters of the config, e.g. {missing[:3]}")
    out = {}
    for native, hf in names.items():
        heads = _rope_heads(native, cfg)
        out[hf] = state[native] if heads is None else rope_interleaved_to_half(state[native], heads)
    return out


def native_state_dict_from_hf(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict as the native model's (the inverse of ``hf_state_dict_from_native``).

    Under tied embeddings ``output.weight`` is the embedding tensor again (``model.state_dict()`` has both
    names), and a ``lm_head.weight`` in ``state`` is ignored. RoPE ``inv_freq`` buffers some old checkpoints hold
    are ignored; raises KeyError naming missing or unexpected parameters.
    """
    names = hf_names(cfg)
    expected = set(names.values())
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = sorted(expected - set(state))
    unexpected = sorted(k for k in state if k not in expected and k not in ignored and not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise KeyError(f"the Hugging Face state does not match the config: missing {missing[:3]} "
                       f"({len(missing)} in all), unexpected {unexpected[:3]} ({len(unexpected)} in all)")
    out = {}
    for native, hf in names.items():
        heads = _rope_heads(native, cfg)
        out[native] = state[hf] if heads is None else rope_half_to_interleaved(state[hf], heads)
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config_from_native(cfg) -> dict:
    """LlamaConfig keyword arguments (transformers 5 spelling: RoPE under ``rope_parameters``) for ``cfg``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_dim(cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim),
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
    """ModelConfig fields (``ffn_hidden_dim`` explicit) for a Hugging Face Llama ``config.json`` (as a dict).

    Reads both transformers 5 (``rope_parameters``) and 4 (``rope_theta``, ``rope_scaling``) spellings. Raises
    ValueError naming what this model cannot represent: another architecture, biases, another activation, a head
    dim other than hidden_size / heads, or RoPE scaling (e.g. Llama-3.1's "llama3" rope type) unless
    ``ignore_rope_scaling``, which drops it (the model then differs from the original beyond the base frequencies).
    """
    if hf.get("model_type") != "llama":
        raise ValueError(f"model_type is {hf.get('model_type')!r}, not 'llama': only Llama models "
                         "(LlamaForCausalLM) convert to composer3d's llama")
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (the model uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (the model has no biases)")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // n_heads) or dim % n_heads:
        problems.append(f"head_dim={hf.get('head_dim')} with hidden_size={dim} and {n_heads} heads "
                        "(the model needs head_dim = hidden_size / num_attention_heads)")
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if rope_type != "default" and not ignore_rope_scaling:
        problems.append(f"RoPE type {rope_type!r} (the model implements plain RoPE only; pass --ignore-rope-scaling "
                        "to drop the scaling and keep the base frequency)")
    if problems:
        raise ValueError("this Llama config uses features composer3d's llama lacks: " + "; ".join(problems))
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
