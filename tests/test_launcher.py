"""The local launcher under faults and signals, on real gloo runs: a killed rank restarts the group
from the last checkpoint and the run ends bit-identical to an uninterrupted one; a bad config or
divergence is not retried; the first failed rank is named; Ctrl-C stops every process with one line;
workers die with a SIGKILLed launcher; a second job on a busy run.dir is refused before any worker
starts."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import FAST, RunResult, start, train, train_job, wait_until
from hydra import compose, initialize_config_module

from composer3d.checkpoint import committed_checkpoints
from composer3d.config.checks import validate
from composer3d.config.registration import register_configs
from composer3d.errors import ConfigError
from composer3d.launch.launcher import LOCK_FILE

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG"
)

KILL_AT_STEP = "COMPOSER3D_TEST_KILL_AT_STEP"
DIVERGE_AT_STEP = "COMPOSER3D_TEST_DIVERGE_AT_STEP"
TWO_RANKS = [*FAST, "parallel.dp_shard=2", "checkpoint.interval=2"]
LONG = "train.steps=100000"  # runs until the test stops it


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the launcher's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped by whoever inherited it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _all_gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint_bit_identically(tmp_path):
    args = [*TWO_RANKS, "train.steps=8"]
    # The uninterrupted curve is only a reference: forked ranks compute it bit for bit as the
    # command's workers do; the restart is what the command line is started for.
    straight = train_job(tmp_path / "straight", *args, nproc=2)
    # Rank 1 is SIGKILLed as step 6 begins (first attempt only); step-4 is the last checkpoint,
    # steps 1-5 logged.
    run = train(
        tmp_path / "restarted",
        *args,
        "launch.max_restarts=2",
        nproc=2,
        faults={KILL_AT_STEP: "6:1"},
    )
    restart = (
        "composer3d: rank 1 failed first (exit code -9 / signal SIGKILL); restarting all workers"
    )
    assert (
        restart in run.output
        and "(restart 1 of 2)" in run.output
        and "restart 2 of 2" not in run.output
    )
    assert restart in (run.run_dir / "logs" / "launcher.log").read_text()
    assert (
        f"resumed from {run.run_dir / 'checkpoints' / 'step-00000004'} at step 4"
        in (run.run_dir / "logs" / "rank0.log").read_text()
    )
    assert [m["step"] for m in run.metrics] == list(range(1, 9)), (
        "each step once: the killed attempt's 5 cut"
    )
    assert run.losses == straight.losses, (
        "restarted from step 4, the curve must be the uninterrupted one, bit for bit"
    )
    assert [m["grad_norm"] for m in run.metrics] == [m["grad_norm"] for m in straight.metrics]


def test_divergence_is_not_restarted(tmp_path):
    # One worker: launch.max_restarts alone puts the run under the launcher.
    run = train(
        tmp_path,
        *FAST,
        "train.steps=6",
        "optim.lr=1e6",
        "optim.warmup_steps=0",
        "launch.max_restarts=2",
        check=False,
    )
    assert run.returncode == 3, run.output[-3000:]
    assert "restarting" not in run.output and run.output.count("training stopped") == 1
    assert (
        "rank 0 failed first (exit code 3), not restarted: divergence fails again the same way"
        in run.output
    )


def test_the_first_failed_rank_tells_its_error_even_when_rank_0_is_stopped_before_it_could(
    tmp_path,
):
    # Rank 1 alone diverges at step 3; rank 0 waits in that step's collectives until the launcher
    # stops it. Left to rank 0, the reason would be lost with it: the launcher prints rank 1's line,
    # once.
    run = train(
        tmp_path, *TWO_RANKS, "train.steps=6", nproc=2, check=False, faults={DIVERGE_AT_STEP: "3:1"}
    )
    assert run.returncode == 3, run.output[-3000:]
    line = "composer3d: training stopped: step 3: injected on rank 1 alone"
    assert run.output.count(line) == 1, run.output[-3000:]
    assert "composer3d: rank 1 failed first (exit code 3)" in run.output
    assert run.output.index(line) < run.output.index("rank 1 failed first"), "the reason, then who"


@pytest.mark.parametrize("overrides", [["checkpoint.enabled=false"], ["checkpoint.resume=none"]])
def test_restarts_without_a_checkpoint_to_resume_are_refused(overrides):
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose("train", overrides=["run.dir=unused", "launch.max_restarts=1", *overrides])
    with pytest.raises(
        ConfigError, match="^launch.max_restarts: restarts resume from the last checkpoint"
    ):
        validate(cfg, 1)


def test_restarts_under_torchrun_are_refused_naming_its_flag(tmp_path):
    run = train(
        tmp_path,
        *FAST,
        "launch.max_restarts=1",
        check=False,
        timeout=120,
        env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
    )  # as torchrun starts a worker
    assert (
        run.returncode == 2
        and "invalid configuration: launch.max_restarts: restarts are the local launcher's"
        in run.output
        and "--max-restarts" in run.output
    ), run.output[-2000:]
    assert not tmp_path.exists() or not any(tmp_path.iterdir()), (
        "refused before anything was written"
    )


def test_a_busy_run_dir_refuses_a_second_job_then_ctrl_c_stops_the_first_with_one_line(tmp_path):
    first = start(tmp_path, *TWO_RANKS, LONG, nproc=2)
    wait_until(first, lambda: (tmp_path / "metrics.jsonl").exists(), "a logged step")
    workers = _children(first.pid)
    assert len(workers) == 2
    # held mid-run, so the first job is surely still running while the second tries
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        second = train(tmp_path, *TWO_RANKS, LONG, nproc=2, check=False, timeout=120)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    assert second.returncode == 2, second.output[-3000:]
    assert (
        f"invalid configuration: run.dir: {tmp_path} is in use by another job (pid {first.pid} on "
        "host " in second.output
    )
    assert "data: " not in second.output and "layout" not in second.output, (
        "no worker of the second job started"
    )
    assert second.seconds < 60

    wait_until(first, lambda: bool(committed_checkpoints(tmp_path / "checkpoints")), "a checkpoint")
    # what Ctrl-C in a terminal does: the foreground process group
    os.killpg(first.pid, signal.SIGINT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    # The workers got the SIGINT too, and saved the step they stopped at, as for SIGTERM; every line
    # names SIGINT and the code the command exits with.
    stopped = RunResult(0, "", 0.0, tmp_path).metrics[-1]["step"]
    newest = committed_checkpoints(tmp_path / "checkpoints")[0]
    assert newest.name == f"step-{stopped:08d}", "the step the workers stopped at is saved"
    assert stderr.strip().splitlines() == [
        f"composer3d: stopped by SIGINT (Ctrl-C); the last checkpoint is {newest}; to resume it, "
        f"run the same command with run.dir={tmp_path}; exit code 130"
    ], stderr[-3000:]
    assert (
        f"received SIGINT (Ctrl-C): checkpoint {newest.name} saved; exiting with code 130"
        in (tmp_path / "logs" / "rank0.log").read_text()
    )
    assert "SIGTERM" not in (tmp_path / "logs" / "rank0.log").read_text()
    assert _all_gone(workers, 5)
    steps = [m["step"] for m in RunResult(0, "", 0.0, tmp_path).metrics]
    assert steps == list(range(1, len(steps) + 1)), "one job's steps, each once"
    assert (tmp_path / LOCK_FILE).read_text() == "", "the stopped launcher's name left with it"


def test_ctrl_c_while_the_workers_import_is_one_line_not_their_tracebacks(tmp_path):
    """Ctrl-C in the first seconds, while the workers still import torch: no worker's
    KeyboardInterrupt traceback, only the launcher's one line, exit 130."""
    first = start(tmp_path, *TWO_RANKS, LONG, nproc=2)
    wait_until(first, lambda: len(_children(first.pid)) == 2, "two workers")
    os.killpg(first.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the foreground group
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    (line,) = stderr.strip().splitlines()
    assert line.startswith("composer3d: stopped by SIGINT (Ctrl-C)") and line.endswith(
        "exit code 130"
    ), line
    assert not (tmp_path / "metrics.jsonl").exists(), "stopped before any step"


def test_workers_die_with_a_sigkilled_launcher_and_its_lock_goes_with_it(tmp_path):
    launcher = start(tmp_path, *TWO_RANKS, LONG, nproc=2)
    wait_until(launcher, lambda: (tmp_path / "metrics.jsonl").exists(), "a logged step")
    workers = _children(launcher.pid)
    assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    launcher.kill()
    launcher.communicate()
    assert _all_gone(workers, 5), "orphaned workers still training into run.dir"
    with open(tmp_path / LOCK_FILE) as lock:  # the kernel dropped the dead launcher's flock
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


ORPHAN = """
import os, sys, time
from composer3d.launch.launcher import watch_parent
watch_parent(os.getppid())
open(sys.argv[1], "w").close()
time.sleep(600)
"""


def test_where_no_parent_death_signal_exists_a_watchdog_ends_the_orphan(tmp_path):
    """The watchdog a worker runs off Linux (no PR_SET_PDEATHSIG), exercised here: its parent
    SIGKILLed, the worker is gone within 5 s."""
    ready = tmp_path / "ready"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.run(sys.argv[1:])",
            sys.executable,
            "-c",
            ORPHAN,
            str(ready),
        ]
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert parent.poll() is None and time.monotonic() < deadline, (
            "the worker never started its watchdog"
        )
        time.sleep(0.1)
    (worker,) = _children(parent.pid)
    assert _alive(worker)
    parent.kill()
    parent.wait()
    assert _all_gone([worker], 5), "an orphan outlived its parent by 5 s"


