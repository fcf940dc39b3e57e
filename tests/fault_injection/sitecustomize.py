"""Fault injection for tests, kept out of the library: Python runs this module at start-up in every process of a
run whose PYTHONPATH starts with this directory (launcher and workers alike; ``harness.train(faults=...)``).

COMPOSER3D_TEST_KILL_DURING_SAVE=STEP:RANK — that rank SIGKILLs itself in the middle of that step's checkpoint
save (its data files written, the checkpoint's index not yet), as a node failure would.

COMPOSER3D_TEST_EFFECTS=DIR — each rank of a ``composer3d.train`` run writes what the precision and memory switches
did to its model and optimizer to DIR/rank{R}.json (``effects_probe``).
"""

import os
import sys

_KILL_DURING_SAVE = os.environ.get("COMPOSER3D_TEST_KILL_DURING_SAVE")

if _KILL_DURING_SAVE:
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    from composer3d.checkpoint import Checkpointer

    _kill_step, _kill_rank = (int(x) for x in _KILL_DURING_SAVE.split(":"))
    _write_normally = Checkpointer._storage_writer

    class _KilledMidWrite(FileSystemWriter):
        def write_data(self, plan, planner):
            super().write_data(plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

    def _storage_writer(self, path, step):
        if (step, self.rank) == (_kill_step, _kill_rank):
            return _KilledMidWrite(path)
        return _write_normally(self, path, step)

    Checkpointer._storage_writer = _storage_writer

if os.environ.get("COMPOSER3D_TEST_EFFECTS") and sys.orig_argv[1:3] == ["-m", "composer3d.train"]:
    import effects_probe  # noqa: F401  (not in inductor's compile workers, which share the environment)
