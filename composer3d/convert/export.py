"""composer3d checkpoint → Hugging Face safetensors directory (any layout it was saved under, one
process)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from composer3d.config.schema import ModelConfig
from composer3d.convert.common import HF_INDEX, ConvertError, model_config
from composer3d.convert.mixtral import (
    mixtral_config_from_native,
    mixtral_mismatches,
    mixtral_state_from_native,
    native_names,
)
from composer3d.dtypes import DTYPES


def read_checkpoint_meta(path: Path) -> dict:
    """The checkpoint's composer3d.json, once the directory is shown to be a complete checkpoint of
    a model that exports."""
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
        raise ConvertError(
            f"the checkpoint's model is {model.get('name')!r}; 'llama' and 'hf' export to Hugging "
            "Face"
        )
    if model.get("name") == "llama" and (model.get("moe") or {}).get("experts", 0) > 0:
        mismatches = mixtral_mismatches(model_config(model))
        if mismatches:
            raise ConvertError(
                "the checkpoint's model is a mixture of experts, which exports as Hugging Face's "
                "Mixtral; Mixtral cannot express its " + "; ".join(mismatches) + ". Train with "
                "those settings as Mixtral has them to export"
            )
    if not (path / ".metadata").exists():
        raise ConvertError(
            f"{path} has {META_FILE} but no DCP .metadata: the checkpoint is incomplete"
        )
    return meta


def stored_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name → whole shape of every model tensor checkpoint ``path`` holds (names without the
    ``model.`` prefix)."""
    from composer3d.checkpoint import SafeFileSystemReader

    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    return {
        key[len("model.") :]: tuple(entry.size)
        for key, entry in stored.items()
        if key.startswith("model.") and hasattr(entry, "size")
    }


def load_model_tensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole model tensors ``shapes`` names of checkpoint ``path``, in the dtype they were saved in;
    each must be stored with that shape. One process, no process group: DCP re-assembles whatever
    shards the saving layout wrote."""
    import torch.distributed.checkpoint as dcp

    from composer3d.checkpoint import SafeFileSystemReader

    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    state = {}
    for name, shape in shapes.items():
        entry = stored.get(f"model.{name}")
        if entry is None or not hasattr(entry, "size"):
            raise ConvertError(
                f"the checkpoint {path} holds no tensor model.{name}, which its config's model has"
            )
        if tuple(entry.size) != shape:
            raise ConvertError(
                f"the checkpoint's model.{name} has shape {tuple(entry.size)}, but its config's "
                f"model expects {shape}"
            )
        state[name] = torch.empty(shape, dtype=entry.properties.dtype)
    wrapped = {"model": state}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(wrapped, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return wrapped["model"]


def load_native_state(path: Path, cfg: ModelConfig, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of the native model in checkpoint ``path``, checked against the shapes its
    config builds."""
    from composer3d.models import build_model

    shapes = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    return load_model_tensors(path, {name: shapes[name] for name in names})


def load_hf_model_state(path: Path, model_fields: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a ``model=hf`` checkpoint, under its (transformers) name; a tied head is left
    out, as transformers saves it."""
    shapes = stored_model_shapes(path)
    if model_fields.get("tie_embeddings"):
        shapes.pop("lm_head.weight", None)
    return load_model_tensors(path, shapes)


def _copy_hf_model_files(source: str | None, out: Path, dtype: str) -> list[Path]:
    """config.json (dtype updated), tokenizer and generation config of the directory the run trained
    from."""
    import shutil

    from composer3d.models.hf import export_files

    if not source or not Path(source, "config.json").is_file():
        raise ConvertError(
            f"the checkpoint was trained from {source!r}, which no longer holds config.json; its "
            "config and tokenizer are exported from there. Restore that directory"
        )
    written = []
    for name in export_files(source):
        shutil.copyfile(Path(source, name), out / name)
        written.append(out / name)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


def peft_method(meta: dict) -> str:
    """How the checkpoint's run fine-tuned: none, lora or qlora (``convert.peft_export`` writes the
    last two)."""
    return ((meta.get("config") or {}).get("peft") or {}).get("method", "none")


def export(
    checkpoint: Path,
    out: Path,
    dtype: str = "bfloat16",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
) -> list[Path]:
    """Write ``checkpoint``'s model as a Hugging Face directory; returns the files written."""
    meta = read_checkpoint_meta(checkpoint)
    if peft_method(meta) != "none":  # its linears are LoRA-wrapped (base_layer, lora_A, lora_B)
        raise ConvertError(
            f"the checkpoint was trained with peft={peft_method(meta)}: export its adapters with "
            "convert.peft_export.export_peft (composer3d-convert export does so)"
        )
    model_fields = meta["config"]["model"]
    if model_fields["name"] == "hf":
        state = load_hf_model_state(checkpoint, model_fields)
    else:
        from composer3d.models import llama

        cfg = model_config(model_fields)
        names = native_names(cfg) if cfg.moe.experts > 0 else list(llama.hf_names(cfg))
        state = load_native_state(checkpoint, cfg, names)
    return write_model(meta, state, out, dtype, max_shard_size, overwrite)


