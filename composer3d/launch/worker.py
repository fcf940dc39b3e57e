"""``python -m composer3d.launch.worker <module> <args>``: a local worker's first lines, then what
``python -m <module> <args>`` runs.

Ctrl-C reaches the launcher (the workers have sessions of their own), which passes SIGINT on to
its workers. A worker still starting, importing torch in the first seconds, would answer with a
KeyboardInterrupt traceback of its own. The launcher starts it with SIGINT blocked; here, until the
command installs its own handler (the trainer's StopSignals, which saves first), SIGINT ends the
worker quietly with 128 + SIGINT, as it would have ended anyway: the launcher says the one line. A
SIGINT that came while it was blocked is delivered when it is unblocked, here."""

import runpy
import signal
import sys


def _quietly(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _quietly)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