@pytest.mark.accelerator
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's caching allocator setting")
def test_cuda_allocator_grows_segments_in_place_unless_the_environment_or_the_config_says_otherwise():  # noqa: E501
    """memory.expandable_segments (the default): the device's segments are expandable, and the run
    records the setting; a PYTORCH_CUDA_ALLOC_CONF of the environment wins, and false leaves the
    allocator as torch sets it."""
    code = (
        "import sys, torch; from composer3d.launch.distributed import allocator_settings, "
        "resolve_device; device = resolve_device('cuda', 0, sys.argv[1] == 'true'); x = "
        "torch.empty(2**20, device=device); print(allocator_settings(), all(s['is_expandable'] for "
        "s in torch.cuda.memory._snapshot()['segments']))"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    }

    def run(flag: str, **extra) -> str:
        return subprocess.run(
            [sys.executable, "-c", code, flag],
            env={**env, **extra},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()

    assert run("true") == ["expandable_segments:True", "True"]
    assert run("false") == ["None", "False"]
    assert run("true", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False") == [
        "expandable_segments:False",
        "False",
    ]


ENDED = """
import atexit, sys, threading, time
from composer3d.launch.process_exit import ending_the_process

# left open: the interpreter's teardown would flush and close it; end_process skips the teardown
left_open = open(sys.argv[1] + ".teardown", "w")
left_open.write("flushed by the teardown")
def late_thread():
    time.sleep(0.3)
    open(sys.argv[1] + ".thread", "w").close()
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").close())

def command():
    threading.Thread(target=late_thread).start()
    print("buffered", end="")  # a pipe: block-buffered, flushed only at exit
    sys.exit(sys.argv[2] if sys.argv[2] == "why" else int(sys.argv[2]))

ending_the_process(command)()
"""


@pytest.mark.parametrize("code", ["0", "3", "why"])
def test_a_command_ends_with_its_exit_work_done_and_no_teardown(tmp_path, code):
    """process_exit: the command's exit status (a string: printed, 1), its buffered output, its
    threads waited for and its atexit handlers run; the interpreter's teardown skipped (a file left
    open keeps what it had buffered: the teardown would have flushed it)."""
    mark = str(tmp_path / "mark")
    proc = subprocess.run(
        [sys.executable, "-c", ENDED, mark, code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == {"0": 0, "3": 3, "why": 1}[code], proc.stderr
    assert proc.stdout == "buffered"
    assert proc.stderr == ("why\n" if code == "why" else ""), proc.stderr
    done = {p.suffix: p.read_text() for p in tmp_path.iterdir()}
    assert done == {".thread": "", ".atexit": "", ".teardown": ""}, done
