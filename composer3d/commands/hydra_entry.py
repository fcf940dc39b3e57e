"""Command-line entry points on Hydra, with the exit codes of docs/troubleshooting.md, and the one
skeleton a command's processes follow (``run_command``).

Hydra reports a bad override itself (unknown config group or key, a value of the wrong type) and
exits 1 — the same code as a crash inside the run. A configuration the user typed wrong exits 2
here, like every other configuration error, so scripts can tell the two apart: Hydra's exit for its
own error (HydraException) before the task started is the override's. (A submitit job's task runs
elsewhere: its failures are not Hydra's.) A mistyped key is caught before Hydra composes, with the
nearest real key: Hydra's own hint would be to add it with ``+``. Each command's ``--help`` opens
with its own banner and ends with its own examples.

A sweep (``-m``) runs each job through Hydra's launcher (one after another in this process, or as
submitit jobs). A job that fails does not end the sweep: it is reported when the sweep ends, which
exits with the first failed job's code. A stop signal or Ctrl-C (exit 75, or 128 + the signal) ends
a sweep run by this process at once.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from composer3d.config.help import set_command
from composer3d.config.keys import check_override_keys
from composer3d.config.sweep import check_sweep
from composer3d.errors import ConfigError, StoppedBySignal
from composer3d.launch import distributed, launcher
from composer3d.launch.distributed import in_submitit_job


class SweepJobFailed(CompactHydraException):
    """A sweep's job exited with ``code``; Hydra records it as the job's failure and goes on with
    the sweep."""

    def __init__(self, code: int, line: str | None):
        # both in args: a submitit job sends the exception back pickled
        super().__init__(code, line)
        self.code, self.line = code, line

    def __str__(self) -> str:
        return f"{self.line or 'composer3d: the job failed'} (exit code {self.code})"


def hydra_entry_point(
    task: Callable[[DictConfig], None],
    command: str,
    about: str,
    examples: list[str],
    config_path: str,
    config_name: str,
) -> Callable[[], None]:
    """``task`` under ``hydra.main``, as a function of no arguments that exits 2 when Hydra refuses
    the overrides; ``command`` (its name), ``about`` (what it does, one line) and ``examples``
    (command lines) make its --help."""
    started = False

    @functools.wraps(task)
    def started_task(cfg: DictConfig) -> None:
        nonlocal started
        started = True
        try:
            task(cfg)
        except SystemExit as exit_:
            if (
                not exit_.code
                or HydraConfig.get().mode != RunMode.MULTIRUN
                or _ends_a_sweep(exit_.code)
            ):
                raise
            raise SweepJobFailed(exit_.code, getattr(exit_, "line", None)) from None

    hydra_main = hydra.main(config_path=config_path, config_name=config_name, version_base=None)(
        started_task
    )

    @functools.wraps(task)
    def entry_point() -> None:
        set_command(command, about, examples)
        try:
            overrides = _typed_overrides()
            check_override_keys(overrides)
            check_sweep(config_path, config_name, overrides)
        except ConfigError as error:
            print(f"{command}: invalid configuration: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            hydra_main()
        except SystemExit as exit_:
            # Hydra has printed the exception (the first failed job's line) and exits 1 from its
            # handler of it.
            if isinstance(exit_.__context__, SweepJobFailed):
                raise SystemExit(exit_.__context__.code) from None
            if exit_.code == 1 and not started and isinstance(exit_.__context__, HydraException):
                raise SystemExit(2) from None
            raise

    return entry_point


def _typed_overrides() -> list[str]:
    """The overrides on the command line, as Hydra's own argument parser reads them."""
    if "--version" in sys.argv[1:]:  # Hydra prints its version and exits; nothing to check
        return []
    return get_args_parser().parse_known_args()[0].overrides


def _ends_a_sweep(code) -> bool:
    """This process was told to stop (a scheduler's SIGTERM, Ctrl-C): not the job's own failure. A
    submitit job's task is one job of the sweep, whose code the sweep's command then exits with (75:
    requeue it)."""
    stopped = code == StoppedBySignal.EXIT_CODE or (isinstance(code, int) and code >= 128)
    return stopped and not in_submitit_job()


def job_overrides() -> list[str]:
    """This job's overrides as typed, hydra.* too (e.g. hydra.searchpath for the user's own
    recipes), for the local workers it starts: each of them runs this one job, so not a sweep's
    ``hydra.mode=MULTIRUN``."""
    overrides = HydraConfig.get().overrides
    return list(overrides.task) + [o for o in overrides.hydra if not o.startswith("hydra.mode=")]


def run_command(
    command: str,
    module: str,
    cfg: DictConfig,
    run: Callable[[DictConfig, distributed.Env | None], object],
    *,
    settle: Callable[[DictConfig], None] = lambda cfg: None,
    check: Callable[[DictConfig], None] = lambda cfg: None,
) -> None:
    """The skeleton of a command that may run on several processes (composer3d-eval, -generate):
    every process ``settle``s the config alike (what a checkpoint records, the model's sizes); the
    command, before any worker starts, ``check``s what can fail in seconds; then it starts
    ``launch.nproc_per_node`` local workers running ``module``, or (one process, or a worker, or a
    rank of torchrun/SLURM) ``run``s. A bad config ends in one line and exit 2, a signal in 128 +
    it (``launcher.exits_as_a_command``). composer3d-train adds restarts, the run directory and
    its own exit codes around the same steps."""
    env = distributed.job_env()
    if launcher.started_by_local_launcher():
        launcher.die_with_launcher()
    with launcher.exits_as_a_command(command, env):
        settle(cfg)
        if env is None:  # before any worker starts
            check(cfg)
        if env is None and cfg.launch.nproc_per_node > 1:
            launcher.spawn_local_workers(cfg.launch.nproc_per_node, module, job_overrides())
            return
        run(cfg, env)
