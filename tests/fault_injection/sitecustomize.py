"""Fault injection for tests, kept out of the library: Python runs this module at start-up in every process of a
run whose PYTHONPATH starts with this directory (launcher and workers alike; ``harness.train(faults=...)``).

COMPOSER3D_TEST_KILL_DURING_SAVE=STEP:RANK — that rank SIGKILLs itself in the middle of that step's checkpoint
save (its data files written, the checkpoint's index not yet), as a node failure would.
"""

import os

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
