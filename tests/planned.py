"""The planner's arithmetic in process, for the tests that check it: a training config composed from
overrides, and composer3d-plan's estimate of its layout (what ``composer3d-plan <overrides>``
prints, without the subprocess)."""

from __future__ import annotations

from harness import train_config as plan_config

from composer3d.plan import Workload, candidate_from_config, estimate
from composer3d.plan.hardware import cluster_from_config


def planned(*overrides: str):
    """(Estimate, Cluster) of the layout the overrides give."""
    cfg = plan_config(*overrides)
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
    return estimate(
        Workload.from_config(cfg), candidate_from_config(cfg, cluster.world_size), cluster
    ), cluster
