"""Hugging Face Llama directory → model-only composer3d checkpoint (native Llama)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from composer3d.convert.common import HF_INDEX, HF_WEIGHTS, ConvertError, model_config


def load_hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors directory (one file or shards named by the
    index)."""
    from safetensors.torch import load_file

    index = hf_dir / HF_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        if not files:
            raise ConvertError(f"{index} names no weight files")
    elif (hf_dir / HF_WEIGHTS).exists():
        files = [HF_WEIGHTS]
    else:
        pickled = [p.name for p in hf_dir.glob("*.bin")] + [p.name for p in hf_dir.glob("*.pth")]
        raise ConvertError(
            f"{hf_dir} has no {HF_WEIGHTS} or {HF_INDEX}"
            + (
                f" (only pickled weights {pickled[:3]}, which composer3d does not unpickle: "
                "re-save them as safetensors)"
                if pickled
                else ""
            )
        )
    state = {}
    for name in files:
        if not (hf_dir / name).exists():
            raise ConvertError(f"{hf_dir / name}, named by {HF_INDEX}, does not exist")
        state.update(load_file(str(hf_dir / name)))
    return state


def import_hf(hf_dir: Path, out: Path, ignore_rope_scaling: bool = False) -> dict:
    """Write the Llama model of ``hf_dir`` as a model-only composer3d checkpoint ``out``; returns
    its model config."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from composer3d.checkpoint import FORMAT_VERSION, META_FILE
    from composer3d.models import build_model, llama

    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ConvertError(f"{hf_dir} is not a Hugging Face model directory: it has no config.json")
    try:
        hf_config = json.loads(config_file.read_text())
        fields = llama.native_config_from_hf(hf_config, ignore_rope_scaling)
    except (ValueError, KeyError) as error:
        what = f"lacks {error}" if isinstance(error, KeyError) else str(error)
        raise ConvertError(f"{config_file}: {what}") from error
    cfg = model_config(fields)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(
            f"{out} exists and is not an empty directory; choose a new checkpoint directory"
        )

    hf_state = load_hf_state(hf_dir)
    try:
        native = llama.native_state_dict_from_hf(hf_state, cfg)
    except KeyError as error:
        raise ConvertError(f"{hf_dir}: {error.args[0]}") from error
    shapes = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    for name, shape in shapes.items():
        if tuple(native[name].shape) != shape:
            raise ConvertError(
                f"{hf_dir}: {llama.hf_names(cfg).get(name, name)} has shape "
                f"{tuple(native[name].shape)}, but config.json implies {shape}"
            )
    # A tied output.weight is the embedding: stored once, under the embedding's name, as a trained
    # model's save does.
    state = {
        "model": {
            k: v.to(torch.float32).contiguous()
            for k, v in native.items()
            if not (k == "output.weight" and cfg.tie_embeddings)
        }
    }
    del hf_state, native

    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(out), no_dist=True)
    model_fields = dataclasses.asdict(cfg)
    meta = {
        "format": FORMAT_VERSION,
        "step": 0,
        "model_only": True,
        "config": {"model": model_fields},
        "layout": {},
        "world_size": 1,
        "source": {"huggingface": str(hf_dir.resolve())},
    }
    # last: its presence marks the checkpoint complete
    (out / META_FILE).write_text(json.dumps(meta, indent=1))
    return model_fields
