"""Faults and signals in a run: a preemption signal saves the step and exits for a requeue, a torn
metrics line or a moved model directory does not block the resume, a finished model_only_final run
is not overwritten, and a stalled rank fails the run after launch.timeout_minutes instead of
hanging."""

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from harness import FAST, spawn, start, train, train_in_background, train_job
from omegaconf import OmegaConf

from composer3d.checkpoint import META_FILE, committed_checkpoints
from composer3d.errors import StoppedBySignal
from composer3d.training.metrics import MetricsSink

SLOW_RANK = "COMPOSER3D_TEST_SLOW_RANK"


def _worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (its children, each with RANK in its
    environment)."""
    workers = {}
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0") if parent == launcher else []
        except (OSError, ValueError):  # not a process, or one that just ended
            continue
        ranks = [int(var[5:]) for var in environ if var.startswith(b"RANK=")]
        if ranks:
            workers[ranks[0]] = int(proc.name)
    return workers


def _wait_for_steps(path: Path, steps: int, proc) -> None:
    deadline = time.monotonic() + 300
    while not (path.exists() and len(path.read_text().splitlines()) >= steps):
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before step {steps}"
        assert time.monotonic() < deadline, f"no step {steps} in 300 s"
        time.sleep(0.05)


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its inode and modification time: any rewrite changes
    one."""
    return {
        str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _strict_records(path: Path) -> list[dict]:
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_sigterm_saves_that_step_and_the_same_command_resumes_exactly_then_refuses_to_overwrite(
    tmp_path,
):
    args = [*FAST, "train.steps=12", "parallel.dp_shard=2", "checkpoint.model_only_final=true"]
    # The uninterrupted curve is only a reference: forked ranks compute it bit for bit as the
    # command's workers do; the signal, the requeued command and its refusal are the command line's.
    straight = train_job(tmp_path / "straight", *args, nproc=2)

    run_dir = tmp_path / "run"
    # Rank 1 sleeps before each step (room to signal mid-run); only rank 1 gets SIGTERM, as when
    # ranks see it at different times: rank 0 must stop at the same step or the two would hang in
    # different collectives.
    proc = train_in_background(run_dir, *args, nproc=2, faults={SLOW_RANK: "1:1:0.25"})
    _wait_for_steps(run_dir / "metrics.jsonl", 3, proc)
    os.kill(_worker_pids(proc.pid)[1], signal.SIGTERM)
    returncode = proc.wait(timeout=300)
    output = Path(f"{run_dir}.out").read_text()
    assert returncode == StoppedBySignal.EXIT_CODE == 75, output[-3000:]
    stopped = _strict_records(run_dir / "metrics.jsonl")[-1]["step"]
    assert 3 < stopped < 12, f"stopped at step {stopped}: not mid-run"
    saved = committed_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] == [f"step-{stopped:08d}"], (
        "the step it stopped at is saved, and committed"
    )
    assert json.loads((saved[0] / META_FILE).read_text())["model_only"] is False, (
        "a full checkpoint, to resume"
    )
    assert (
        f"received SIGTERM: checkpoint step-{stopped:08d} saved; exiting so the job can be requeued"
        in (run_dir / "logs" / "rank0.log").read_text()
    )

    # A crash mid-write past that checkpoint leaves a torn last line: the resume drops it and keeps
    # every other one.
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write(f'{{"step": {stopped + 1}, "loss": 6.1')
    resumed = train(run_dir, *args, nproc=2)  # the same command, as a requeued job runs it
    assert "resumed from" in resumed.output and f"step-{stopped:08d}" in resumed.output
    assert "metrics.jsonl: dropped its last line" in (run_dir / "logs" / "rank0.log").read_text()
    records = _strict_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13)), "each step exactly once"
    assert resumed.losses == straight.losses, (
        "stopped by SIGTERM + resumed must equal an uninterrupted run exactly"
    )
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in straight.metrics]

    # Finished with model_only_final: the same command again trains nothing and writes nothing.
    before = _files(run_dir / "checkpoints") | {"metrics.jsonl": _files(run_dir)["metrics.jsonl"]}
    again = train(run_dir, *args, nproc=2)
    assert "already finished: step 12 of train.steps=12" in again.output
    # More steps cannot continue from weights alone here, and would overwrite them: refused, naming
    # the key.
    more = train(run_dir, *[a for a in args if "dp_shard" not in a], "train.steps=16", check=False)
    assert more.returncode == 2 and "invalid configuration: train.steps:" in more.output, (
        more.output[-2000:]
    )
    assert "holds the final weights of a finished run" in more.output
    assert (
        _files(run_dir / "checkpoints") | {"metrics.jsonl": _files(run_dir)["metrics.jsonl"]}
        == before
    )


