"""Command-line entry points on Hydra, with the exit codes the README promises.

Hydra reports a bad override itself (unknown config group or key, a value of the wrong type) and exits 1 — the
same code as a crash inside the run. A configuration the user typed wrong exits 2 here, like every other
configuration error, so scripts can tell the two apart: Hydra's exit before the task started is the override's.
"""

from __future__ import annotations

import functools
from typing import Callable

import hydra
from omegaconf import DictConfig


def hydra_entry_point(task: Callable[[DictConfig], None], config_path: str, config_name: str) -> Callable[[], None]:
    """``task`` under ``hydra.main``, as a function of no arguments that exits 2 when Hydra refuses the overrides."""
    started = False

    @functools.wraps(task)
    def started_task(cfg: DictConfig) -> None:
        nonlocal started
        started = True
        task(cfg)

    hydra_main = hydra.main(config_path=config_path, config_name=config_name, version_base=None)(started_task)

    @functools.wraps(task)
    def entry_point() -> None:
        try:
            hydra_main()
        except SystemExit as exit_:
            if exit_.code == 1 and not started:
                raise SystemExit(2) from None
            raise

    return entry_point
