"""What a run leaves behind, and the torchrun path: metrics.jsonl, run.json, config.yaml, wandb,
tensorboard."""

import json
import os
import pty
import re
import subprocess
import sys

from harness import FAST, train

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_bytes"}


def test_metrics_run_info_wandb_tensorboard(tmp_path):
    run = train(tmp_path, *FAST, "train.steps=3", "logging.wandb=true", "logging.tensorboard=true")
    assert [m["step"] for m in run.metrics] == [1, 2, 3]
    for record in run.metrics:
        assert METRIC_KEYS <= record.keys()
        assert record["tokens_per_s"] > 0 and record["peak_mem_bytes"] > 0
    info = run.run_info
    assert info["num_params"] > 0 and info["model_state_bytes_per_rank"] > 0
    assert info["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
    assert "train:" in (tmp_path / "config.yaml").read_text()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), (
        "no tensorboard event file"
    )
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run"


def test_joins_a_torchrun_job_and_ranks_share_one_run_dir(tmp_path):
    """Under torchrun each rank resolves ${now:} itself; microseconds make them differ unless rank
    0's wins.

    Every rank writes its log into the run directory, so a second directory would show up here.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "composer3d.commands.train",
        *FAST,
        "train.steps=2",
        "parallel.tp=2",
        "parallel.dp_shard=1",
        "run.dir=runs/${now:%H-%M-%S-%f}",
    ]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1, dirs
    assert sorted(p.name for p in (dirs[0] / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    lines = (dirs[0] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads((dirs[0] / "run.json").read_text())["layout"]["tp"] == 2


STEP_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO step (\d+) loss [\d.]+ grad_norm [\d.]+ lr \S+ "
    r"tokens/s [\d,]+ TFLOP/s/device \S+ mem [\d.]+ GiB$"
)


def test_off_a_terminal_each_record_is_one_plain_line_and_on_one_rich_draws_the_progress_bar(
    tmp_path,
):
    """Piped, as in SLURM logs or `| tee`: every record whole on its own line — no wrapping at 80
    columns, no progress bar left cut short — with the start-up summary (layout, parameters, tokens
    a step, model state per rank). On a (pseudo-)terminal the same run gets rich's console and the
    progress bar."""
    run_dir = tmp_path / ("a-run-directory-with-a-name-long-enough-that-rich-would-wrap-it" * 2)
    piped = train(
        run_dir, *FAST, "logging.progress_bar=true", "train.steps=3", "parallel.dp_shard=2", nproc=2
    )
    lines = piped.output.splitlines()
    assert [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m] == [1, 2, 3], piped.output[
        -3000:
    ]
    assert any(
        f"run dir {run_dir} (to resume it, run the same command with run.dir={run_dir})" in line
        and "layout {'pp': 1, 'dp_replicate': 1, 'dp_shard': 2" in line
        for line in lines
    ), piped.output[-3000:]
    assert any(
        re.search(
            r"INFO model: [\d,]+ parameters \(.+ of them on this rank\); 512 tokens a step \(8 "
            r"sequences of 64\); 3 steps$",
            line,
        )
        for line in lines
    ), piped.output[-3000:]
    assert any(re.search(r"INFO model state: [\d.]+ [KMG]i?B per rank", line) for line in lines), (
        piped.output[-3000:]
    )
    assert "━" not in piped.output and "…" not in piped.output, (
        "a progress bar was drawn into a pipe"
    )
    # the launcher's log says what it started and how it ended (before, it stayed empty); the
    # console does not
    launched = (run_dir / "logs" / "launcher.log").read_text()
    assert (
        "starting 2 workers" in launched and "all 2 workers finished (exit code 0)" in launched
    ), launched
    assert "starting 2 workers" not in piped.output

    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "composer3d.commands.train",
            *FAST,
            "logging.progress_bar=true",
            "train.steps=2",
            f"run.dir={tmp_path / 'tty'}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the terminal's other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert proc.wait(timeout=300) == 0
    terminal = b"".join(chunks).decode(errors="replace")
    assert "━" in terminal, terminal[-3000:]  # rich's progress bar
    assert not any(STEP_LINE.match(line.strip()) for line in terminal.splitlines()), (
        "plain records on a terminal"
    )
    # a record logged while the bar is live goes above it, never onto the bar's line (two rich
    # consoles on one terminal wrote "train ━━━ 0/2 … INFO model state: …": the garbled bar inside
    # tmux/screen)
    drawn = re.split(r"\r\n|\n|\r", terminal)
    assert not [line for line in drawn if "━" in line and "INFO" in line], terminal[-3000:]
    assert any("INFO" in line and "model state" in line for line in drawn), terminal[-3000:]


def _train_in(cwd, *overrides: str) -> str:
    """composer3d-train as a user types it in ``cwd``: no run.dir, so the config's default places
    the run."""
    proc = subprocess.run(
        [sys.executable, "-m", "composer3d.commands.train", *FAST, *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_a_named_run_resumes_when_its_command_is_run_again_and_its_wandb_run_continues(tmp_path):
    """run.name=NAME: the run lives in outputs/NAME, and running the command again (with more steps)
    resumes it into the same wandb run (its id kept in the run directory). Unnamed, each run gets a
    new timestamped directory, and the log says which run.dir resumes it."""
    named = ["run.name=exp", "logging.wandb=true", "checkpoint.interval=2"]
    first = _train_in(tmp_path, *named, "train.steps=2")
    assert "the same command resumes it (run.name=exp)" in first
    second = _train_in(tmp_path, *named, "train.steps=3")
    run_dir = tmp_path / "outputs" / "exp"
    assert [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ] == [1, 2, 3]
    assert "step 1 loss" not in second and "step 3 loss" in second, (
        "the second run resumed at step 3"
    )
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert (
        len(wandb_runs) == 2 and len({path.name.rsplit("-", 1)[1] for path in wandb_runs}) == 1
    ), wandb_runs
    assert (run_dir / "wandb_run_id").read_text().strip() == wandb_runs[0].name.rsplit("-", 1)[1]

    unnamed = _train_in(tmp_path, "train.steps=1", "checkpoint.enabled=false")
    (stamped,) = (tmp_path / "outputs").glob("????-??-??/*")  # outputs/<date>/<time>
    assert f"to resume it, run the same command with run.dir={stamped}" in unnamed


def test_the_progress_bar_fits_80_columns_whole():
    """On an 80-column terminal the bar's line keeps its status whole (the loss and the speed; the
    full record is the log line above it): the bar gives up its width first."""
    import io

    from rich.console import Console

    from composer3d.training.metrics import bar_status, progress_bar

    for width in (80, 200):
        console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
        bar = progress_bar(console)
        task = bar.add_task("train", total=100, completed=0, status="")
        bar.start()
        bar.update(task, completed=16, status=bar_status({"loss": 4.57123, "tokens_per_s": 3210.4}))
        bar.stop()
        last = re.split(r"\r\x1b\[2K|\n", console.file.getvalue())[-2]
        assert last.startswith("train ━") and len(last) <= width, (width, last)
        assert "16/100 loss 4.5712 3,210 tokens/s" in last and "…" not in last, (width, last)
