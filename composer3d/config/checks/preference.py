"""The training objective: preference tuning (``train.objective=dpo``) on preference data, its loss
and reference settings, and the layouts and switches this first version does not run yet (each
refused with what would work)."""

from __future__ import annotations

from typing import Any

from composer3d.config.checks.common import _require
from composer3d.parallel.mesh import Layout
from composer3d.parallel.pipeline.schedules import forward_only_problem

OBJECTIVES = ("sft", "dpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCES = ("copy", "adapters_off", "precomputed")


def _check_objective(cfg: Any, layout: Layout | None) -> None:
    """``layout`` None: what refuses a config under every layout (the planner's search, which
    leaves out the schedules ``_check_reference_pipeline`` refuses)."""
    t, d = cfg.train, cfg.data
    _require(
        t.objective in OBJECTIVES,
        "train.objective",
        f"unknown objective {t.objective!r}",
        f"Choose one of {OBJECTIVES}",
    )
    dpo = t.objective == "dpo"
    _require(
        not dpo or d.format == "preference",
        "train.objective",
        f"dpo trains on chosen/rejected pairs, and data.format={d.format} holds none",
        "Add data=preference data.paths=[pairs.jsonl] (prompt, chosen, rejected per row)",
    )
    _require(
        dpo or d.format != "preference",
        "data.format",
        f"preference pairs train only a preference objective, and train.objective={t.objective}",
        "Add train.objective=dpo (or train on the chosen replies as chat data)",
    )
    if dpo:
        _check_preference(cfg.preference, cfg.peft, cfg.model)
        if layout is not None:
            _check_reference_pipeline(cfg, layout)
        _check_dpo_switches(cfg)


def _check_preference(pref: Any, peft: Any, model: Any) -> None:
    _require(
        pref.loss_type in LOSS_TYPES,
        "preference.loss_type",
        f"unknown loss {pref.loss_type!r}",
        f"Choose one of {LOSS_TYPES}",
    )
    _require(pref.beta > 0, "preference.beta", f"must be > 0, got {pref.beta}", "Use e.g. 0.1")
    _require(
        0 <= pref.label_smoothing < 0.5,
        "preference.label_smoothing",
        f"must be in [0, 0.5), got {pref.label_smoothing}",
        "Use 0, or e.g. 0.1",
    )
    _require(
        pref.label_smoothing == 0 or pref.loss_type in ("sigmoid", "simpo"),
        "preference.label_smoothing",
        f"{pref.label_smoothing} smooths the sigmoid and simpo losses, and loss_type is "
        f"{pref.loss_type}",
        "Use preference.label_smoothing=0, or preference.loss_type=sigmoid",
    )
    _require(
        pref.simpo_gamma >= 0,
        "preference.simpo_gamma",
        f"must be >= 0, got {pref.simpo_gamma}",
        "Use e.g. 0.5",
    )
    _require(
        pref.reference in REFERENCES,
        "preference.reference",
        f"unknown reference {pref.reference!r}",
        f"Choose one of {REFERENCES}",
    )
    if pref.reference != "adapters_off" or pref.loss_type == "simpo":
        return
    _require(
        peft.method != "none",
        "preference.reference",
        "adapters_off is the policy with its LoRA adapters switched off, and peft.method is none",
        "Add peft=lora (or peft=qlora), or use preference.reference=copy",
    )
    # With these the policy minus its adapters is no longer the initial policy
    _require(
        not peft.modules_to_save,
        "preference.reference",
        f"adapters_off would run peft.modules_to_save={list(peft.modules_to_save)} as they train, "
        "not as they started",
        "Use preference.reference=copy, or peft.modules_to_save=[]",
    )
    _require(
        not peft.init_from,
        "preference.reference",
        f"adapters_off would be the base without the adapters of peft.init_from={peft.init_from}, "
        "not the policy training starts from",
        "Use preference.reference=copy (a frozen copy with those adapters)",
    )
    _require(
        model.moe.experts == 0 or model.moe.bias_update_rate == 0,
        "preference.reference",
        "adapters_off would route by the experts' balancing bias as training moves it "
        f"(model.moe.bias_update_rate={model.moe.bias_update_rate}), not as it started",
        "Use preference.reference=copy, or model.moe.bias_update_rate=0",
    )


def runs_reference(cfg: Any) -> bool:
    """Whether the run has a reference model to run forward (dpo but reference-free simpo), each
    step or (precomputed) in one pass before them."""
    return cfg.train.objective == "dpo" and cfg.preference.loss_type != "simpo"


def reference_each_step(cfg: Any) -> str | None:
    """The reference (preference.reference) where it runs forward every step, else None."""
    each_step = runs_reference(cfg) and cfg.preference.reference != "precomputed"
    return cfg.preference.reference if each_step else None


def _check_reference_pipeline(cfg: Any, layout: Layout) -> None:
    problem = forward_only_problem(cfg.parallel.pp_schedule, "train.objective=dpo's reference")
    _require(
        layout.pp == 1 or not runs_reference(cfg) or problem is None,
        "parallel.pp_schedule",
        problem,
        "Use another schedule (1f1b, interleaved_1f1b, interleaved_zero_bubble, …), or "
        "preference.loss_type=simpo (no reference)",
    )


def _check_dpo_switches(cfg: Any) -> None:
    """What train.objective=dpo does not run yet under any layout, each with a reason."""
    _require(
        cfg.train.loss_impl == "chunked",
        "train.loss_impl",
        "fused computes the gradients in the forward from a known output gradient, and DPO's is "
        "known only once every token's log-probability is",
        "Use train.loss_impl=chunked with train.objective=dpo",
    )
    _require(
        cfg.memory.tile_loss <= 1,
        "memory.tile_loss",
        "train.objective=dpo does not run the head in sequence tiles yet",
        "Use memory.tile_loss=0 with train.objective=dpo",
    )
    _require(
        not cfg.compile.enabled,
        "compile.enabled",
        "train.objective=dpo is not checked compiled yet (the reference's no-grad forwards, and "
        "the adapters' switch, add compiled graphs no test has measured)",
        "Use compile.enabled=false with train.objective=dpo",
    )
