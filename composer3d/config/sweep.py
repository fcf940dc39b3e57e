"""A sweep (``-m``) its Hydra launcher cannot run as configured, refused before any job is
submitted: Hydra's own callbacks only warn when they raise, and a submitit job's task runs on
another machine, hours later."""

from __future__ import annotations

import sys

from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

from composer3d.errors import ConfigError


def check_sweep(config_path: str, config_name: str, overrides: list[str]) -> None:
    """Under ``-m`` with a submitit launcher (hydra/launcher=slurm, slurm_local, submitit_*): the
    config every job shares (the sweep's fixed overrides) may not ask for what only the local
    launcher does."""
    if not {"-m", "--multirun"} & set(sys.argv[1:]) and "hydra.mode=MULTIRUN" not in overrides:
        return
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        fixed = [
            text for text, override in zip(overrides, parsed) if not override.is_sweep_override()
        ]
        with initialize_config_module(
            config_module=config_path.removeprefix("pkg://"), version_base=None
        ):
            cfg = compose(config_name, overrides=fixed, return_hydra_config=True)
    except (
        HydraException,
        ValueError,
    ):  # an override Hydra itself refuses: it says so next, in its own words
        return
    if (
        "submitit" in (OmegaConf.select(cfg, "hydra.launcher._target_") or "")
        and cfg.launch.max_restarts
    ):
        raise ConfigError(
            f"launch.max_restarts: {cfg.launch.max_restarts} restarts asked for, but they are the "
            "local launcher's, and the ranks of a submitit job are its tasks: nothing would "
            "restart them. Use launch.max_restarts=0; under SLURM, "
            "hydra.launcher.max_num_timeout=N requeues a job preempted or out of time (it resumes "
            "from its last checkpoint)"
        )