def _agree_on_stop(rank: int, world_size: int, out: Path) -> None:
    from datetime import timedelta

    from composer3d.launch.stop_signals import StopSignals

    signals = StopSignals(timedelta(minutes=1))
    verdicts = []
    for step in range(1, 7):
        if rank == 1 and step == 3:  # only rank 1 is told, during step 3
            os.kill(os.getpid(), signal.SIGUSR1)
        # submitit's time-limit notice (unhandled, it would end the process)
        if rank == 0 and step == 4:
            os.kill(os.getpid(), signal.SIGUSR2)
        verdicts.append(signals.agreed())  # the boundary after the step
    signals.finish()
    signals.restore()
    (out / f"rank{rank}.json").write_text(json.dumps(verdicts))


def test_ranks_agree_on_the_stop_signal_at_the_same_boundary(tmp_path):
    spawn(_agree_on_stop, 2, tmp_path, tmp_path)
    # SIGUSR1 seen at boundary 3, agreed at the next; SIGUSR2 (the larger number) seen at 4, agreed
    # at 5
    expected = [0, 0, 0, signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR2]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [
        expected,
        expected,
    ]


def _sink(run_dir: Path, resume_step: int) -> None:
    cfg = OmegaConf.create(
        {"logging": {"wandb": False, "tensorboard": False, "progress_bar": False}}
    )
    MetricsSink(run_dir, cfg, enabled=True, total_steps=10, resume_step=resume_step).close()


def test_metrics_resume_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines))  # complete, only the newline missing: kept
    _sink(tmp_path, resume_step=3)
    assert path.read_text() == "".join(line + "\n" for line in lines)
    written = path.stat().st_mtime_ns
    _sink(tmp_path, resume_step=3)
    assert path.stat().st_mtime_ns == written, "nothing to drop: the file is not rewritten"
    path.write_text("".join(line + "\n" for line in lines) + '{"step": 4, "lo')
    _sink(tmp_path, resume_step=2)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    # not a crash's trace
    path.write_text(lines[0] + "\n" + '{"step": 2, "lo' + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError, match="line 2, is not a metrics record"):
        _sink(tmp_path, resume_step=3)


def test_a_stalled_rank_fails_the_run_after_launch_timeout_minutes(tmp_path):
    # Rank 1 stalls for 10 minutes before step 3; 0.05 minutes is 3000 ms. The launcher SIGKILLs the
    # stalled rank 5 s after the other fails (its SIGTERM only sets the stop flag of a rank that
    # sleeps).
    run = train(
        tmp_path,
        *FAST,
        "train.steps=6",
        "parallel.dp_shard=2",
        "launch.timeout_minutes=0.05",
        nproc=2,
        check=False,
        faults={SLOW_RANK: "1:3:600"},
        env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"},
    )
    ended = time.time()
    assert run.returncode == 1, run.output[-3000:]
    # step 2's line, written just before the stall
    stalled_since = (tmp_path / "metrics.jsonl").stat().st_mtime
    assert ended - stalled_since < 60, "failed within seconds of the stall, not after it"
    # What torch says: gloo's transport operation and the timeout (from launch.timeout_minutes), in
    # the line of the rank whose collective waited; its traceback (FSDP's all-gather) in the run's
    # log, not on the console
    assert "Timed out waiting 3000ms" in run.output and "Traceback" not in run.output, run.output[
        -3000:
    ]
    crashed = re.search(r"composer3d: rank (\d) crashed: .* \(traceback in (\S+)\)", run.output)
    assert crashed and Path(crashed[2]) == tmp_path / "logs" / f"rank{crashed[1]}.log", run.output[
        -3000:
    ]
    logged = Path(crashed[2]).read_text()
    assert "Traceback" in logged and "all_gather" in logged, logged[-3000:]
    assert [r["step"] for r in run.metrics] == [1, 2]


