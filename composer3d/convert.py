"""composer3d-convert: composer3d checkpoints <-> Hugging Face safetensors directories.

    composer3d-convert export CHECKPOINT_DIR OUT_DIR [--dtype bfloat16|float16|float32]
    composer3d-convert import HF_DIR OUT_CHECKPOINT_DIR

``export`` reads the model part of a checkpoint (saved under any layout and world size) in one process, with no
process group, and writes safetensors shards plus a ``config.json`` that ``LlamaForCausalLM.from_pretrained``
loads. A run of ``model=hf`` (any transformers causal LM) already uses the checkpoint's own names: its export
writes them unchanged, next to the source directory's config.json, tokenizer and generation config. ``import``
(native Llama only) writes a model-only composer3d checkpoint (fp32) that training loads as pretrained weights with
``checkpoint.resume=<dir>``, and prints the overrides that reproduce the model config. The name mapping and the
RoPE permutation live in ``composer3d.models.llama``. Nothing is unpickled: safetensors, JSON, and DCP through
``SafeFileSystemReader``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import warnings
from pathlib import Path

import torch

from composer3d.dtypes import DTYPES

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


class ConvertError(Exception):
    """A problem with the user's input; main prints it and exits non-zero."""


# ------------------------------------------------------------------------------------------ shared

def _model_config(fields: dict):
    from composer3d.config import ModelConfig

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConvertError(f"the model config has keys ModelConfig does not know: {unknown}")
    cfg = ModelConfig(**fields)
    missing = [k for k in known if getattr(cfg, k) == "???"]  # omegaconf's MISSING
    if missing:
        raise ConvertError(f"the model config lacks required keys {sorted(missing)}")
    return cfg


def _override(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def hydra_overrides(model_fields: dict, checkpoint_dir: Path) -> list[str]:
    """Command-line overrides that make a run's model config equal ``model_fields`` and load ``checkpoint_dir``."""
    return [f"model.{k}={_override(v)}" for k, v in model_fields.items()] + [f"checkpoint.resume={checkpoint_dir}"]


# ------------------------------------------------------------------------------------------ export

def _read_checkpoint_meta(path: Path) -> dict:
    from composer3d.checkpoint import META_FILE, committed_checkpoints, read_meta

    if not path.is_dir():
        raise ConvertError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}")
    if not (path / META_FILE).exists():
        hint = ""
        for candidate in (path, path / "checkpoints"):
            found = committed_checkpoints(candidate)
            if found:
                hint = f"; it holds checkpoints, the newest being {found[0]}"
                break
        if path.name.endswith(".partial"):
            hint = "; it is an unfinished save (a .partial directory)"
        raise ConvertError(f"{path} is not a composer3d checkpoint: it has no {META_FILE}{hint}")
    try:
        meta = read_meta(path)
    except (ValueError, json.JSONDecodeError) as error:
        raise ConvertError(f"{path / META_FILE} is unreadable: {error}") from error
    model = (meta.get("config") or {}).get("model")
    if not isinstance(model, dict):
        raise ConvertError(f"{path / META_FILE} has no config.model")
    if model.get("name") not in ("llama", "hf"):
        raise ConvertError(f"the checkpoint's model is {model.get('name')!r}; 'llama' and 'hf' export to Hugging Face")
    if not (path / ".metadata").exists():
        raise ConvertError(f"{path} has {META_FILE} but no DCP .metadata: the checkpoint is incomplete")
    return meta


