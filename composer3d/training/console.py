"""What a run prints: rich (colours, wrapping, the progress bar) on a terminal; off one (SLURM logs,
``| tee``, a file), plain records, one line each, which rich would otherwise wrap at 80 columns and
cut short."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("composer3d")

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(message)s"


def human_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB")
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{int(n)} B" if power == 0 else f"{n:.3g} {units[power]}"


def resume_hint(run_name: str | None, run_dir, sweep: tuple[list[str], str] | None = None) -> str:
    """How this run resumes: an unnamed run's command makes a new timestamped directory each time it
    runs. ``sweep``: this job's overrides and the sweep's directory, for a job of a sweep (-m): the
    sweep's command with the job's run.dir would make that the sweep's directory and nest a new job
    inside it."""
    if sweep is not None:
        overrides, sweep_dir = sweep
        own = " ".join(
            [o for o in overrides if not o.startswith("run.dir=")] + [f"run.dir={run_dir}"]
        )
        # no closing parenthesis: the layout line puts the hint in parentheses
        return (
            f"to resume this job, run the command without -m, with: {own}; the same sweep with "
            f"run.dir={sweep_dir} resumes every job"
        )
    if run_name is not None:
        return f"the same command resumes it (run.name={run_name})"
    return f"to resume it, run the same command with run.dir={run_dir}"


def is_terminal(stream=None) -> bool:
    stream = sys.stdout if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


# rank 0's rich console on a terminal: the log records and the progress bar draw through it
_terminal = None


def terminal_console():
    """The console the progress bar draws on: the log's own, so that a record printed while the bar
    is live goes above it (two consoles on one terminal overwrite each other's lines: the bar
    garbled inside tmux/screen)."""
    if _terminal is None:
        from rich.console import Console

        return Console()
    return _terminal


def setup_logging(rank: int, stream=None) -> None:
    """Rank 0 logs progress; the other ranks only warnings, so a run prints one story. ``stream``:
    where rank 0's console goes (stdout by default; stderr when stdout carries a result, as
    composer3d-eval's JSON line)."""
    stream = sys.stdout if stream is None else stream
    if rank == 0 and is_terminal(stream):
        from rich.console import Console
        from rich.logging import RichHandler

        global _terminal
        _terminal = Console(file=stream)
        handler = RichHandler(show_path=False, markup=False, console=_terminal)
    else:
        handler = logging.StreamHandler(stream if rank == 0 else sys.stderr)
        handler.setFormatter(
            logging.Formatter(
                PLAIN_FORMAT if rank == 0 else f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"
            )
        )
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def log_to_run_dir(rank: int, run_dir) -> None:
    """Every rank keeps its full log in <run.dir>/logs/rank<N>.log: the place to look when one rank
    misbehaves."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    log.addHandler(handler)
