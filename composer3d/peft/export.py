"""A LoRA or QLoRA checkpoint (``peft=lora|qlora``) → PEFT's adapter directory, or with ``merge``
the merged model.

The adapter directory is what ``peft.PeftModel.from_pretrained(base, OUT)`` loads:
``adapter_config.json`` (r, lora_alpha, target_modules and modules_to_save by their Hugging Face
names, task CAUSAL_LM) and ``adapter_model.safetensors`` under PEFT's keys
(``base_model.model.<module>.lora_A.weight``; a saved module's tensors as
``base_model.model.<module>.weight``). The base a PEFT user loads: ``model=hf`` with pretrained
weights, the run's ``model.path`` (the base never trained); otherwise (the native model, or
``model=hf`` from its seed) the run's frozen base, written into OUT/base as the full export writes a
model. QLoRA's adapters were trained on the NF4-rounded base: PEFT applies them to the original
weights. ``merge`` writes W + scaling·B·A (fp32, then ``dtype``) as the full export writes a model;
under QLoRA W is the dequantized NF4 base, so the merged weights carry NF4's rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from composer3d.convert.common import ConvertError, model_config
from composer3d.convert.export import (
    follow_umask,
    load_model_tensors,
    peft_method,
    prepare_out_dir,
    read_checkpoint_meta,
    stored_model_shapes,
    write_model,
)
from composer3d.dtypes import DTYPES
from composer3d.peft.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    hf_weight_names,
    peft_key,
    rope_heads,
)
from composer3d.peft.lora import ADAPTERS, base_name

BASE_DIR = "base"  # where the base is written when no directory holds it


def export_peft(
    checkpoint: Path,
    out: Path,
    dtype: str = "bfloat16",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    merge: bool = False,
) -> list[Path]:
    """Write ``checkpoint``'s adapters as a PEFT directory (``merge``: the merged full model); the
    files written."""
    meta = read_checkpoint_meta(checkpoint)
    if peft_method(meta) == "none":
        raise ConvertError(
            "the checkpoint was trained without peft: it has no adapters to export or merge. "
            "Export it without --merge"
        )
    peft = meta["config"]["peft"]
    base, adapters = split_adapters(load_lora_state(checkpoint, meta))
    scaling = peft["alpha"] / peft["rank"]
    if merge:
        return write_model(
            meta, merged(base, adapters, scaling), out, dtype, max_shard_size, overwrite
        )
    model_fields = meta["config"]["model"]
    base_dir = (
        model_fields.get("path")
        if model_fields["name"] == "hf" and model_fields.get("pretrained")
        else None
    )
    _prepare_adapter_dir(out, overwrite)
    written = []
    # no directory holds the base the adapters trained on: write it under OUT/base (not in
    if base_dir is None:
        # OUT itself: transformers would load OUT's adapter into a base read from there)
        written = write_model(meta, base, out / BASE_DIR, dtype, max_shard_size, overwrite)
        base_dir = str((out / BASE_DIR).resolve())
    names = _hf_module_names(model_fields, base)
    saved = _saved_modules(peft.get("modules_to_save") or [], base, adapters)
    tensors = adapter_tensors(model_fields, base, adapters, saved)
    from safetensors.torch import save_file

    save_file(
        {k: v.to(DTYPES[dtype]).contiguous() for k, v in tensors.items()},
        str(out / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    follow_umask(out / ADAPTER_WEIGHTS)
    config = adapter_config(
        peft, base_dir, [names[m] for m in adapters], [names[m] for m in saved], names
    )
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(_readme(peft, base_dir))
    return [*written, out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS, out / "README.md"]


def load_lora_state(checkpoint: Path, meta: dict) -> dict[str, torch.Tensor]:
    """Every model tensor, whole, under its name in the LoRA model: the adapters (and
    modules_to_save) as the checkpoint holds them; the frozen base rebuilt from the source the
    checkpoint records (``checkpoint.peft_base``; QLoRA's NF4 base dequantized, fp32)."""
    from composer3d.peft.base import whole_base

    base = whole_base(meta)
    shapes = stored_model_shapes(checkpoint)
    model_fields = meta["config"]["model"]
    if model_fields["name"] == "hf" and model_fields.get("tie_embeddings"):
        shapes.pop("lm_head.weight", None)  # a tied head is stored as the embedding
    # checkpoints from before the base was left out hold it too: it is rebuilt all the same
    return {
        **base,
        **load_model_tensors(checkpoint, {n: s for n, s in shapes.items() if n not in base}),
    }


def split_adapters(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(the model's other tensors under their unwrapped names, adapted module → (lora_A, lora_B)
    weights)."""
    base, adapters = {}, {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        owner, _, kind = module.rpartition(".")
        if kind in ADAPTERS:
            adapters.setdefault(owner, {})[kind] = tensor
        else:
            base[base_name(name)] = tensor
    return base, {module: (pair["lora_A"], pair["lora_B"]) for module, pair in adapters.items()}


def merged(
    base: dict[str, torch.Tensor], adapters: dict[str, tuple], scaling: float
) -> dict[str, torch.Tensor]:
    """The base with each adapted weight W replaced by W + scaling · B · A, computed in fp32."""
    out = dict(base)
    for module, (a, b) in adapters.items():
        out[f"{module}.weight"] = base[f"{module}.weight"].float() + scaling * (
            b.float() @ a.float()
        )
    return out


def _hf_module_names(model_fields: dict, base: dict[str, torch.Tensor]) -> dict[str, str]:
    """Module name in the checkpoint → its Hugging Face name (``model=hf``: the same)."""
    modules = {name.rpartition(".")[0] for name in base}
    if model_fields["name"] == "hf":
        return {m: m for m in modules}
    from composer3d.models import llama

    weights = llama.hf_names(model_config(model_fields))
    return {native.rpartition(".")[0]: hf.rpartition(".")[0] for native, hf in weights.items()}


def _saved_modules(patterns: list[str], base: dict[str, torch.Tensor], adapters: dict) -> list[str]:
    """The modules ``peft.modules_to_save`` trained whole (the outermost that a pattern names)."""
    from composer3d.peft.apply import matches

    saved = set()
    for name in base:
        parts = name.split(".")[:-1]
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        hit = next((p for p in prefixes if matches(p, patterns)), None)
        if hit is not None:
            saved.add(hit)
    inside = sorted(m for m in adapters for s in saved if m.startswith(f"{s}."))
    if inside:
        raise ConvertError(
            f"peft.modules_to_save names modules that hold adapted linears ({inside[:3]}); PEFT "
            "cannot save a module whole around LoRA layers"
        )
    return sorted(saved)


def adapter_tensors(
    model_fields: dict, base: dict, adapters: dict, saved: list[str]
) -> dict[str, torch.Tensor]:
    """The adapters and saved modules under PEFT's keys; the native model's q/k rows permuted as its
    export permutes the base weights (``models.peft_adapters``)."""
    from composer3d.models import llama

    cfg = model_config(model_fields)
    names = hf_weight_names(cfg)
    tensors = {}
    for module, (a, b) in adapters.items():
        heads = rope_heads(f"{module}.lora_B.weight", cfg)
        tensors[peft_key(f"{module}.lora_A.weight", names)] = a
        tensors[peft_key(f"{module}.lora_B.weight", names)] = (
            b if heads is None else llama.rope_interleaved_to_half(b, heads)
        )
    for name in [n for n in base if any(n.startswith(f"{module}.") for module in saved)]:
        tensors[peft_key(name, names)] = base[name]
    return tensors


def adapter_config(
    peft: dict, base_dir: str, adapted: list[str], saved: list[str], names: dict[str, str]
) -> dict:
    """PEFT's LoraConfig fields. target_modules: the adapted modules' last names when those select
    exactly them among the model's modules (PEFT matches a name's end), else their full names."""
    leaves = {m.rpartition(".")[2] for m in adapted}
    selected = {m for m in names.values() if m.rpartition(".")[2] in leaves}
    targets = sorted(leaves) if selected == set(adapted) else sorted(adapted)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_dir,
        "r": peft["rank"],
        "lora_alpha": peft["alpha"],
        "lora_dropout": peft["dropout"],
        "target_modules": targets,
        "modules_to_save": saved or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _readme(peft: dict, base_dir: str) -> str:
    """The directory's model card: what the adapters are and which base they go on."""
    text = (
        f"# LoRA adapters exported by composer3d-convert\n\npeft={peft['method']}, "
        f"r={peft['rank']}, lora_alpha={peft['alpha']}. Load with "
        f"`peft.PeftModel.from_pretrained(base, <this directory>)`, the base being `{base_dir}`.\n"
    )
    if peft["method"] == "qlora":
        text += (
            "\nQLoRA: these adapters were trained on the base weights rounded to 4-bit NF4 and "
            "dequantized; PEFT applies them to the original base, whose outputs differ from the "
            "training run's by NF4's rounding. A base loaded in 4 bits (bitsandbytes NF4) comes "
            "closer; `--merge` writes the dequantized NF4 base plus the adapters.\n"
        )
    return text


def _prepare_adapter_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    stale = [p for p in (out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS) if p.exists()]
    if stale and not overwrite:
        raise ConvertError(
            f"{out} already holds an adapter ({', '.join(p.name for p in stale)}); choose an empty "
            "directory or pass --overwrite"
        )
    prepare_out_dir(out, overwrite)
