"""The keys composer3d-plan and parallel=auto read beyond a training config's (kept with the
planner: config/checks/ sits below it)."""

from __future__ import annotations

from typing import Any

from composer3d.config.checks import (
    _check_known_keys,
    _check_model,
    _check_objective,
    _check_optimizer,
    _require,
)
from composer3d.plan.comm import EP_DISPATCH
from composer3d.plan.hardware import DEVICES
from composer3d.plan.kernels import ATTENTION_FRACTION, NORM_BYTES
from composer3d.plan.layouts import ZERO_BUBBLE, WithKeys


def validate_plan(cfg: Any) -> None:
    """The keys composer3d-plan and parallel=auto read beyond a training config's: the cluster and
    the output; and what training refuses under every layout the search could give (the objective's
    model and switches: the degrees it refuses, the search leaves out)."""
    _check_known_keys(cfg)
    _check_model(cfg.model)
    _check_objective(cfg, None)
    # the optimizer's settings, on a layout every optimizer runs under (the search asks its ZeRO
    # stages of it: layouts.py)
    _check_optimizer(cfg.optim, WithKeys(cfg.parallel, zero_stage=3, tp=1))
    _require(
        cfg.parallel.offload != "optimizer" or cfg.optim.name == "adamw",
        "parallel.offload",
        f"the host optimizer step is torch's AdamW; optim.name={cfg.optim.name} "
        + ("steps on the device" if cfg.optim.name == "muon" else "keeps its low-bit state there"),
        "Use optim.name=adamw with parallel.offload=optimizer, or parallel.offload=none",
    )
    c, p = cfg.cluster, cfg.plan
    _require(
        c.device in DEVICES,
        "cluster.device",
        f"unknown device {c.device!r}",
        f"Choose one of {sorted(DEVICES)}, or the closest one with cluster.memory_gib / "
        "cluster.peak_tflops / cluster.*_gbps set",
    )
    for key in ("nodes", "gpus_per_node"):
        _require(
            getattr(c, key) >= 1,
            f"cluster.{key}",
            f"must be >= 1, got {getattr(c, key)}",
            "Use 1 or more",
        )
    for key in (
        "memory_gib",
        "peak_tflops",
        "intra_node_gbps",
        "inter_node_gbps",
        "host_link_gbps",
        "host_optimizer_gbps",
        "host_memory_gib",
        "disk_gbps",
        "hbm_gbps",
    ):
        value = getattr(c, key)
        _require(
            value is None or value > 0,
            f"cluster.{key}",
            f"must be > 0, got {value}",
            "Use null for the device table's value",
        )
    _require(
        0 < c.achievable_fraction <= 1,
        "cluster.achievable_fraction",
        f"must be in (0, 1], got {c.achievable_fraction}",
        "Use e.g. 0.8",
    )
    _require(
        p.format in ("table", "json"),
        "plan.format",
        f"unknown format {p.format!r}",
        "Choose table or json",
    )
    _require(
        p.attention_kernel in ATTENTION_FRACTION,
        "plan.attention_kernel",
        f"unknown kernel {p.attention_kernel!r}",
        f"Choose one of {sorted(ATTENTION_FRACTION)}",
    )
    _require(
        p.norm_kernel in NORM_BYTES,
        "plan.norm_kernel",
        f"unknown kernel {p.norm_kernel!r}",
        f"Choose one of {sorted(NORM_BYTES)}",
    )
    _require(
        p.ep_dispatch in EP_DISPATCH,
        "plan.ep_dispatch",
        f"unknown dispatch {p.ep_dispatch!r}",
        f"Choose one of {list(EP_DISPATCH)}",
    )
    _require(p.top >= 1, "plan.top", f"must be >= 1, got {p.top}", "Use e.g. 10")
    world = c.nodes * c.gpus_per_node
    _require(
        0 <= p.measure_rank < world,
        "plan.measure_rank",
        f"must name a rank of the {world} (cluster.nodes × cluster.gpus_per_node), got "
        f"{p.measure_rank}",
        f"Use 0 to {world - 1}",
    )
    schedule = cfg.parallel.pp_schedule
    _require(
        not (p.measure and cfg.parallel.pp > 1 and schedule in ZERO_BUBBLE),
        "parallel.pp_schedule",
        f"plan.measure cannot run {schedule}: torch's MemTracker follows the backward by hooks on "
        "each module's inputs, which the autograd.grad call a zero-bubble schedule splits input "
        "from weight gradients with rejects for a stage's received activations (torch 2.13)",
        "Measure the layout under parallel.pp_schedule=interleaved_1f1b (two stages a rank, as zbv "
        "and dualpipev place them) or 1f1b",
    )
    _require(
        p.measure_steps >= 1,
        "plan.measure_steps",
        f"must be >= 1, got {p.measure_steps}",
        "Use e.g. 3",
    )
    _require(
        p.calibrate_repeats >= 1,
        "plan.calibrate_repeats",
        f"must be >= 1, got {p.calibrate_repeats}",
        "Use e.g. 5",
    )
    _require(
        0 < p.memory_headroom <= 1,
        "plan.memory_headroom",
        f"must be in (0, 1], got {p.memory_headroom}",
        "Use e.g. 0.9",
    )