def stored_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name → whole shape of every model tensor checkpoint ``path`` holds (names without the ``model.`` prefix)."""
    from composer3d.checkpoint import SafeFileSystemReader

    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    return {key[len("model."):]: tuple(entry.size) for key, entry in stored.items()
            if key.startswith("model.") and hasattr(entry, "size")}


def load_model_tensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole model tensors ``shapes`` names of checkpoint ``path``, in the dtype they were saved in; each must be
    stored with that shape. One process, no process group: DCP re-assembles whatever shards the saving layout
    wrote."""
    import torch.distributed.checkpoint as dcp

    from composer3d.checkpoint import SafeFileSystemReader

    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    state = {}
    for name, shape in shapes.items():
        entry = stored.get(f"model.{name}")
        if entry is None or not hasattr(entry, "size"):
            raise ConvertError(f"the checkpoint {path} holds no tensor model.{name}, which its config's model has")
        if tuple(entry.size) != shape:
            raise ConvertError(f"the checkpoint's model.{name} has shape {tuple(entry.size)}, but its config's model "
                               f"expects {shape}")
        state[name] = torch.empty(shape, dtype=entry.properties.dtype)
    wrapped = {"model": state}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(wrapped, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return wrapped["model"]


def load_native_state(path: Path, cfg, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of the native model in checkpoint ``path``, checked against the shapes its config builds."""
    from composer3d.models import build_model

    shapes = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    return load_model_tensors(path, {name: shapes[name] for name in names})


def load_hf_model_state(path: Path, model_fields: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a ``model=hf`` checkpoint, under its (transformers) name; a tied head is left out, as
    transformers saves it."""
    shapes = stored_model_shapes(path)
    if model_fields.get("tie_embeddings"):
        shapes.pop("lm_head.weight", None)
    return load_model_tensors(path, shapes)


def _copy_hf_model_files(source: str | None, out: Path, dtype: str) -> list[Path]:
    """config.json (dtype updated), tokenizer and generation config of the directory the run trained from."""
    import shutil

    from composer3d.models.hf_weights import export_files

    if not source or not Path(source, "config.json").is_file():
        raise ConvertError(f"the checkpoint was trained from {source!r}, which no longer holds config.json; its "
                           "config and tokenizer are exported from there. Restore that directory")
    written = []
    for name in export_files(source):
        shutil.copyfile(Path(source, name), out / name)
        written.append(out / name)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


def export(checkpoint: Path, out: Path, dtype: str = "bfloat16", max_shard_size: str = "5GB",
           overwrite: bool = False) -> list[Path]:
    """Write ``checkpoint``'s model as a Hugging Face directory; returns the files written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    meta = _read_checkpoint_meta(checkpoint)
    model_fields = meta["config"]["model"]
    _prepare_out_dir(out, overwrite)
    if model_fields["name"] == "hf":
        hf_state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in load_hf_model_state(checkpoint, model_fields).items()}
        written = _copy_hf_model_files(model_fields.get("path"), out, dtype)
    else:
        hf_state = _llama_hf_state(checkpoint, model_fields, dtype)
        written = []

    split = split_torch_state_dict_into_shards(hf_state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: hf_state[k] for k in keys}, str(out / filename), metadata={"format": "pt"})
        written.append(out / filename)
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf_state.values())},
                 "weight_map": split.tensor_to_filename}
        (out / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(out / HF_INDEX)
    if model_fields["name"] == "llama":
        written.append(_write_llama_config(meta, out, dtype))
    return written


def _llama_hf_state(checkpoint: Path, model_fields: dict, dtype: str) -> dict[str, torch.Tensor]:
    from composer3d.models import llama

    cfg = _model_config(model_fields)
    native = load_native_state(checkpoint, cfg, list(llama.hf_names(cfg)))
    return {k: v.to(DTYPES[dtype]).contiguous() for k, v in llama.hf_state_dict_from_native(native, cfg).items()}


def _write_llama_config(meta: dict, out: Path, dtype: str) -> Path:
    from composer3d.models import llama

    try:
        from transformers import LlamaConfig
    except ImportError as error:
        raise ConvertError("export needs transformers (pip install 'composer3d[hf]')") from error
    cfg = _model_config(meta["config"]["model"])
    LlamaConfig(**llama.hf_config_from_native(cfg), dtype=dtype, bos_token_id=None, eos_token_id=None).save_pretrained(out)
    # Spell the RoPE base and dtype the transformers 4 way too: a 4.x reader ignores rope_parameters and would
    # silently fall back to theta 10000.
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("rope_theta", float(cfg.rope_theta))
    config.setdefault("torch_dtype", dtype)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config_file


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p for p in out.iterdir() if p.name == "config.json" or p.name == HF_INDEX
                   or (p.name.startswith("model") and p.name.endswith(".safetensors")))
    if stale and not overwrite:
        raise ConvertError(f"{out} already holds model files ({', '.join(p.name for p in stale[:4])}); "
                           "choose an empty directory or pass --overwrite")
    for path in stale:  # old shards would be mixed with new ones
        path.unlink()


# ------------------------------------------------------------------------------------------ import

def load_hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors directory (one file or shards named by the index)."""
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
        raise ConvertError(f"{hf_dir} has no {HF_WEIGHTS} or {HF_INDEX}"
                           + (f" (only pickled weights {pickled[:3]}, which composer3d does not unpickle: re-save "
                              "them as safetensors)" if pickled else ""))
    state = {}
    for name in files:
        if not (hf_dir / name).exists():
            raise ConvertError(f"{hf_dir / name}, named by {HF_INDEX}, does not exist")
        state.update(load_file(str(hf_dir / name)))
    return state


def import_hf(hf_dir: Path, out: Path, ignore_rope_scaling: bool = False) -> dict:
    """Write the Llama model of ``hf_dir`` as a model-only composer3d checkpoint ``out``; returns its model config."""
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
    cfg = _model_config(fields)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} exists and is not an empty directory; choose a new checkpoint directory")

    hf_state = load_hf_state(hf_dir)
    try:
        native = llama.native_state_dict_from_hf(hf_state, cfg)
    except KeyError as error:
        raise ConvertError(f"{hf_dir}: {error.args[0]}") from error
    shapes = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    for name, shape in shapes.items():
        if tuple(native[name].shape) != shape:
            raise ConvertError(f"{hf_dir}: {llama.hf_names(cfg).get(name, name)} has shape {tuple(native[name].shape)}, "
                               f"but config.json implies {shape}")
    # A tied output.weight is the embedding: clone it so DCP stores two plain tensors, as a trained model's save does.
    state = {"model": {k: (v.clone() if k == "output.weight" and cfg.tie_embeddings else v).to(torch.float32).contiguous()
                       for k, v in native.items()}}
    del hf_state, native

    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(out), no_dist=True)
    model_fields = dataclasses.asdict(cfg)
    meta = {"format": FORMAT_VERSION, "step": 0, "model_only": True, "config": {"model": model_fields},
            "layout": {}, "world_size": 1, "source": {"huggingface": str(hf_dir.resolve())}}
    (out / META_FILE).write_text(json.dumps(meta, indent=1))  # last: its presence marks the checkpoint complete
    return model_fields


