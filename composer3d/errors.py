"""The errors a run reports to its user, at the bottom of the import graph (every module may raise
them)."""

import signal


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and what would. Exit
    code 2.

    Most are the same on every rank (one config, one corpus): one line reports them (the local
    launcher's, or rank 0's under torchrun). ``rank_specific`` marks one only some ranks hit (this
    node's devices), which each of them reports under torchrun.
    """

    def __init__(self, message: str, rank_specific: bool = False):
        super().__init__(message)
        self.rank_specific = rank_specific


class TrainingDiverged(RuntimeError):
    """The loss or gradients became NaN/inf (or every update was dropped for too long). Exit
    code 3."""


class StoppedBySignal(Exception):
    """A signal stopped the run at a step boundary, after saving that step's checkpoint. SIGTERM,
    SIGUSR1 or SIGUSR2 (a preemption or time-limit notice): exit code 75 (sysexits' EX_TEMPFAIL:
    "try again later"), requeue the same command. SIGINT (Ctrl-C, a user's stop, not the
    scheduler's): 130, the shell's code for it, which no requeue rule takes for "run again"."""

    EXIT_CODE = 75
    INTERRUPT_EXIT_CODE = 128 + signal.SIGINT

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signum = signum

    @staticmethod
    def exit_code_for(signum: int) -> int:
        return (
            StoppedBySignal.INTERRUPT_EXIT_CODE
            if signum == signal.SIGINT
            else StoppedBySignal.EXIT_CODE
        )

    @property
    def exit_code(self) -> int:
        return self.exit_code_for(self.signum)


class Exit(SystemExit):
    """Ends the command with ``code`` once ``line`` (what went wrong, in one line) has been told. A
    sweep (``-m``) goes on to its next job instead, and repeats the line when it reports the failed
    job (``hydra_entry``)."""

    def __init__(self, code: int, line: str):
        super().__init__(code)
        self.line = line


def require_hf_extra(key: str, what: str) -> None:
    """``what`` (at config ``key``) runs on transformers, an optional dependency (the ``hf`` extra):
    without it, one line with the command that installs it rather than a ModuleNotFoundError from
    deep inside the run."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{key}: {what} needs transformers, which is not installed here. Install composer3d's "
            "hf extra: pip install 'composer3d[hf]'"
        ) from None


def require_eval_extra(key: str) -> None:
    """lm-evaluation-harness tasks (``eval.tasks``) run on lm-eval, an optional dependency (the
    ``eval`` extra)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{key}: lm-evaluation-harness tasks need lm-eval, which is not installed here. "
            "Install composer3d's eval extra: pip install 'composer3d[eval]'"
        ) from None
