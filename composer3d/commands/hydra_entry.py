"""The Hydra glue every command shares: a ``Command`` (its name, what it does, its examples, the
config sections it reads, its module) becomes a console script with the exit codes of
docs/troubleshooting.md.

This module and the commands' table (``cli``) import Hydra and the schema, not torch: ``--help``
and a refused override answer in about a second. The command's own module, and torch with it, is
imported when the composed config reaches its ``task``.

Every override is composed once before Hydra runs (``config.overrides``): what Hydra would refuse
(a value of the wrong type, an option the group lacks, an override it cannot parse, a launcher
whose plugin is not installed) is one line naming the key, exit 2, like every other configuration
error, so scripts can tell it from a crash inside the run (exit 1). A mistyped key is caught before
that, with the nearest real key: Hydra's own hint would be to add it with ``+``.

A sweep (``-m``) runs each job through Hydra's launcher (one after another in this process, or as
submitit jobs). A job that fails does not end the sweep: it is reported when the sweep ends, which
exits with the first failed job's code. A stop signal or Ctrl-C (exit 75, or 128 + the signal) ends
a sweep run by this process at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.types import RunMode

from composer3d.config.help import help_text, set_command
from composer3d.config.keys import check_override_keys
from composer3d.config.overrides import compose_overrides
from composer3d.config.registration import register_configs
from composer3d.config.sweep import check_sweep
from composer3d.errors import ConfigError, StoppedBySignal

CONFIG_MODULE, CONFIG_NAME = "composer3d.conf", "train"


@dataclass(frozen=True)
class Command:
    """A console script: ``name`` does ``about`` (one line); ``examples`` (command lines) end its
    --help, which lists the keys of ``sections``, the config sections its run reads. Its work is
    ``module``'s ``task(cfg)``; ``python -m module`` runs the command too (the local workers)."""

    name: str
    module: str
    about: str
    examples: tuple[str, ...]
    sections: tuple[str, ...]


class SweepJobFailed(CompactHydraException):
    """A sweep's job exited with ``code``; Hydra records it as the job's failure and goes on with
    the sweep."""

    def __init__(self, code: int, line: str | None):
        # both in args: a submitit job sends the exception back pickled
        super().__init__(code, line)
        self.code, self.line = code, line

    def __str__(self) -> str:
        return f"{self.line or 'composer3d: the job failed'} (exit code {self.code})"


def hydra_entry_point(command: Command) -> Callable[[], None]:
    """``command`` under ``hydra.main``, as a function of no arguments (a console script)."""
    started = False

    def started_task(cfg) -> None:
        nonlocal started
        started = True
        task = importlib.import_module(command.module).task
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

    # pkg://, not "conf": the configs are the top-level conf/ mapped into the package
    # (pyproject.toml), and under `python -m` Hydra would look for a relative config_path next to
    # the module, where an editable install has none.
    hydra_main = hydra.main(
        config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base=None
    )(started_task)

    def entry_point() -> None:
        set_command(command.name, command.about, command.examples, command.sections)
        args = _arguments()
        try:
            check_override_keys(args.overrides)
            multirun = _multirun(args.overrides)
            composed = compose_overrides(CONFIG_MODULE, CONFIG_NAME, args.overrides, multirun)
            check_sweep(composed, multirun)
        except ConfigError as error:
            print(f"{command.name}: invalid configuration: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        if args.help:  # Hydra's own lists every group of its own too: seconds
            _print_help(help_text(composed))
            return
        try:
            hydra_main()
        except SystemExit as exit_:
            # Hydra has printed the exception (the first failed job's line) and exits 1 from its
            # handler of it.
            if isinstance(exit_.__context__, SweepJobFailed):
                raise SystemExit(exit_.__context__.code) from None
            # a refusal of Hydra's that composing first did not meet is still the override's
            if exit_.code == 1 and not started and isinstance(exit_.__context__, HydraException):
                raise SystemExit(2) from None
            raise

    return entry_point


def _print_help(text: str) -> None:
    """--help into a pipe whose reader stops early (``| head``, a pager quit): not a BrokenPipeError
    traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # what is left in stdout's buffer would fail again when Python flushes it at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _multirun(overrides: list[str]) -> bool:
    return bool({"-m", "--multirun"} & set(sys.argv[1:])) or "hydra.mode=MULTIRUN" in overrides


def _arguments() -> argparse.Namespace:
    """The command line as Hydra's own argument parser reads it (``overrides``, ``help``)."""
    if "--version" in sys.argv[1:]:  # Hydra prints its version and exits; nothing to check
        return argparse.Namespace(overrides=[], help=False)
    return get_args_parser().parse_known_args()[0]


def _ends_a_sweep(code) -> bool:
    """This process was told to stop (a scheduler's SIGTERM, Ctrl-C): not the job's own failure. A
    submitit job's task is one job of the sweep, whose code the sweep's command then exits with (75:
    requeue it)."""
    # here, not at the top: --help must not import torch
    from composer3d.launch.distributed import in_submitit_job

    stopped = code == StoppedBySignal.EXIT_CODE or (isinstance(code, int) and code >= 128)
    return stopped and not in_submitit_job()


register_configs()  # before Hydra composes: here, or in a submitit job that unpickles the task
