"""``parallel=auto`` in composer3d-train: the planner's fastest layout that fits, written into the
run's config.

Every process plans alike (the same config, world size and cluster: the arithmetic is
deterministic), so the launcher's preflight and each worker arrive at the same layout without a
collective. The cluster is the run's own: ``launch.nproc_per_node`` devices per node and the job's
world size; on the CPU the nominal ``cpu`` entry, on an accelerator ``cluster.device`` (default
h100) for its memory, peak and links.
"""

from __future__ import annotations

from omegaconf import open_dict

from composer3d.config.schema import TrainConfig
from composer3d.plan.hardware import cluster_from_config
from composer3d.plan.layouts import apply_to_config
from composer3d.plan.search import best, why_slower
from composer3d.plan.validation import validate_plan


def choose_layout(
    cfg: TrainConfig, world_size: int, local_world_size: int, device_type: str
) -> dict:
    """Apply the chosen layout to ``cfg``; returns what run.json records about the choice (and
    why)."""
    with open_dict(cfg):
        cfg.cluster.gpus_per_node = local_world_size
        cfg.cluster.nodes = max(1, world_size // local_world_size)
        if device_type == "cpu":
            cfg.cluster.device = "cpu"
    validate_plan(cfg)
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype, cfg.plan.calibration)
    chosen, ranked, tried = best(cfg, cluster)
    apply_to_config(cfg, chosen.candidate)
    runner_up = next((e for e in ranked if e is not chosen), None)
    return {
        "chosen": chosen.candidate.short(),
        "overrides": chosen.candidate.overrides(),
        "why": f"fastest predicted of {len(ranked)} layouts that fit ({tried} valid) on "
        f"{cluster.nodes} × {cluster.gpus_per_node} {cluster.device}",
        "runner_up": None
        if runner_up is None
        else {"layout": runner_up.candidate.short(), "why_slower": why_slower(runner_up, chosen)},
        "prediction": chosen.as_json(),
    }
