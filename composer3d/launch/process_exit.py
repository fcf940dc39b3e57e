"""How a composer3d process ends once its command has returned: what the interpreter's own exit does
that anyone can observe, without its teardown.

After the last line of a program, Python's finalization frees every module and object one by one:
about a second of CPU in a process that imported torch (more with an accelerator's context), paid
by the command and by each of its workers at the end of every run and every restart, while the
launcher and the user wait. ``end_process`` keeps what that exit does for the outside world and
skips the rest, as multiprocessing's children end:

1. the threads that are not daemons are waited for (as the interpreter's exit waits);
2. the atexit handlers run (logging's flush and close, wandb's finish, coverage's save, the run
   directory's lock, the compile workers' shutdown);
3. stdout and stderr are flushed;
4. ``os._exit`` with the exit status ``sys.exit`` would have given.

Files the code opened are closed by it (``with``, the trainer's ``close``); an object that left data
in a buffer for the garbage collector to flush at exit would lose it here, and would be a bug there
too: finalization does not promise to collect everything either."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def end_process(code: object = 0) -> NoReturn:
    """End this process with ``code`` as ``SystemExit(code)`` would (None: 0; a string: printed to
    stderr, 1), its visible exit work done first (the module's docstring)."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # CPython's own exit runs them through this function (no public spelling of it)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a pipe its reader closed; a stream already closed
            pass
    os._exit(code or 0)


def ending_the_process(entry: Callable[[], None]) -> Callable[[], None]:
    """``entry`` as a process's entry point (a console script, ``python -m``): once it returns or
    exits, ``end_process``. An exception other than SystemExit propagates: the interpreter prints
    it and exits as usual. Only for a process's outermost call (never in a process that goes on:
    the tests call the commands in their own)."""

    def entry_point() -> NoReturn:
        try:
            entry()
        except SystemExit as exit_:
            end_process(exit_.code)
        end_process(0)

    entry_point.__doc__ = entry.__doc__
    return entry_point
