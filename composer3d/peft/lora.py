"""Low-rank adapters (LoRA) around a frozen base linear, and QLoRA's 4-bit NF4 base weights.

Names follow PEFT's (``base_layer``, ``lora_A``, ``lora_B``, output scaled by alpha / rank), so a
checkpoint's adapter maps onto PEFT's ``lora_A.default`` / ``lora_B.default`` by inserting the
adapter name. The base linear's parameters keep their values under ``base_layer``: ``base_name``
gives the name they had unwrapped, by which ``models.init`` seeds them, so a LoRA run starts from
the same base weights as a full fine-tune of that seed.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Iterator

import torch
import torch.nn as nn

BASE = "base_layer"
# NF4 quantizes blocks of 64 values, their scales in blocks of 256: a weight (and each rank's shard)
# holds whole blocks of 64 × 256 values (torchao's NF4Tensor asserts it)
NF4_BLOCK = 64 * 256
ADAPTERS = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """``base_layer(x) + lora_B(lora_A(dropout(x))) · alpha / rank``; ``lora_B`` starts at zero, so
    the wrapped layer first computes exactly what the base did. With ``adapters_on`` false (inside
    ``adapters_off``) it computes the base alone."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        # an attribute of the module, not a global: a compiled block guards on it
        self.adapters_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_on:
            return self.base_layer(x)
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """``model``'s LoRA layers compute their base alone inside the block: the model before its
    adapters trained (preference tuning's reference, ``preference.reference=adapters_off``)."""
    layers = [module for module in model.modules() if isinstance(module, LoRALinear)]
    for layer in layers:
        layer.adapters_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_on = True


class NF4Linear(nn.Linear):
    """A frozen linear whose weight is torchao's NF4 tensor (4-bit blocks, double-quantized scales),
    dequantized to the input's dtype in each forward and backward. FSDP2 shards it on dim 0
    (``NF4Tensor`` implements FSDP's all-gather extension), so each rank stores 1/dp of the 4-bit
    weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def to_nf4(tensor: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import to_nf4 as quantize

    return quantize(tensor)


def quantize_base(layer: LoRALinear) -> None:
    """Make ``layer``'s base an ``NF4Linear`` whose weight is an NF4 tensor of its shape, on the
    meta device (``models.init`` quantizes the whole initialized weight and gives each rank its
    rows)."""
    base = layer.base_layer
    base.__class__ = NF4Linear
    base.weight = nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)


def copy_nf4_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Fill NF4 tensor ``dst`` with NF4 tensor ``src`` (the same rows). ``to_empty`` leaves an NF4
    tensor's scale mean and lookup table on meta (torchao allocates only its data anew), where
    ``copy_`` writes nothing: those are replaced, in place on the object FSDP holds."""
    for name in dst.__tensor_flatten__()[0]:
        inner = getattr(dst, name)
        if inner.is_meta:
            setattr(
                dst, name, getattr(src, name).to(device=dst.device, dtype=inner.dtype, copy=True)
            )
        else:
            inner.copy_(getattr(src, name))


def is_nf4(tensor: torch.Tensor) -> bool:
    # loaded by any run that made an NF4 tensor
    quantization = sys.modules.get("torchao.quantization")
    return quantization is not None and isinstance(tensor, quantization.NF4Tensor)


def base_name(name: str) -> str:
    """A parameter's name as it was before its linear was wrapped (``…wq.base_layer.weight`` →
    ``…wq.weight``)."""
    return name.replace(f".{BASE}.", ".")


def is_adapter(name: str) -> bool:
    return any(f".{a}." in name for a in ADAPTERS)


def adapter_init(
    name: str, shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """PEFT's initialization: A uniform in ±1/√fan_in (kaiming-uniform with a=√5), B zero."""
    if ".lora_B." in name:
        return torch.zeros(shape, device=device)
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)
