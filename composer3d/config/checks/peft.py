"""Parameter-efficient fine-tuning (``peft``): the adapters' settings, and the parallelisms LoRA and
QLoRA compose with. Which linears the patterns name is checked before launch on the model itself
(``parallel.peft``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer3d.config.checks.common import _require
from composer3d.parallel.mesh import Layout

METHODS = ("none", "lora", "qlora")


def _check_peft(cfg: Any, layout: Layout) -> None:
    f, p = cfg.peft, cfg.parallel
    _require(
        f.method in METHODS,
        "peft.method",
        f"unknown method {f.method!r}",
        f"Choose one of {METHODS} (peft=lora or peft=qlora)",
    )
    _require(
        f.method != "none" or not f.init_from,
        "peft.init_from",
        "loads adapters, and peft.method is none",
        "Add peft=lora (or peft=qlora) with the adapter's rank and alpha",
    )
    _require(
        f.method != "none" or not f.base_from,
        "peft.base_from",
        "is the frozen base of LoRA adapters, and peft.method is none",
        "Add peft=lora (or peft=qlora), or continue full training with "
        f"checkpoint.resume={f.base_from}",
    )
    if f.method == "none":
        return
    _require(f.rank >= 1, "peft.rank", f"must be >= 1, got {f.rank}", "Use e.g. 8 or 16")
    _require(f.alpha > 0, "peft.alpha", f"must be > 0, got {f.alpha}", "Use e.g. 2 × peft.rank")
    _require(
        0 <= f.dropout < 1,
        "peft.dropout",
        f"must be in [0, 1), got {f.dropout}",
        "Use 0, or e.g. 0.05",
    )
    _require(
        len(f.target_modules) > 0,
        "peft.target_modules",
        "is empty: nothing would train",
        "Name the linears to adapt, e.g. [wq,wk,wv,wo,w1,w2,w3]",
    )
    if f.init_from:
        _check_init_from(f)
    _require(
        f.dropout == 0 or layout.tp == 1,
        "peft.dropout",
        f"{f.dropout} with parallel.tp={layout.tp}: the tp ranks would each draw their own dropout "
        "mask over the input they share, and their adapter outputs would disagree",
        "Use peft.dropout=0 with tensor parallel",
    )
    experts = [t for t in f.target_modules if "experts" in t and "shared" not in t]
    _require(
        not experts,
        "peft.target_modules",
        f"{experts} would adapt the routed experts, whose stacked weights are no linear layers; "
        "they stay frozen",
        "Leave them out (the shared experts' linears can be adapted)",
    )
    _require(
        not cfg.precision.float8.enabled,
        "precision.float8.enabled",
        "float8 linears would replace the base linears LoRA wraps",
        "Use precision.float8.enabled=false with peft",
    )
    if f.method != "qlora":
        return
    _require(
        layout.tp == 1,
        "parallel.tp",
        "QLoRA's NF4 weights split only by rows (torchao's NF4Tensor), and row-parallel layers "
        "split columns; quantizing each rank's columns on its own would group NF4's "
        "double-quantized scales otherwise than one process does, so the base would differ",
        "Use parallel.tp=1 with peft=qlora (FSDP and PP shard it), or peft=lora",
    )
    _require(
        p.zero_stage != 1 and not (layout.dp_shard == 1 and layout.dp_replicate > 1),
        "parallel.zero_stage",
        "QLoRA's NF4 weights are sharded by FSDP; replicated data parallel (ZeRO-1, DDP) does not "
        "carry them (untested)",
        "Use parallel.zero_stage=3 or 2 with a dp_shard dimension",
    )
    _require(
        p.offload == "none",
        "parallel.offload",
        f"{p.offload} with peft=qlora: offloading NF4 weights is untested",
        "Use parallel.offload=none (the 4-bit base is small already)",
    )


def _check_init_from(f: Any) -> None:
    """The adapter directory is there, PEFT's LoRA, with this run's rank and alpha (its tensors'
    names and shapes are checked against the model's targeted linears before launch:
    ``parallel.peft.check_init_from``)."""
    from composer3d.peft.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config

    directory = Path(f.init_from)
    missing = [
        name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (directory / name).is_file()
    ]
    _require(
        directory.is_dir() and not missing,
        "peft.init_from",
        f"{directory} "
        f"{'lacks ' + ' and '.join(missing) if directory.is_dir() else 'is not a directory'}",
        "Name a PEFT adapter directory (what composer3d-convert export writes for a peft=lora run, "
        "or PeftModel.save_pretrained)",
    )
    try:
        adapter = read_adapter_config(directory)
    except (OSError, ValueError) as error:
        _require(
            False,
            "peft.init_from",
            f"{directory / ADAPTER_CONFIG} is unreadable ({error})",
            "Name a directory PEFT wrote",
        )
    _require(
        adapter.get("peft_type") == "LORA"
        and not adapter.get("use_rslora")
        and not adapter.get("use_dora"),
        "peft.init_from",
        f"{directory} holds a {adapter.get('peft_type')} "
        f"adapter{' with rsLoRA or DoRA' if adapter.get('peft_type') == 'LORA' else ''}",
        "Name a plain LoRA adapter",
    )
    _require(
        adapter.get("r") == f.rank,
        "peft.rank",
        f"is {f.rank}, but the adapter in {directory} has rank {adapter.get('r')}",
        f"Use peft.rank={adapter.get('r')} to continue from it",
    )
    _require(
        float(adapter.get("lora_alpha", 8)) == float(f.alpha),
        "peft.alpha",
        f"is {f.alpha}, but the adapter in {directory} was trained with lora_alpha "
        f"{adapter.get('lora_alpha')}",
        f"Use peft.alpha={adapter.get('lora_alpha')} so its output keeps its scale",
    )
