"""What a run leaves behind, and the torchrun path: metrics.jsonl, run.json, config.yaml, wandb, tensorboard."""

import json
import os
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
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), "no tensorboard event file"
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run"


def test_joins_a_torchrun_job_and_ranks_share_one_run_dir(tmp_path):
    """Under torchrun each rank resolves ${now:} itself; microseconds make them differ unless rank 0's wins.

    Every rank writes its log into the run directory, so a second directory would show up here.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "composer3d.train", *FAST, "train.steps=2", "parallel.tp=2", "parallel.dp_shard=1",
           "run.dir=runs/${now:%H-%M-%S-%f}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1, dirs
    assert sorted(p.name for p in (dirs[0] / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    lines = (dirs[0] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads((dirs[0] / "run.json").read_text())["layout"]["tp"] == 2