# ------------------------------------------------------------------------------------------ CLI

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="composer3d-convert",
                                     description="Convert composer3d checkpoints to and from Hugging Face Llama.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="checkpoint directory -> Hugging Face LlamaForCausalLM safetensors directory")
    ex.add_argument("checkpoint", type=Path, help="a checkpoint directory (…/checkpoints/step-NNNNNNNN)")
    ex.add_argument("out", type=Path, help="output directory (created; must hold no model files unless --overwrite)")
    ex.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the written tensors")
    ex.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    ex.add_argument("--overwrite", action="store_true", help="replace model files already in the output directory")
    im = sub.add_parser("import", help="Hugging Face Llama directory -> model-only composer3d checkpoint")
    im.add_argument("hf_dir", type=Path, help="directory with config.json and model*.safetensors")
    im.add_argument("out", type=Path, help="new checkpoint directory (must not exist or be empty)")
    im.add_argument("--ignore-rope-scaling", action="store_true",
                    help="import a model with RoPE scaling (e.g. Llama-3.1's 'llama3' type) as plain RoPE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            written = export(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.overwrite)
            print(f"exported {args.checkpoint} to {args.out} ({args.dtype}): {', '.join(p.name for p in written)}")
        else:
            fields = import_hf(args.hf_dir, args.out, args.ignore_rope_scaling)
            print(f"imported {args.hf_dir} as the model-only checkpoint {args.out}")
            print("train from it with these overrides (the model config must match the checkpoint's exactly):")
            print("  composer3d-train " + " ".join(shlex.quote(o) for o in hydra_overrides(fields, args.out.resolve())))
    except ConvertError as error:
        print(f"composer3d-convert {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
