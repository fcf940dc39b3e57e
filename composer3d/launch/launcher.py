"""The local launcher: a plain command starts ``launch.nproc_per_node`` workers under torch's
elastic agent (the agent torchrun runs), and owes its user what torchrun's users get from torchrun
and the scheduler:

- restarts (``launch.max_restarts``): elastic's own restart loop stops the whole group and starts it
  again, and the workers resume from the last checkpoint; a bad config (exit 2) or divergence
  (exit 3) is not retried;
- one line naming the rank that failed first, measured to the millisecond, after that rank's own
  message;
- Ctrl-C: passed on to the workers, which save at the next step boundary as for SIGTERM; the CLI
  prints one line and exits 130;
- workers that die with their launcher, even when it is SIGKILLed (Linux);
- one job per run directory (a lock the kernel releases when its holder dies).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import inspect
import json
import logging
import math
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.launcher.api import LaunchConfig

from composer3d.checkpoint import CheckpointNotSaved
from composer3d.errors import ConfigError, Exit, StoppedBySignal

LAUNCHER_PID = "COMPOSER3D_LAUNCHER_PID"  # in the environment of the workers this launcher starts
# the launcher's resume hint, which its workers repeat (they run no sweep)
RESUME_HINT = "COMPOSER3D_RESUME_HINT"
# exit codes a restart would only repeat (or, for a stop signal, must not undo: the scheduler is
# ending the job)
STOPPED = {
    StoppedBySignal.EXIT_CODE: "a stop signal",
    StoppedBySignal.INTERRUPT_EXIT_CODE: "Ctrl-C (SIGINT)",
}
NOT_RETRIED = {
    2: "a bad config",
    3: "divergence",
    CheckpointNotSaved.EXIT_CODE: "a checkpoint with no room",
    **STOPPED,
}
# The agent forwards these to the workers; SIGUSR1 (SLURM's --signal time-limit notice) is not among
# its defaults, and unhandled it would kill the launcher and orphan workers that then save and stop
# unseen.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
LOCK_FILE = ".composer3d.lock"
# seconds the survivors of a failed worker get to exit on SIGTERM before SIGKILL (enough to flush
# their logs)
FAILED_GROUP_GRACE_S = 5
# torch >= 2.13's agent takes the grace period its shutdown gives the workers; torch 2.11/2.12's
# always give 30 s (there, the survivors of a failed rank are stopped after 30 s, not
# FAILED_GROUP_GRACE_S).
_SHUTDOWN_TAKES_GRACE = (
    "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters
)
_REPORTED = "composer3d"  # marks an error file written by report_to_launcher
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# how often a worker without the parent-death signal checks that its launcher lives
ORPHAN_POLL_S = 0.5
_held: list[IO] = []  # run-directory locks of this process

log = logging.getLogger("composer3d.launcher")


class Interrupted(Exception):
    """The launcher got a signal (Ctrl-C: SIGINT) and stopped its workers; exit code 128 + the
    signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def started_by_local_launcher() -> bool:
    return LAUNCHER_PID in os.environ


def report_to_launcher(line: str) -> bool:
    """Leave the line this worker would print for the local launcher, which prints the first failed
    rank's. (A rank that fails stops the others at once, so the rank 0 meant to tell may be gone
    before it could.) False where no local launcher started this worker: then the worker prints
    it."""
    # one per worker and attempt, set by the elastic agent
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not started_by_local_launcher() or not error_file:
        return False
    # elastic's error-file format, a plain message; read back as ProcessFailure
    with open(error_file, "w") as f:
        json.dump({"message": line, "timestamp": int(time.time()), _REPORTED: True}, f)
    return True


