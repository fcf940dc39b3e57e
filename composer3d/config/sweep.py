"""A sweep (``-m``) its Hydra launcher cannot run as configured, refused before any job is
submitted: Hydra's own callbacks only warn when they raise, and a submitit job's task runs on
another machine, hours later."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from composer3d.errors import ConfigError


def check_sweep(cfg: DictConfig, multirun: bool) -> None:
    """Under ``-m`` with a submitit launcher (hydra/launcher=slurm, slurm_local, submitit_*): the
    config every job shares (``cfg``, composed with ``hydra``: the sweep's fixed overrides) may not
    ask for what only the local launcher does."""
    if not multirun:
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
