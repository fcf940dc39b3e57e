"""PEFT's adapter directories: the keys PEFT gives a LoRA model's tensors, and reading a directory
into this model's LoRA layers to continue training from it (``peft.init_from``).

PEFT saves ``adapter_model.safetensors`` under ``base_model.model.<Hugging Face
module>.lora_A.weight`` (the adapter name dropped) and a module trained whole (modules_to_save)
under ``base_model.model.<module>.<parameter>``. The native model's modules go by the names its
Hugging Face export gives them, and its q/k projections' output rows are permuted there (RoPE on
interleaved pairs vs rotate_half): B·A's rows are ``lora_B``'s, so ``lora_B`` is permuted with them
and ``lora_A`` is not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composer3d.config.schema import ModelConfig
from composer3d.models.init import local_shard
from composer3d.peft.lora import ADAPTERS

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def hf_weight_names(model_cfg: ModelConfig) -> dict[str, str] | None:
    """The native model's weight names → Hugging Face's; None for ``model=hf``, whose names are
    already those."""
    if model_cfg.name != "llama":
        return None
    from composer3d.models import llama

    return llama.hf_names(model_cfg)


def peft_key(name: str, names: dict[str, str] | None) -> str:
    """PEFT's key of the model's parameter ``name`` (an adapter's ``…wq.lora_A.weight``, or a saved
    module's)."""
    if names is None:
        return PEFT_PREFIX + name
    module, _, leaf = name.rpartition(".")
    owner, _, kind = module.rpartition(".")
    if kind in ADAPTERS:  # the adapted linear's Hugging Face name, then PEFT's suffix
        return f"{PEFT_PREFIX}{names[f'{owner}.weight'].rpartition('.')[0]}.{kind}.{leaf}"
    return PEFT_PREFIX + names[name]


def rope_heads(name: str, model_cfg: ModelConfig) -> int | None:
    """Heads whose rows the native export permutes in this ``lora_B`` (q and k projections), else
    None."""
    if model_cfg.name != "llama" or not name.endswith(".lora_B.weight"):
        return None
    if ".attention.wq." in name:
        return model_cfg.n_heads
    if ".attention.wk." in name:
        return model_cfg.n_kv_heads or model_cfg.n_heads
    return None


def read_adapter_config(directory: Path) -> dict:
    return json.loads((Path(directory) / ADAPTER_CONFIG).read_text())


def adapter_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Key → shape of every tensor in the directory's adapter_model.safetensors (headers only)."""
    from safetensors import safe_open

    with safe_open(str(Path(directory) / ADAPTER_WEIGHTS), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (not a dict)


@torch.no_grad()
def load_adapters(model: nn.Module, directory: Path, model_cfg: ModelConfig) -> None:
    """Copy the directory's tensors into what this rank holds of the model's trainable parameters
    (the adapters and modules_to_save, of this pipeline stage, whole or sharded): each read whole
    and cut to the rank's part as initialization cuts it."""
    from safetensors import safe_open

    from composer3d.models import llama

    names = hf_weight_names(model_cfg)
    with safe_open(str(Path(directory) / ADAPTER_WEIGHTS), framework="pt") as f:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            full = f.get_tensor(peft_key(name, names)).to(torch.float32)
            heads = rope_heads(name, model_cfg)
            if heads is not None:
                full = llama.rope_half_to_interleaved(full, heads)
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(local_shard(full, param).to(local.dtype))
