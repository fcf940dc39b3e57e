"""The model state of a LoRA / QLoRA run (``peft``): which of a rank's parameters train, and what
each stores.

A frozen parameter has no gradient and no optimizer state: its bytes only, as composer3d stores it
(the fp32 weights every parameter keeps; FSDP casts them for compute). QLoRA's targeted base weights
are torchao NF4 tensors: half a byte per value, one int8 scale per block of 64 values, one fp32
factor per 256 of those scales, and a scale mean and the 16-value lookup table per tensor (per FSDP
shard, each shard being an NF4 tensor of its own). Each targeted linear gains its adapters,
trainable: ``lora_A`` [r, in] and ``lora_B`` [out, r], split under TP as peft/apply.py splits them
(a column-parallel base: A whole, B by rows; a row-parallel base: A by columns, B whole).
``peft.modules_to_save`` train whole. The names the patterns are matched against are the native
model's and Hugging Face's Llama-layout names of each parameter, PEFT's rule (peft/apply.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from composer3d.peft.apply import matches

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's NF4: values per scale, scales per fp32 factor
NF4_TENSOR_BYTES = 4 + 16 * 4  # the scale mean, the lookup table
# (native, Hugging Face) module names of a dense block's parameters in ModelShape.block_params'
# order; None for the norms' weights, which are no linear
BLOCK_MODULES = (
    ("attention.wq", "self_attn.q_proj"),
    ("attention.wk", "self_attn.k_proj"),
    ("attention.wv", "self_attn.v_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("feed_forward.w1", "mlp.gate_proj"),
    ("feed_forward.w3", "mlp.up_proj"),
    ("feed_forward.w2", "mlp.down_proj"),
)
ROW_PARALLEL = {"attention.wo", "feed_forward.w2"}  # the others' outputs split under TP
LINEARS = {
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w3",
    "feed_forward.w2",
}
ROOT_MODULES = {
    "embedding": ("tok_embeddings", "embed_tokens"),
    "norm": ("norm", "norm"),
    "head": ("output", "lm_head"),
}


@dataclass(frozen=True)
class Peft:
    method: str  # lora | qlora
    rank: int
    targets: tuple[str, ...]
    modules_to_save: tuple[str, ...]

    @classmethod
    def from_config(cls, p) -> Peft | None:
        if p.method == "none":
            return None
        return cls(p.method, p.rank, tuple(p.target_modules), tuple(p.modules_to_save))

    def _named(self, names: tuple[str, str], patterns: tuple[str, ...]) -> bool:
        native, hf = names
        return matches(f"layers.0.{native}", patterns) or matches(f"model.layers.0.{hf}", patterns)

    def targeted(self, module: str) -> bool:
        names = dict(BLOCK_MODULES)
        return module in LINEARS and self._named((module, names[module]), self.targets)

    def saved(self, names: tuple[str, str], in_block: bool) -> bool:
        native, hf = names
        if in_block:
            return self._named(names, self.modules_to_save)
        return (
            matches(native, self.modules_to_save)
            or matches(f"model.{hf}", self.modules_to_save)
            or matches(hf, self.modules_to_save)
        )


@dataclass(frozen=True)
class Split:
    """A rank's parameters of a unit by what they store, as (shape, count) lists: ``trainable``
    (weights, gradients, optimizer state), ``frozen`` (fp32 weights only), ``nf4`` (QLoRA's 4-bit
    base weights)."""

    trainable: list[tuple[int, ...]]
    frozen: list[tuple[int, ...]]
    nf4: list[tuple[int, ...]]


def split_block(params: list[tuple[int, ...]], peft: Peft, tp: int) -> Split:
    """A dense block's parameters (ModelShape.block_params on a TP rank) and the adapters the
    targets add."""
    trainable, frozen, nf4 = [], [], []
    for shape, (native, hf) in zip(params, BLOCK_MODULES):
        if peft.saved((native, hf), True):
            trainable.append(shape)
            continue
        if not peft.targeted(native):
            frozen.append(shape)
            continue
        (nf4 if peft.method == "qlora" else frozen).append(shape)
        out, inp = shape
        if native in ROW_PARALLEL:  # A by columns like the base, B whole
            trainable += [(peft.rank, inp), (out, peft.rank)]
        else:  # A whole (it sees the whole input), B by rows like the base
            trainable += [(peft.rank, inp * tp), (out, peft.rank)]
    return Split(trainable, frozen, nf4)


def split_root(params: list[tuple[int, ...]], kinds: list[str], peft: Peft) -> Split:
    """The root's parameters (embedding, final norm, head): frozen unless ``modules_to_save`` names
    them."""
    trainable = [s for s, k in zip(params, kinds) if peft.saved(ROOT_MODULES[k], False)]
    frozen = [s for s, k in zip(params, kinds) if not peft.saved(ROOT_MODULES[k], False)]
    return Split(trainable, frozen, [])


def nf4_bytes(shape: tuple[int, ...]) -> float:
    """Bytes of one NF4 tensor (or FSDP shard) of this shape."""
    n = math.prod(shape)
    scales = math.ceil(n / NF4_BLOCK)
    return n / 2 + scales + 4 * math.ceil(scales / NF4_SCALER_BLOCK) + NF4_TENSOR_BYTES