def write_model(
    meta: dict,
    state: dict[str, torch.Tensor],
    out: Path,
    dtype: str,
    max_shard_size: str,
    overwrite: bool,
) -> list[Path]:
    """Whole model tensors under composer3d's names (``state``) as a Hugging Face directory:
    safetensors shards in ``dtype``, config and tokenizer; returns the files written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    model_fields = meta["config"]["model"]
    prepare_out_dir(out, overwrite)
    if model_fields["name"] == "hf":
        written = _copy_hf_model_files(model_fields.get("path"), out, dtype)
        hf_state = _hf_state(state, model_fields, dtype)
    else:
        hf_state = _llama_hf_state(state, model_fields, dtype)
        written = []

    split = split_torch_state_dict_into_shards(
        hf_state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: hf_state[k] for k in keys}, str(out / filename), metadata={"format": "pt"})
        follow_umask(out / filename)
        written.append(out / filename)
    if split.is_sharded:
        index = {
            "metadata": {
                "total_size": sum(t.numel() * t.element_size() for t in hf_state.values())
            },
            "weight_map": split.tensor_to_filename,
        }
        (out / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(out / HF_INDEX)
    if model_fields["name"] == "llama":
        eos_id, tokenizer_files = _write_run_tokenizer(meta, out)
        written += [*tokenizer_files, *_write_llama_config(meta, out, dtype, eos_id)]
    return written


def follow_umask(path: Path) -> None:
    """safetensors creates its files 0600 whatever the umask; give them the mode any new file gets
    here (0644 under the usual 022), like the config and tokenizer beside them, so whoever may read
    the directory may load it."""
    mask = os.umask(0)
    os.umask(mask)  # reading the umask means setting it: set it straight back
    path.chmod(0o666 & ~mask)


def _hf_state(
    state: dict[str, torch.Tensor], model_fields: dict, dtype: str
) -> dict[str, torch.Tensor]:
    """A ``model=hf`` model's tensors under the names and in the form transformers' save_pretrained
    writes them (a mixture of experts' fused parameters split into one tensor per expert, by
    transformers' own mapping)."""
    from composer3d.models.hf import load_hf_config, to_checkpoint_names

    state = to_checkpoint_names(load_hf_config(model_fields["path"]), dict(state))
    written = {}
    for name in list(state):
        tensor = state.pop(name).to(DTYPES[dtype]).contiguous()
        # One expert's slice of a fused tensor is a view: safetensors writes no tensors that share
        # memory.
        written[name] = (
            tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor
        )
    return written


def _llama_hf_state(
    state: dict[str, torch.Tensor], model_fields: dict, dtype: str
) -> dict[str, torch.Tensor]:
    """A native model's tensors as LlamaForCausalLM's, or a mixture of experts' as
    MixtralForCausalLM's."""
    from composer3d.models import llama

    cfg = model_config(model_fields)
    if cfg.moe.experts > 0:
        try:
            state = mixtral_state_from_native(state, cfg)
        except ValueError as error:
            raise ConvertError(
                f"the checkpoint's model cannot be exported as Mixtral: {error}"
            ) from None
    else:
        state = llama.hf_state_dict_from_native(state, cfg)
    return {k: v.to(DTYPES[dtype]).contiguous() for k, v in state.items()}


def _write_run_tokenizer(meta: dict, out: Path) -> tuple[int, list[Path]]:
    """The tokenizer the run trained with (its data.tokenizer, else the byte-level one), saved as
    transformers saves one, so the exported directory generates as it is; returns its eos id and the
    files written."""
    from omegaconf import OmegaConf

    from composer3d.config.schema import DataConfig
    from composer3d.data.tokenizers import ByteTokenizer, build_tokenizer
    from composer3d.errors import ConfigError

    data = OmegaConf.structured(
        DataConfig(tokenizer=(meta["config"].get("data") or {}).get("tokenizer"))
    )
    try:
        tokenizer = build_tokenizer(data)
    except ConfigError as error:
        raise ConvertError(
            f"the run's tokenizer is exported with the model, and it cannot be loaded: {error}"
        ) from None
    hf_tokenizer = (
        tokenizer.to_transformers() if isinstance(tokenizer, ByteTokenizer) else tokenizer.tokenizer
    )
    return tokenizer.eos_id, [Path(name) for name in hf_tokenizer.save_pretrained(out)]


def _write_llama_config(meta: dict, out: Path, dtype: str, eos_id: int) -> list[Path]:
    """config.json, and generation_config.json naming the tokenizer's eos (transformers' generate
    stops there)."""
    from composer3d.models import llama

    try:
        from transformers import GenerationConfig, LlamaConfig, MixtralConfig
    except ImportError as error:
        raise ConvertError("export needs transformers (pip install 'composer3d[hf]')") from error
    cfg = model_config(meta["config"]["model"])
    config_class, fields = (
        (MixtralConfig, mixtral_config_from_native(cfg))
        if cfg.moe.experts > 0
        else (LlamaConfig, llama.hf_config_from_native(cfg))
    )
    config_class(**fields, dtype=dtype, bos_token_id=None, eos_token_id=eos_id).save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id).save_pretrained(out)
    # Spell the RoPE base and dtype the transformers 4 way too: a 4.x reader ignores rope_parameters
    # and would silently fall back to theta 10000.
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("rope_theta", float(cfg.rope_theta))
    config.setdefault("torch_dtype", dtype)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [config_file, out / "generation_config.json"]


def prepare_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(
        p
        for p in out.iterdir()
        if p.name == "config.json"
        or p.name == HF_INDEX
        or (p.name.startswith("model") and p.name.endswith(".safetensors"))
    )
    if stale and not overwrite:
        raise ConvertError(
            f"{out} already holds model files ({', '.join(p.name for p in stale[:4])}); choose an "
            "empty directory or pass --overwrite"
        )
    for path in stale:  # old shards would be mixed with new ones
        path.unlink()