def test_an_hf_run_resumes_from_its_checkpoint_after_its_model_directory_moved(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_model
    from test_hf_training import HF_FAST

    original = make_model(tmp_path / "model", "qwen3")
    args = [*HF_FAST, "train.steps=3", "checkpoint.enabled=true", "checkpoint.interval=2"]
    first = train(tmp_path / "first", *args, f"model.path={original}")
    # no library warning the user can do nothing about (torchao's kernels, pytree's Enum note,
    # transformers' mask keyword): the console keeps what matters
    for harmless in ("Failed to load", "is an Enum subclass", "FutureWarning"):
        assert harmless not in first.output, first.output[-3000:]
    moved = tmp_path / "moved"
    shutil.move(original, moved)
    # the checkpoint holds the trained weights: resuming needs none
    for weights in moved.glob("*.safetensors"):
        weights.unlink()

    step2 = first.run_dir / "checkpoints" / "step-00000002"
    gone = train(
        tmp_path / "gone",
        *args,
        f"model.path={original}",
        f"checkpoint.resume={step2}",
        check=False,
    )
    assert gone.returncode == 2, gone.output[-2000:]
    assert (
        f"model.path: {str(original)!r} is neither" in gone.output
        and "needs only config.json" in gone.output
    )
    resumed = train(
        tmp_path / "resumed", *args, f"model.path={moved}", f"checkpoint.resume={step2}"
    )
    assert [m["step"] for m in resumed.metrics] == [3]
    assert resumed.losses == first.losses[2:], (
        "step 3 from the checkpoint, exactly as the first run took it"
    )


def test_sigusr1_to_the_launcher_reaches_the_workers_which_save_and_exit_75(tmp_path):
    """SLURM's time-limit notice (--signal=USR1@…) reaches a job's launcher: it forwards it, the
    workers save the step they stop at, and the launcher exits 75 (requeue) with one line, not a
    traceback."""
    run_dir = tmp_path / "run"
    proc = train_in_background(
        run_dir,
        *FAST,
        "train.steps=40",
        "parallel.dp_shard=2",
        nproc=2,
        faults={SLOW_RANK: "1:1:0.25"},
    )
    _wait_for_steps(run_dir / "metrics.jsonl", 3, proc)
    os.kill(proc.pid, signal.SIGUSR1)
    returncode = proc.wait(timeout=300)
    output = Path(f"{run_dir}.out").read_text()
    assert returncode == StoppedBySignal.EXIT_CODE, output[-3000:]
    stopped = _strict_records(run_dir / "metrics.jsonl")[-1]["step"]
    assert 3 <= stopped < 40, f"stopped at step {stopped}: not mid-run"
    saved = committed_checkpoints(run_dir / "checkpoints")
    assert saved and saved[0].name == f"step-{stopped:08d}", (
        "the step the workers stopped at is saved and committed"
    )
    assert "stopped by SIGUSR1; the last checkpoint is" in output, output
    assert f"to resume it, run the same command with run.dir={run_dir}" in output, output
    assert "Traceback" not in output, output[-3000:]


def test_ctrl_c_in_one_process_saves_like_sigterm_and_says_sigint_and_exit_130(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) in a run of one process: the step it stops at
    is saved, as for SIGTERM, and the run says which signal came and exits 130, the code it
    names."""
    run_dir = tmp_path / "run"
    # no checkpoint.interval
    proc = start(run_dir, *FAST, "train.steps=100000", faults={SLOW_RANK: "0:1:0.2"})
    _wait_for_steps(run_dir / "metrics.jsonl", 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    output = stdout + stderr
    assert proc.returncode == 130, output[-3000:]
    stopped = _strict_records(run_dir / "metrics.jsonl")[-1]["step"]
    assert [p.name for p in committed_checkpoints(run_dir / "checkpoints")] == [
        f"step-{stopped:08d}"
    ], output[-3000:]
    assert (
        f"received SIGINT (Ctrl-C): checkpoint step-{stopped:08d} saved; exiting with code 130"
        in output
    )
    assert "SIGTERM" not in output and "exit code 75" not in output and "Traceback" not in output, (
        output[-3000:]
    )
