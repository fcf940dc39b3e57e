"""What the run writes and how it is started: checkpoints, the launcher (workers, timeout, restarts)
and logging."""

from __future__ import annotations

from typing import Any

from composer3d.config.checks.common import DTYPE_NAMES, _require

ASYNC_MODES = ("none", "async", "async_pinned")


def _check_checkpoint(c: Any) -> None:
    _require(
        c.interval >= 0,
        "checkpoint.interval",
        f"must be >= 0, got {c.interval}",
        "Use 0 to save only at the end",
    )
    _require(
        c.keep_last >= 0,
        "checkpoint.keep_last",
        f"must be >= 0, got {c.keep_last}",
        "Use 0 to keep all",
    )
    _require(
        c.async_mode in ASYNC_MODES,
        "checkpoint.async_mode",
        f"unknown mode {c.async_mode!r}",
        f"Choose one of {ASYNC_MODES}",
    )
    _require(
        c.export_dtype in DTYPE_NAMES,
        "checkpoint.export_dtype",
        f"unknown dtype {c.export_dtype!r}",
        f"Choose one of {DTYPE_NAMES}",
    )


def _check_launch_and_logging(launch: Any, logging: Any, checkpoint: Any) -> None:
    _require(
        launch.nproc_per_node >= 1,
        "launch.nproc_per_node",
        f"must be >= 1, got {launch.nproc_per_node}",
        "Use 1 or more",
    )
    _require(
        launch.timeout_minutes > 0,
        "launch.timeout_minutes",
        f"must be > 0, got {launch.timeout_minutes}",
        "Use e.g. 30 (minutes; fractions allowed)",
    )
    _require(
        launch.max_restarts >= 0,
        "launch.max_restarts",
        f"must be >= 0, got {launch.max_restarts}",
        "Use 0 for no restarts",
    )
    # A restarted group continues from the newest checkpoint in its checkpoint.dir: without one (or
    # with a fixed resume point) it would start over and train the same steps again.
    _require(
        launch.max_restarts == 0 or (checkpoint.enabled and checkpoint.resume == "auto"),
        "launch.max_restarts",
        f"restarts resume from the last checkpoint, but checkpoint.enabled={checkpoint.enabled} "
        f"and checkpoint.resume={checkpoint.resume}",
        "Use checkpoint.enabled=true checkpoint.resume=auto (the defaults) with a "
        "checkpoint.interval, or launch.max_restarts=0",
    )
    _require(
        logging.peak_tflops is None or logging.peak_tflops > 0,
        "logging.peak_tflops",
        f"must be > 0, got {logging.peak_tflops}",
        "Use null for the table's value",
    )
    _require(
        logging.log_every >= 1,
        "logging.log_every",
        f"must be >= 1, got {logging.log_every}",
        "Use 1+",
    )
