"""How a command's processes start: the workers it spawns run the same job (``job_overrides``), and
``run_command`` is the skeleton composer3d-eval and -generate follow on one or several processes."""

from __future__ import annotations

from typing import Callable

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from composer3d.commands.hydra_entry import Command
from composer3d.launch import distributed, launcher


def job_overrides() -> list[str]:
    """This job's overrides as typed, hydra.* too (e.g. hydra.searchpath for the user's own
    recipes), for the local workers it starts: each of them runs this one job, so not a sweep's
    ``hydra.mode=MULTIRUN``."""
    overrides = HydraConfig.get().overrides
    return list(overrides.task) + [o for o in overrides.hydra if not o.startswith("hydra.mode=")]


def run_command(
    command: Command,
    cfg: DictConfig,
    run: Callable[[DictConfig, distributed.Env | None], object],
    *,
    settle: Callable[[DictConfig], None] = lambda cfg: None,
    check: Callable[[DictConfig], None] = lambda cfg: None,
) -> None:
    """The skeleton of a command that may run on several processes (composer3d-eval, -generate):
    every process ``settle``s the config alike (what a checkpoint records, the model's sizes); the
    command, before any worker starts, ``check``s what can fail in seconds; then it starts
    ``launch.nproc_per_node`` local workers running the command's module, or (one process, or a
    worker, or a rank of torchrun/SLURM) ``run``s. A bad config ends in one line and exit 2, a
    signal in 128 + it (``launcher.exits_as_a_command``). composer3d-train adds restarts, the run
    directory and its own exit codes around the same steps."""
    env = distributed.job_env()
    if launcher.started_by_local_launcher():
        launcher.die_with_launcher()
    with launcher.exits_as_a_command(command.name, env):
        settle(cfg)
        if env is None:  # before any worker starts
            check(cfg)
        if env is None and cfg.launch.nproc_per_node > 1:
            launcher.spawn_local_workers(cfg.launch.nproc_per_node, command.module, job_overrides())
            return
        run(cfg, env)
