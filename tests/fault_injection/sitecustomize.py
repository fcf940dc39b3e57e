"""Fault injection for tests, kept out of the library: Python runs this module at start-up in every
process of a run whose PYTHONPATH starts with this directory (launcher and workers alike;
``harness.train(faults=...)``).

COMPOSER3D_TEST_KILL_DURING_SAVE=STEP:RANK — that rank SIGKILLs itself in the middle of that step's
checkpoint save (its data files written, the checkpoint's index not yet), as a node failure would.

COMPOSER3D_TEST_DISK_FREE_BYTES=N — the checkpoint directory's file system reports N bytes free (a
full disk).

COMPOSER3D_TEST_DISK_FULL_AT_STEP=STEP — every rank's write of that step's checkpoint fails with
ENOSPC once its data files are written (the disk filled up mid-save; DCP gathers the failures and
raises on every rank).

COMPOSER3D_TEST_SLOW_RANK=RANK:STEP:SECONDS — that rank sleeps that long before each step from that
step on (a slow or stalled rank; or simply slow steps, since the other ranks wait for it in the
step's collectives).

COMPOSER3D_TEST_KILL_AT_STEP=STEP:RANK — that rank SIGKILLs itself as that step begins, on the first
attempt only (TORCHELASTIC_RESTART_COUNT, set by the elastic agent, is 0 there): a restarted group
then runs through.

COMPOSER3D_TEST_DIVERGE_AT_STEP=STEP:RANK — that rank raises TrainingDiverged as that step begins,
as if it alone had seen a non-finite loss: its peers wait in that step's collectives until the
launcher stops them.

COMPOSER3D_TEST_STAGER_CLOSES_AFTER_STAGE=1 — DCP's DefaultStager closes its copier at the end of
every stage, as torch 2.11 and 2.12 do (pytorch/pytorch#183413): a stager reused for a second async
save then fails.

COMPOSER3D_TEST_EFFECTS=DIR — each rank of a ``composer3d.commands.train`` run writes what the
precision and memory switches did to its model and optimizer to DIR/rank{R}.json
(``effects_probe``).
"""

import os
import signal
import sys

_KILL_DURING_SAVE = os.environ.get("COMPOSER3D_TEST_KILL_DURING_SAVE")
_SLOW_RANK = os.environ.get("COMPOSER3D_TEST_SLOW_RANK")
_KILL_AT_STEP = os.environ.get("COMPOSER3D_TEST_KILL_AT_STEP")
_DIVERGE_AT_STEP = os.environ.get("COMPOSER3D_TEST_DIVERGE_AT_STEP")

if _KILL_DURING_SAVE:
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

if os.environ.get("COMPOSER3D_TEST_DISK_FREE_BYTES"):
    from composer3d.checkpoint import space

    space.free_bytes = lambda directory: int(os.environ["COMPOSER3D_TEST_DISK_FREE_BYTES"])

if os.environ.get("COMPOSER3D_TEST_DISK_FULL_AT_STEP"):
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from composer3d.checkpoint import Checkpointer

    _full_at = int(os.environ["COMPOSER3D_TEST_DISK_FULL_AT_STEP"])
    _writer_with_room = Checkpointer._storage_writer

    class _DiskFills(FileSystemWriter):
        def write_data(self, plan, planner):
            super().write_data(plan, planner).wait()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def _storage_writer_filling(self, path, step):
        return _DiskFills(path) if step == _full_at else _writer_with_room(self, path, step)

    Checkpointer._storage_writer = _storage_writer_filling

if _SLOW_RANK:
    import time

    from composer3d.training.trainer import Trainer

    _slow_rank, _slow_from = (int(x) for x in _SLOW_RANK.split(":")[:2])
    _slow_seconds = float(_SLOW_RANK.split(":")[2])
    _step_normally = Trainer.train_step

    def _slow_train_step(self):
        if int(os.environ.get("RANK", "0")) == _slow_rank and self.step + 1 >= _slow_from:
            time.sleep(_slow_seconds)
        return _step_normally(self)

    Trainer.train_step = _slow_train_step

if _KILL_AT_STEP and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    from composer3d.training.trainer import Trainer

    _step_at, _rank_at = (int(x) for x in _KILL_AT_STEP.split(":"))
    _train_step = Trainer.train_step

    def _train_step_or_die(self):
        if (self.step + 1, int(os.environ.get("RANK", "0"))) == (_step_at, _rank_at):
            os.kill(os.getpid(), signal.SIGKILL)
        return _train_step(self)

    Trainer.train_step = _train_step_or_die

if _DIVERGE_AT_STEP:
    from composer3d.errors import TrainingDiverged
    from composer3d.training.trainer import Trainer

    _diverge_step, _diverge_rank = (int(x) for x in _DIVERGE_AT_STEP.split(":"))
    _step_or_diverge = Trainer.train_step

    def _train_step_or_diverge(self):
        if (self.step + 1, int(os.environ.get("RANK", "0"))) == (_diverge_step, _diverge_rank):
            raise TrainingDiverged(f"step {self.step + 1}: injected on rank {_diverge_rank} alone")
        return _step_or_diverge(self)

    Trainer.train_step = _train_step_or_diverge

if os.environ.get("COMPOSER3D_TEST_STAGER_CLOSES_AFTER_STAGE"):
    from torch.distributed.checkpoint.staging import DefaultStager

    _stage_and_keep = DefaultStager._stage

    def _stage_then_close(self, state_dict, **kwargs):
        staged = _stage_and_keep(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    DefaultStager._stage = _stage_then_close

if os.environ.get("COMPOSER3D_TEST_EFFECTS") and sys.orig_argv[1:3] == [
    "-m",
    "composer3d.commands.train",
]:
    import effects_probe  # noqa: F401  (not in inductor's compile workers, which share the environment)