def spawn_local_workers(
    nproc: int,
    module: str,
    args: list[str],
    max_restarts: int = 0,
    log_dir: Path | None = None,
    resume_hint: str | None = None,
) -> None:
    """Run ``python -m module args`` in ``nproc`` local workers (``launch/worker.py`` first).
    Returns when all succeed; a failure past the restarts exits with the first failure's own code
    (2 config, 3 divergence; a signal or crash: 1); a signal to the launcher raises Interrupted
    once the workers are stopped. ``log_dir``: where the agent's own log goes; ``resume_hint``: how
    the run resumes, said when the workers stopped for a stop signal."""
    _log_to_console_and(log_dir)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = FORWARDED_SIGNALS
    if max_restarts:
        # The agent's shared TCPStore outlives a restart with the old attempt's keys in it: the new
        # workers' gloo read the dead workers' addresses and fail to connect
        # (pytorch/pytorch#135712, still so in torch 2.13). Without sharing, each attempt's rank 0
        # hosts a fresh store on a fresh port.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, like torchrun --standalone
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    agent = _agent(config, ("-m", "composer3d.launch.worker", module, *args))
    # The workers inherit the launcher's environment; set for them only (a sweep's next job runs in
    # this process).
    os.environ[LAUNCHER_PID] = str(os.getpid())
    os.environ[RESUME_HINT] = resume_hint or ""
    log.debug(
        "starting %d workers (max_restarts %d): %s -m %s %s",
        nproc,
        max_restarts,
        sys.executable,
        module,
        " ".join(args),
    )
    try:
        result = agent.run()
    except SignalException as error:
        raise Interrupted(error.sigval) from None
    finally:
        agent.get_worker_group().spec.rdzv_handler.shutdown()
        del os.environ[LAUNCHER_PID], os.environ[RESUME_HINT]
    if not result.is_failed():
        log.debug("all %d workers finished (exit code 0)", nproc)
        return
    rank, failure = agent.first_failure(result)
    if all(f.exitcode in STOPPED for f in result.failures.values()):
        log.info(
            "composer3d: the workers stopped for %s after saving%s; exit code %d",
            STOPPED[failure.exitcode],
            f"; {resume_hint}" if resume_hint else "",
            failure.exitcode,
        )
        sys.exit(failure.exitcode)
    code = failure.exitcode if 0 < failure.exitcode < 128 else 1
    reported = failure.error_file_data.get(_REPORTED)
    if reported:
        print(failure.message, file=sys.stderr)
    line = (
        f"composer3d: rank {rank} failed first "
        f"({_describe(failure)}){_not_retried(failure, max_restarts)}"
    )
    log.error("%s; exit code %d", line, code)
    raise Exit(code, failure.message if reported else line)


@contextlib.contextmanager
def exits_as_a_command(command: str, env):
    """How a one-shot entry point (composer3d-eval, composer3d-generate) ends on a bad config or a
    stop: one line and exit 2, or 128 + the signal; ``env`` is the rank's distributed.Env (None: the
    command before any worker)."""
    try:
        yield
    # the same on every rank: one line tells (the local launcher's, or rank 0's)
    except ConfigError as error:
        line = f"{command}: invalid configuration: {error}"
        if not report_to_launcher(line) and (env is None or env.rank == 0 or error.rank_specific):
            print(line, file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, Interrupted) as error:  # one line, not a traceback per process
        signum = getattr(error, "signum", signal.SIGINT)
        # a worker's launcher tells
        if env is None or (env.rank == 0 and not started_by_local_launcher()):
            print(f"{command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        sys.exit(128 + signum)


def _agent(config: LaunchConfig, args: tuple) -> _Agent:
    """What torch.distributed.launcher.api.launch_agent builds from a LaunchConfig, with our agent
    class."""
    rendezvous = rendezvous_registry.get_rendezvous_handler(
        RendezvousParameters(
            backend=config.rdzv_backend,
            endpoint=config.rdzv_endpoint,
            run_id=config.run_id,
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            local_addr=config.local_addr,
            **config.rdzv_configs,
        )
    )
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=sys.executable,
        args=args,
        rdzv_handler=rendezvous,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        numa_options=config.numa_options,
    )
    grace = {"shutdown_timeout": config.shutdown_timeout} if _SHUTDOWN_TAKES_GRACE else {}
    return _Agent(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method, **grace
    )


class _Agent(LocalElasticAgent):
    """torch's local agent and its restart loop, plus: exit times per worker, no restart for a
    failure that would only repeat, a line per restart, and a short grace for the survivors of a
    failed worker."""

    exits: _ExitClock | None = None
    _peer_failed = False  # a worker failed: the group is stopped next

    def _start_workers(self, worker_group):
        # The workers start with SIGINT blocked (a blocked set passes through fork and exec), so a
        # Ctrl-C the launcher passes on while one still starts its interpreter waits until
        # launch/worker.py can end it quietly; the launcher's own, meanwhile, waits a moment.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            pids = super()._start_workers(worker_group)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self.exits = _ExitClock(pids.values())
        return pids

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            rank, failure = self.first_failure(result)
            self._peer_failed = failure.exitcode not in STOPPED  # stopped workers are saving
            if failure.exitcode in NOT_RETRIED:
                # as elastic itself does for a worker it cannot recover
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:
                spec = worker_group.spec
                log.warning(
                    "composer3d: rank %d failed first (%s); restarting all workers from the last "
                    "checkpoint (restart %d of %d)",
                    rank,
                    _describe(failure),
                    spec.max_restarts - self._remaining_restarts + 1,
                    spec.max_restarts,
                )
        return result

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # The signal the launcher got goes on to the workers (Ctrl-C reaches only the launcher:
        # workers run in their own sessions). They stop for SIGTERM, SIGUSR1 and SIGINT at the next
        # step boundary, after saving.
        if self._peer_failed:
            # The survivors of a failed rank cannot save (a checkpoint needs every rank) and wait in
            # a collective that never completes, where SIGTERM only marks a stop: the full grace
            # would be spent for nothing.
            timeout = min(timeout, FAILED_GROUP_GRACE_S)
            self._peer_failed = False
            death_sig = signal.SIGTERM
        if _SHUTDOWN_TAKES_GRACE:
            super()._shutdown(death_sig, timeout)
        else:
            super()._shutdown(death_sig)

    def first_failure(self, result: RunResult) -> tuple[int, ProcessFailure]:
        """The failed rank that exited first. Elastic's own timestamps are whole seconds: a rank
        killed outright and a peer whose collective then broke usually share one, so the exit clock
        decides."""
        exited = self.exits.times(f.pid for f in result.failures.values()) if self.exits else {}
        return min(
            result.failures.items(),
            key=lambda item: (exited.get(item[1].pid, math.inf), item[1].timestamp),
        )


