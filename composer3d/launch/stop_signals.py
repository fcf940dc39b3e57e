"""Stopping a run early, at the same step on every rank, for the signals a scheduler sends before it
stops a job."""

from __future__ import annotations

import signal
from datetime import timedelta

import torch
import torch.distributed as dist


class StopSignals:
    """SIGTERM and SIGUSR1 — how SLURM announces a preemption or the time limit (to every task; the
    local launcher and torchrun forward SIGTERM to their workers) — and SIGUSR2, which submitit has
    SLURM send 90 s before the time limit (hydra/launcher=slurm), stop the run at a step boundary;
    so does SIGINT (Ctrl-C, which the local launcher passes on to its workers), whose second arrival
    stops at once, without saving. The handler only records the signal; ``agreed`` is asked at every
    boundary and answers alike on every rank.

    Ranks may receive the signal at different steps, so they agree with an all-reduce (MAX) of the
    signal number, on a gloo group of their own and a CPU tensor: no device sync. It is
    asynchronous — started at one boundary, read at the next — so the step's compute hides it, at
    the price of stopping one step later. Measured on 2 local gloo ranks (2 busy cores): a blocking
    all-reduce took ~560 µs a step, the asynchronous start plus wait ~80 µs; over many nodes a ring
    all-reduce takes longer, still hidden behind the step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)

    def __init__(self, timeout: timedelta):
        self.received = 0  # the largest signal number seen here (set by the handler)
        self.interrupted = False  # a SIGINT came
        self.group = (
            dist.new_group(backend="gloo", timeout=timeout) if dist.get_world_size() > 1 else None
        )
        self.pending = None  # (work, buffer) of the all-reduce started at the previous boundary
        self.previous = {sig: signal.signal(sig, self._record) for sig in self.SIGNALS}

    def _record(self, signum: int, frame) -> None:
        # Ctrl-C twice: the user will not wait for the save
        if signum == signal.SIGINT and self.interrupted:
            raise KeyboardInterrupt
        self.interrupted |= signum == signal.SIGINT
        self.received = max(self.received, signum)

    def agreed(self) -> int:
        """The signal all ranks stop for at this boundary (0: none): the largest any rank had by the
        previous one."""
        if self.group is None:
            return self.received
        verdict = 0
        if self.pending is not None:
            work, buffer = self.pending
            work.wait()
            verdict = int(buffer.item())
        buffer = torch.tensor([self.received], dtype=torch.int32)
        self.pending = (
            dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
            buffer,
        )
        return verdict

    def finish(self) -> None:
        """Wait for the last all-reduce (every rank started it), so none is in flight when the group
        goes."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
