"""Weights of Hugging Face models: safetensors read straight into each rank's shards (per-expert
tensors stacked into the fused parameters transformers builds, by ``conversion``), checked against
the model first; the files that travel with exported weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composer3d.errors import ConfigError
from composer3d.models.hf.conversion import CheckpointMap, Fused, map_checkpoint
from composer3d.models.init import local_shard
from composer3d.peft.lora import base_name, copy_nf4_, is_adapter, is_nf4, to_nf4

if TYPE_CHECKING:
    from composer3d.models.hf.model import HFCausalLM


def safetensors_index(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name → (shape, file) of every tensor in the directory's safetensors files (headers only).
    A file cut short (a download or copy that stopped) or otherwise corrupt is refused naming it:
    safetensors checks that the header parses and that the tensors it lists fill the file."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"model.path: {path} holds no *.safetensors weights (composer3d reads only "
            "safetensors). Convert the checkpoint with save_pretrained(safe_serialization=True), "
            "or use model.pretrained=false to train from a random init"
        )
    index: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    index[key] = (tuple(f.get_slice(key).get_shape()), file.name)
        except SafetensorError as error:
            raise ConfigError(
                f"model.path: {file} is truncated or corrupt (safetensors: {error}). Download or "
                "export the model again (save_pretrained writes whole files), or give model.path "
                "an intact copy"
            ) from None
    return index


def check_checkpoint_keys(
    model: HFCausalLM, index: dict[str, tuple[tuple[int, ...], str]], path: str
) -> CheckpointMap:
    """Missing, unexpected and mis-shaped tensors, against the whole model (every rank checks the
    same), after transformers' conversions (per-expert tensors stacked into fused parameters);
    returns where each comes from."""
    mapped = map_checkpoint(model.weight_conversions, index, path)
    expected, given = model.full_shapes, mapped.shapes
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(
        mapped.plain.get(k, k)
        for k in set(given) - set(expected) - ({"lm_head.weight"} if tied else set())
    )
    wrong = sorted(
        f"{k}: file {given[k]} vs model {expected[k]}"
        for k in set(expected) & set(given)
        if given[k] != expected[k]
    )
    problems = list(mapped.problems)
    if missing:
        hint = (
            " (config.json says tie_word_embeddings=false, but the file has no separate head)"
            if missing == ["lm_head.weight"]
            else ""
        )
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:4]}{hint}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors, e.g. {unexpected[:4]}")
    if wrong:
        problems.append(
            f"{len(wrong)} shape mismatches, e.g. {wrong[:3]} (config.json does not match the "
            "weights: check num_key_value_heads, head_dim, intermediate_size, vocab_size, the "
            "expert count)"
        )
    if problems:
        raise ConfigError(
            f"model.path: the weights in {path} do not fit the model its config.json describes: "
            + "; ".join(problems)
            + ". Use the directory save_pretrained wrote, unmodified"
        )
    return mapped


def check_pretrained(model: HFCausalLM, path: str) -> None:
    """The safetensors in ``path`` hold exactly the tensors ``model`` (whole, on meta is enough)
    has, in its shapes: headers only, so the launcher checks this before any worker starts."""
    check_checkpoint_keys(model, safetensors_index(path), path)


def load_pretrained(model: HFCausalLM, path: str) -> None:
    """Read each rank's shards of its parameters straight from the safetensors files; no rank ever
    holds the whole model. Tensors stored whole: DCP's Hugging Face reader reads only the slices a
    rank holds. Fused expert parameters: the rank reads the per-expert tensors of the experts (rows)
    it holds and stacks them as transformers does. Tied heads load with the embedding."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    index = safetensors_index(path)
    mapped = check_checkpoint_keys(model, index, path)
    # this rank's parameters (a pipeline stage has only its own) by their names in the files: a
    # LoRA-wrapped linear's base by its unwrapped name, its adapters (initialized, not in the files)
    # left out
    params = {base_name(name): p for name, p in model.named_parameters() if not is_adapter(name)}
    quantized = {name for name, param in params.items() if is_nf4(_local(param))}
    # The last pipeline stage's head twin of a tied embedding is the embedding's tensor (a file has
    # no other).
    sources = (
        {"lm_head.weight": "model.embed_tokens.weight"}
        if getattr(model.config, "tie_word_embeddings", False)
        else {}
    )
    whole = {
        mapped.plain[sources.get(name, name)]: param
        for name, param in params.items()
        if name not in mapped.fused and name not in quantized
    }
    load(whole, storage_reader=HuggingFaceStorageReader(path), no_dist=not dist.is_initialized())
    # QLoRA's NF4 weights: each read whole, quantized whole, then cut to the rank's
    for name in sorted(quantized):
        param = params[name]
        full = torch.empty(model.full_shapes[name], device=param.device)
        load(
            {mapped.plain[name]: full},
            storage_reader=HuggingFaceStorageReader(path),
            no_dist=not dist.is_initialized(),
        )
        copy_nf4_(
            param._local_tensor if isinstance(param, DTensor) else param,
            local_shard(to_nf4(full), param),
        )
    files = ExpertFiles(path, index)
    for name, param in params.items():
        if name in mapped.fused:
            _load_fused(param, mapped.fused[name], files)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class ExpertFiles:
    """The safetensors files, opened once each (closed with this object), read a tensor (one
    expert's) at a time."""

    def __init__(self, path: str, index: dict[str, tuple[tuple[int, ...], str]]):
        self.path, self.index, self.handles = path, index, {}

    def tensor(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.index[key][1]
        if file not in self.handles:
            self.handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self.handles[file].get_tensor(key)


@torch.no_grad()
def _load_fused(param: torch.Tensor, fused: Fused, files: ExpertFiles) -> None:
    """This rank's block of a fused expert parameter: the rows (experts) it holds, built from their
    tensors only."""
    if isinstance(param, DTensor):
        # the block's offsets and sizes in the whole parameter
        (chunk,) = param.__create_chunk_list__()
        offsets, sizes, local = chunk.offsets, chunk.sizes, param.to_local()
    else:
        offsets, sizes, local = [0] * param.dim(), param.shape, param
    if local.numel() == 0:  # an FSDP shard past the last expert
        return
    block = fused.build(files.tensor, range(offsets[0], offsets[0] + sizes[0]))
    local.copy_(block[(slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:])))])


def export_files(path: str) -> list[str]:
    """Files of the model directory that travel with exported weights (config, tokenizer, generation
    config)."""
    keep = []
    for name in sorted(os.listdir(path)):
        if (
            name.endswith((".safetensors", ".bin", ".pt", ".pth"))
            or name == "model.safetensors.index.json"
        ):
            continue
        if os.path.isfile(os.path.join(path, name)) and (
            name.endswith((".json", ".model", ".txt", ".jinja"))
        ):
            keep.append(name)
    return keep
