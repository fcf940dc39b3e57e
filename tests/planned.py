"""The planner's arithmetic in process, for the tests that check it: a training config composed from
overrides, and composer3d-plan's estimate of its layout (what ``composer3d-plan <overrides>``
prints, without the subprocess)."""

from __future__ import annotations

from hydra import compose, initialize_config_module

from composer3d.config.registration import register_configs
from composer3d.plan import Workload, candidate_from_config, estimate
from composer3d.plan.hardware import cluster_from_config


def plan_config(*overrides: str):
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        return compose("train", overrides=list(overrides))


def planned(*overrides: str):
    """(Estimate, Cluster) of the layout the overrides give."""
    cfg = plan_config(*overrides)
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
    return estimate(
        Workload.from_config(cfg), candidate_from_config(cfg, cluster.world_size), cluster
    ), cluster