class _ExitClock:
    """When each worker process exited (monotonic seconds), from a pidfd per process (Linux >= 5.3;
    elsewhere nothing is measured and elastic's order stands). Watching a pidfd does not reap: Popen
    still gets the code."""

    def __init__(self, pids):
        self._exited: dict[int, float] = {}
        self._threads = {
            pid: threading.Thread(target=self._watch, args=(pid,), daemon=True) for pid in pids
        }
        for thread in self._threads.values():
            thread.start()

    def _watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        try:
            select.select([fd], [], [])  # readable once the process has exited
            self._exited[pid] = time.monotonic()
        finally:
            os.close(fd)

    def times(self, pids) -> dict[int, float]:
        """Exit times of these (exited) processes; waits briefly for their watchers to note them."""
        for pid in pids:
            if pid in self._threads:
                self._threads[pid].join(timeout=1.0)
        return dict(self._exited)


def _describe(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"exit code {failure.exitcode} / signal {failure.signal_name()}"
    return f"exit code {failure.exitcode}"


def _not_retried(failure: ProcessFailure, max_restarts: int) -> str:
    if max_restarts and failure.exitcode in NOT_RETRIED:
        return f", not restarted: {NOT_RETRIED[failure.exitcode]} fails again the same way"
    return ""


def _log_to_console_and(log_dir: Path | None) -> None:
    """Our lines to stderr (and the log file); the agent's own chatter, and what was started and how
    it ended, only to <log_dir>/launcher.log."""
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(message)s"))
    # debug lines (what was started, how it ended) go to the file only
    console.setLevel(logging.INFO)
    log.handlers[:] = [console]
    log.setLevel(logging.DEBUG)
    log.propagate = False
    if log_dir is None:
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(log_dir / "launcher.log")
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    log.addHandler(file)
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.handlers[:] = [file]
    elastic.propagate = False


def die_with_launcher() -> None:
    """In a worker of this launcher: end it when the launcher dies, even by SIGKILL, so no orphan
    keeps training into run.dir. On Linux the kernel SIGKILLs it (the parent-death signal; it
    follows the thread that forked the worker: the launcher's main thread, which runs the agent and
    lives as long as the launcher); elsewhere a watchdog thread does, within ORPHAN_POLL_S."""
    launcher_pid = int(os.environ[LAUNCHER_PID])
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        watch_parent(launcher_pid)
    if os.getppid() != launcher_pid:  # the launcher died before the lines above
        os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(parent_pid: int) -> None:
    """SIGKILL this process once its parent is no longer ``parent_pid`` (it died: the orphan was
    re-parented), from a daemon thread that polls: the parent-death signal where the kernel has
    none."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(ORPHAN_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="composer3d-parent-watchdog", daemon=True).start()


def lock_run_dir(run_dir: Path) -> None:
    """Hold <run.dir>/.composer3d.lock while this process lives: a second job on the same run.dir
    would mix its checkpoints and metrics into this one's. flock is released by the kernel when its
    holder exits, however it exits, so a finished or crashed run's directory resumes with the same
    command."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process that has not written its name yet"
        lock.close()
        raise ConfigError(
            f"run.dir: {run_dir} is in use by another job ({holder}). Wait for it to end, or give "
            "this one another run.dir"
        ) from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    lock.flush()
    if not _held:
        atexit.register(_unname_held_locks, os.getpid())
    _held.append(lock)  # open until the process exits


def _unname_held_locks(holder: int) -> None:
    """At a clean exit, the lock files stop naming this process (the kernel drops the flock after
    it; a crash leaves the name, which the next job reads only while the lock is held). A forked
    child exiting leaves its parent's."""
    if os.getpid() != holder:
        return
    for lock in _held:
        with contextlib.suppress(OSError, ValueError):
            lock.truncate(0)
            lock.flush()
