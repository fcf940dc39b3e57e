"""Wrong numbers are never silent, and a resume does what its config says: non-finite losses stop
(or skip) the run without checkpointing that state, metrics stay strict JSON, the fp16 loss scale
survives a resume, changed optimizer settings apply and are said, and a checkpoint past train.steps
is refused."""

import json

from harness import FAST, train, train_in_one_group, train_job

DIVERGING = [
    "optim.lr=1e6",
    "optim.warmup_steps=0",
]  # Adam steps of ~1e6 overflow within a step or two


def _strict_json_lines(run) -> list[dict]:
    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    return [
        json.loads(line, parse_constant=refuse)
        for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def _log(run) -> str:
    """Rank 0's log file: its lines are whole (the console wraps them)."""
    return (run.run_dir / "logs" / "rank0.log").read_text()


def _checkpoint_steps(run) -> list[int]:
    return sorted(
        int(p.name.split("-")[1])
        for p in (run.run_dir / "checkpoints").glob("step-*")
        if "." not in p.name
    )


def test_non_finite_loss_stops_without_checkpointing_it_and_keeps_the_last_good_one(tmp_path):
    args = [
        *FAST,
        "train.steps=12",
        "checkpoint.interval=2",
        "checkpoint.keep_last=1",
        "parallel.dp_shard=2",
    ]
    # step-4 is the last good checkpoint
    good = train_job(tmp_path / "run", *args, "train.steps=4", nproc=2)
    assert _checkpoint_steps(good) == [4]
    # Resumed with a diverging learning rate (a changed setting: it applies, and the log says so).
    run = train(tmp_path / "run", *args, *DIVERGING, "logging.log_every=5", nproc=2, check=False)
    assert run.returncode == 3, run.output[-3000:]
    assert "optimizer settings" in _log(run) and "lr 0.0003 -> 1000000.0" in _log(run)
    records = _strict_json_lines(run)
    bad = next(r for r in records if r["loss"] is None or r["grad_norm"] is None)
    assert f"step {bad['step']}: the loss or gradient norm is not finite" in run.output
    assert run.output.count("training stopped") == 1, "one message, not one per rank"
    assert _checkpoint_steps(run) == [4] or max(_checkpoint_steps(run)) < bad["step"], (
        "no checkpoint of the non-finite state, and keep_last did not prune the good one"
    )
    assert records[-1]["step"] == bad["step"], "stopped at the window that showed it"


def test_skip_drops_non_finite_updates_then_stops_after_too_many_in_a_row(tmp_path):
    run = train(
        tmp_path,
        *FAST,
        "train.steps=10",
        *DIVERGING,
        "train.on_nonfinite=skip",
        "train.max_skipped_steps=3",
        check=False,
    )
    assert run.returncode == 3, run.output[-3000:]
    records = _strict_json_lines(run)
    skipped = [r for r in records if r.get("update_skipped")]
    assert len(skipped) >= 3 and skipped[-1]["nonfinite_skipped_steps"] == len(skipped)
    assert all(r["grad_norm"] is None for r in skipped)
    assert "update dropped (train.on_nonfinite=skip)" in _log(run)
    assert "4 updates in a row were dropped" in run.output


def test_fp16_that_overflows_forever_stops(tmp_path):
    run = train(
        tmp_path,
        *FAST,
        "train.steps=10",
        "precision.param_dtype=float16",
        "precision.loss_scale_init=1e300",
        "train.max_skipped_steps=2",
        check=False,
    )
    assert run.returncode == 3 and "3 updates in a row were dropped" in run.output, run.output[
        -3000:
    ]


def test_fp16_loss_scale_resumes_where_it_was(tmp_path):
    # 2**40 overflows: the first steps halve the scale; growth every 2 clean steps then doubles it
    # again.
    args = [
        *FAST,
        "train.steps=8",
        "precision.param_dtype=float16",
        "precision.loss_scale_init=1099511627776",
        "precision.loss_scale_growth_interval=2",
        "checkpoint.interval=4",
        "parallel.dp_shard=2",
    ]
    straight = train_job(tmp_path / "straight", *args, nproc=2)
    resumed = train_job(
        tmp_path / "resumed",
        *args,
        nproc=2,
        *[f"checkpoint.resume={straight.run_dir / 'checkpoints' / 'step-00000004'}"],
    )
    scales = [m["loss_scale"] for m in straight.metrics]
    assert scales[0] > scales[3], "the scale moved before the checkpoint, so a reset would show"
    assert [m["loss_scale"] for m in resumed.metrics] == scales[4:]
    assert resumed.losses == straight.losses[4:]


def test_changed_learning_rate_on_resume_applies_from_the_next_step(tmp_path):
    args = [*FAST, "train.steps=6", "checkpoint.interval=3"]
    base = train_job(tmp_path / "base", *args)
    # what the resumed run's schedule must follow
    lower = train_job(tmp_path / "lower", *args, "optim.lr=1e-4")
    resumed = train_job(
        tmp_path / "resumed",
        *args,
        "optim.lr=1e-4",
        *[f"checkpoint.resume={base.run_dir / 'checkpoints' / 'step-00000003'}"],
    )
    assert [m["lr"] for m in resumed.metrics] == [m["lr"] for m in lower.metrics][3:]
    assert "lr 0.0003 -> 0.0001" in _log(resumed) and "from step 4 on" in _log(resumed)


def test_a_longer_schedule_on_resume_applies_from_the_first_resumed_step(tmp_path):
    """train.steps raised on resume: the first resumed step already runs at the longer schedule's
    rate (not the checkpoint's, computed for the shorter one), and the log says so."""
    args = [*FAST, "train.steps=6", "checkpoint.interval=3", "optim.warmup_steps=2"]
    base, longer = train_in_one_group(
        [(tmp_path / "base", args), (tmp_path / "longer", [*args, "train.steps=12"])], nproc=1
    )
    resumed = train_job(
        tmp_path / "resumed",
        *args,
        "train.steps=12",
        f"checkpoint.resume={base.run_dir / 'checkpoints' / 'step-00000003'}",
    )
    lrs = [m["lr"] for m in longer.metrics]
    assert [m["lr"] for m in base.metrics][3] != lrs[3], "the two schedules differ at step 4"
    assert [m["lr"] for m in resumed.metrics] == lrs[3:]
    assert "lr at step 4" in _log(resumed) and "this run's schedule" in _log(resumed)


def test_a_checkpoint_past_train_steps_is_refused(tmp_path):
    base = train_job(tmp_path / "base", *FAST, "train.steps=4")
    run = train(
        tmp_path / "short",
        *FAST,
        "train.steps=2",
        f"checkpoint.resume={base.run_dir / 'checkpoints' / 'step-00000004'}",
        check=False,
    )
    assert (
        run.returncode == 2
        and "train.steps: the checkpoint" in run.output
        and "past train.steps=2" in run.output
    )


def _files(directory) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its inode and modification time: any rewrite changes
    one."""
    return {
        str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_a_full_disk_stops_the_save_in_one_line_leaving_no_partial_and_the_last_checkpoint_resumable(  # noqa: E501
    tmp_path,
):
    args = [*FAST, "train.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=1"]
    train_job(tmp_path, *args, "train.steps=4")
    good = tmp_path / "checkpoints" / "step-00000004"
    kept = _files(good)
    size = sum(p.stat().st_size for p in good.rglob("*") if p.is_file())
    two_ranks = [
        "parallel.dp_shard=2",
        "launch.timeout_minutes=2",
    ]  # rank 0's verdict reaches rank 1

    # Too little free space for step 6: refused before writing a byte, on both ranks alike, in one
    # line.
    full = train(
        tmp_path,
        *args,
        *two_ranks,
        nproc=2,
        check=False,
        faults={"COMPOSER3D_TEST_DISK_FREE_BYTES": "1000"},
    )
    assert full.returncode == 74, full.output[-3000:]
    line = (
        "composer3d: checkpoint.dir: no room for checkpoint step-00000006 in "
        f"{tmp_path / 'checkpoints'}: it needs about {size / 2**20:.2f} MiB ({size:,} bytes) (the "
        "size of step-00000004), and 0.00 MiB (1,000 bytes) are free. Free space there, keep fewer "
        "checkpoints (checkpoint.keep_last=1 now; older ones are pruned only after a save), or set "
        f"checkpoint.dir to a disk with room; the last good checkpoint, {good}, is kept"
    )
    assert full.output.count(line) == 1, full.output[-3000:]
    assert "Traceback" not in full.output and "restarting" not in full.output

    # The disk fills up while writing: DCP fails on every rank; the partial directory is removed.
    filled = train(
        tmp_path,
        *args,
        *two_ranks,
        nproc=2,
        check=False,
        faults={"COMPOSER3D_TEST_DISK_FULL_AT_STEP": "6"},
    )
    assert filled.returncode == 74, filled.output[-3000:]
    assert (
        filled.output.count(
            "composer3d: checkpoint.dir: checkpoint step-00000006 could not be written to"
        )
        == 1
    )
    assert "OSError: [Errno 28] No space left on device" in filled.output, filled.output[-3000:]
    assert (
        f"its partial directory was removed; the last good checkpoint, {good}, is kept"
        in filled.output
    )

    # An async save's failure surfaces when the run waits for it (here, at the end): the same line
    # and cleanup.
    background = train(
        tmp_path,
        *args,
        "checkpoint.async_mode=async",
        check=False,
        faults={"COMPOSER3D_TEST_DISK_FULL_AT_STEP": "6"},
    )
    assert background.returncode == 74, background.output[-3000:]
    assert "checkpoint step-00000006 could not be written to" in background.output

    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004"], (
        "no .partial left"
    )
    assert _files(good) == kept, (
        "the last good checkpoint is untouched: nothing pruned to make room"
    )
    resumed = train_job(tmp_path, *args)
    assert f"resumed from {good} at step 4" in resumed.output
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4, 5, 6]
