"""Weights of Hugging Face models: safetensors read straight into each rank's shards, checked against the model
first; the files that travel with exported weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from composer3d.errors import ConfigError

if TYPE_CHECKING:
    from composer3d.models.hf import HFCausalLM


def safetensors_index(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name → (shape, file) of every tensor in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path: {path} holds no *.safetensors weights (composer3d reads only safetensors). "
                          "Convert the checkpoint with save_pretrained(safe_serialization=True), or use "
                          "model.pretrained=false to train from a random init")
    index: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                index[key] = (tuple(f.get_slice(key).get_shape()), file.name)
    return index


def check_checkpoint_keys(model: HFCausalLM, index: dict[str, tuple[tuple[int, ...], str]], path: str) -> None:
    """Missing, unexpected and mis-shaped tensors, against the whole model (every rank checks the same)."""
    expected = model.full_shapes
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = sorted(set(expected) - set(index))
    unexpected = sorted(set(index) - set(expected) - ({"lm_head.weight"} if tied else set()))
    wrong = sorted(f"{k}: file {index[k][0]} vs model {expected[k]}" for k in set(expected) & set(index)
                   if index[k][0] != expected[k])
    problems = []
    if missing:
        hint = (" (config.json says tie_word_embeddings=false, but the file has no separate head)"
                if missing == ["lm_head.weight"] else "")
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:4]}{hint}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors, e.g. {unexpected[:4]}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatches, e.g. {wrong[:3]} (config.json does not match the weights: "
                        "check num_key_value_heads, head_dim, intermediate_size, vocab_size)")
    if problems:
        raise ConfigError(f"model.path: the weights in {path} do not fit the model its config.json describes: "
                          + "; ".join(problems) + ". Use the directory save_pretrained wrote, unmodified")


def check_pretrained(model: HFCausalLM, path: str) -> None:
    """The safetensors in ``path`` hold exactly the tensors ``model`` (whole, on meta is enough) has, in its shapes:
    headers only, so the launcher checks this before any worker starts."""
    check_checkpoint_keys(model, safetensors_index(path), path)


def load_pretrained(model: HFCausalLM, path: str) -> None:
    """Read each rank's shards of its parameters straight from the safetensors files (DCP's Hugging Face reader
    reads only the slices a rank holds; no rank ever holds the whole model). Tied heads load with the embedding."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    check_pretrained(model, path)
    state = dict(model.named_parameters())  # this rank's parameters (a pipeline stage has only its own)
    load(state, storage_reader=HuggingFaceStorageReader(path), no_dist=not dist.is_initialized())


def export_files(path: str) -> list[str]:
    """Files of the model directory that travel with exported weights (config, tokenizer, generation config)."""
    keep = []
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name == "model.safetensors.index.json":
            continue
        if os.path.isfile(os.path.join(path, name)) and (name.endswith((".json", ".model", ".txt", ".jinja"))):
            keep.append(name)
    return keep
