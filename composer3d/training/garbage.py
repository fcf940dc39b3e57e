"""Python's garbage collector moved to step boundaries.

CPython collects whenever enough container objects were allocated since the last collection: in the
middle of a forward, on one rank and not on the others. A full collection in a process that imported
torch (and often transformers) takes 0.1–0.2 s, and every rank waiting on that one at its next
collective or pipeline receive waits as long. While training, the automatic collector is off; it
collects on every rank alike at every ``every``-th step boundary, after freezing what existed when
training started (modules, the model, the optimizer) so that those collections only scan what
training created since. A process that froze its heap itself (a server that forks workers, as the
gc module's documentation advises) keeps it frozen: that freeze is its, and undoing it would make
every later full collection of each forked worker walk, and copy, the server's whole heap.
"""

from __future__ import annotations

import gc
from typing import Self


class StepGarbageCollection:
    """Context manager: inside, automatic collection is off and ``after_step(step)`` collects every
    ``every`` steps (``every`` = 0 leaves Python's collector as it is); on exit the collector is as
    it was before."""

    def __init__(self, every: int):
        self.every = every

    def __enter__(self) -> Self:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
            self._freezes = not gc.get_freeze_count()
            if self._freezes:
                gc.freeze()
        return self

    def after_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.every:
            if self._freezes:
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()
