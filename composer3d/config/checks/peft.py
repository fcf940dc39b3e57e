"""Parameter-efficient fine-tuning (``peft``): the adapters' settings, and the parallelisms LoRA and QLoRA compose
with. Which linears the patterns name is checked before launch on the model itself (``parallel.peft``)."""

from __future__ import annotations

from typing import Any

from composer3d.config.checks.common import _require

METHODS = ("none", "lora", "qlora")


def _check_peft(cfg: Any, degrees: dict[str, int]) -> None:
    f, p = cfg.peft, cfg.parallel
    _require(f.method in METHODS, "peft.method", f"unknown method {f.method!r}", f"Choose one of {METHODS} "
             "(peft=lora or peft=qlora)")
    if f.method == "none":
        return
    _require(f.rank >= 1, "peft.rank", f"must be >= 1, got {f.rank}", "Use e.g. 8 or 16")
    _require(f.alpha > 0, "peft.alpha", f"must be > 0, got {f.alpha}", "Use e.g. 2 × peft.rank")
    _require(0 <= f.dropout < 1, "peft.dropout", f"must be in [0, 1), got {f.dropout}", "Use 0, or e.g. 0.05")
    _require(len(f.target_modules) > 0, "peft.target_modules", "is empty: nothing would train",
             "Name the linears to adapt, e.g. [wq,wk,wv,wo,w1,w2,w3]")
    _require(f.dropout == 0 or degrees["tp"] == 1, "peft.dropout", f"{f.dropout} with parallel.tp={degrees['tp']}: "
             "the tp ranks would each draw their own dropout mask over the input they share, and their adapter "
             "outputs would disagree", "Use peft.dropout=0 with tensor parallel")
    experts = [t for t in f.target_modules if "experts" in t and "shared" not in t]
    _require(not experts, "peft.target_modules", f"{experts} would adapt the routed experts, whose stacked weights "
             "are no linear layers; they stay frozen", "Leave them out (the shared experts' linears can be adapted)")
    _require(not cfg.precision.float8.enabled, "precision.float8.enabled", "float8 linears would replace the base "
             "linears LoRA wraps", "Use precision.float8.enabled=false with peft")
    if f.method != "qlora":
        return
    _require(degrees["tp"] == 1, "parallel.tp", "QLoRA's NF4 weights split only by rows (torchao's NF4Tensor), and "
             "row-parallel layers split columns", "Use parallel.tp=1 with peft=qlora (FSDP and PP shard it), or "
             "peft=lora")
    _require(p.zero_stage != 1 and not (degrees["dp_shard"] == 1 and degrees["dp_replicate"] > 1),
             "parallel.zero_stage", "QLoRA's NF4 weights are sharded by FSDP; replicated data parallel (ZeRO-1, "
             "DDP) does not carry them (untested)", "Use parallel.zero_stage=3 or 2 with a dp_shard dimension")
    _require(p.offload == "none", "parallel.offload", f"{p.offload} with peft=qlora: offloading NF4 weights is "
             "untested", "Use parallel.offload=none (the 4-bit base is small already)")
