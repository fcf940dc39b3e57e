"""Sweeps (``-m``) and SLURM submission through Hydra's launchers: each job in its own run
directory.

The runs are the real command; ``-m`` goes last among the overrides (Hydra's flag), and a swept key
given after the harness's own ``launch.nproc_per_node`` wins over it (Hydra takes the last value of
a key).
"""

import json
import re

import yaml
from harness import FAST, train
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from composer3d.config.registration import register_configs

TINY = [*FAST, "checkpoint.enabled=false"]


def _job(run_dir, number: int) -> dict:
    """What sweep job ``number`` left in ``<run.dir>/<number>``: its config, metrics and run.json
    (or None)."""
    job_dir = run_dir / str(number)
    config = job_dir / "config.yaml"
    if not config.exists():
        return {"dir": job_dir, "config": None}
    return {
        "dir": job_dir,
        "config": yaml.safe_load(config.read_text()),
        "metrics": [
            json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()
        ],
        "run": json.loads((job_dir / "run.json").read_text()),
    }


def test_a_sweep_runs_each_job_in_its_own_run_dir_and_exits_with_the_first_failed_jobs_code(
    tmp_path,
):
    """Hydra's basic launcher: the jobs one after another, each in <run.dir>/<job number>, with 1
    rank (trained in the sweep's process) or 2 (its own local workers). The lr=0 jobs are refused
    (exit 2); the sweep goes on with the others and then exits 2, repeating the refused job's
    line."""
    run = train(
        tmp_path,
        *TINY,
        "train.steps=3",
        "optim.lr=0,1e-3,2e-3",
        "launch.nproc_per_node=1,2",
        "-m",
        check=False,
    )
    assert run.returncode == 2, run.output[-4000:]
    refused = "composer3d: invalid configuration: optim.lr: must be > 0, got 0.0. Use e.g. 3e-4"
    # once by each refused job as it fails, once more in Hydra's report of the first failed job
    assert run.output.count(refused) == 3, run.output[-4000:]
    assert (
        "Error executing job with overrides" in run.output
        and f"{refused} (exit code 2)" in run.output
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
    ]

    jobs = [_job(tmp_path, n) for n in range(6)]
    assert sum(job["config"] is None for job in jobs) == 2, "a refused job writes nothing"
    trained = {}
    for job in (job for job in jobs if job["config"] is not None):
        cfg = job["config"]
        assert cfg["run"]["dir"] == str(job["dir"]), "the job's config names its own run dir"
        assert [m["step"] for m in job["metrics"]] == [1, 2, 3]
        assert job["run"]["world_size"] == cfg["launch"]["nproc_per_node"]
        trained[(cfg["optim"]["lr"], cfg["launch"]["nproc_per_node"])] = [
            m["loss"] for m in job["metrics"]
        ]
        # The job's resume hint resumes its own directory: without -m (with it, run.dir would become
        # the sweep's directory and a new job would nest inside), with the job's own values.
        hint = re.search(
            r"\((to resume this job, .*)\)$", (job["dir"] / "logs" / "rank0.log").read_text(), re.M
        )
        assert hint and "run the command without -m, with: " in hint.group(1), job["dir"]
        own = hint.group(1).split("with: ", 1)[1].split("; the same sweep", 1)[0].split()
        assert own[-1] == f"run.dir={job['dir']}" and "-m" not in own, hint.group(1)
        last = {
            o.split("=", 1)[0]: o.split("=", 1)[1] for o in own
        }  # Hydra takes a key's last value
        assert float(last["optim.lr"]) == cfg["optim"]["lr"], hint.group(1)
        assert int(last["launch.nproc_per_node"]) == cfg["launch"]["nproc_per_node"], hint.group(1)
        # the layout line's parentheses close once
        assert hint.group(1).endswith(
            f"; the same sweep with run.dir={tmp_path} resumes every job"
        ), hint.group(1)
    assert set(trained) == {(1e-3, 1), (1e-3, 2), (2e-3, 1), (2e-3, 2)}
    # Each job trained with its own lr: the losses part after the first update, and 1 or 2 ranks
    # agree.
    assert abs(trained[(1e-3, 1)][-1] - trained[(2e-3, 1)][-1]) > 0.01, trained
    for lr in (1e-3, 2e-3):
        assert max(abs(a - b) for a, b in zip(trained[(lr, 1)], trained[(lr, 2)])) < 1e-3, trained


def test_slurm_local_trains_each_job_as_submitit_tasks_one_rank_each(tmp_path):
    """hydra/launcher=slurm_local (submitit_local, as hydra/launcher=slurm submits to SLURM):
    launch.nproc_per_node=2 makes each job 2 submitit tasks, which join as ranks 0 and 1 of one gloo
    job. The lr=0 job fails in its tasks; the sweep's command reports its line and exits 2."""
    run = train(
        tmp_path,
        *TINY,
        "train.steps=2",
        "hydra/launcher=slurm_local",
        "launch.nproc_per_node=2",
        "optim.lr=0,1e-3",
        "-m",
        check=False,
        timeout=300,
    )
    assert run.returncode == 2, run.output[-4000:]
    assert (
        "composer3d: invalid configuration: optim.lr: must be > 0, got 0.0. Use e.g. 3e-4 (exit "
        "code 2)" in run.output
    ), run.output[-4000:]
    refused, trained = _job(tmp_path, 0), _job(tmp_path, 1)
    assert refused["config"] is None
    assert trained["config"]["optim"]["lr"] == 1e-3 and trained["config"]["run"]["dir"] == str(
        trained["dir"]
    )
    assert [m["step"] for m in trained["metrics"]] == [1, 2]
    assert trained["run"]["world_size"] == 2 and trained["run"]["layout"]["dp_shard"] == 2
    assert sorted(p.name for p in (trained["dir"] / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    # submitit's own record: two jobs of two tasks each, every task a rank of its job
    # (global_rank=R(tasks))
    logs = "".join(log.read_text() for log in (tmp_path / ".submitit").glob("*/*_log.out"))
    ranks = re.findall(r"Starting with JobEnvironment\(.*global_rank=(\d+)\((\d+)\)", logs)
    assert sorted(ranks) == [("0", "2"), ("0", "2"), ("1", "2"), ("1", "2")], logs


def test_a_submitit_task_starts_no_local_workers(tmp_path):
    """In a submitit job the ranks are its tasks: one task asking for local workers is refused,
    naming the key."""
    run = train(tmp_path, *TINY, nproc=2, env={"SUBMITIT_EXECUTOR": "local"}, check=False)
    assert run.returncode == 2, run.output[-3000:]
    assert (
        "composer3d: invalid configuration: launch.nproc_per_node: 2 processes asked for, but a "
        "submitit job's ranks are its tasks"
        in run.output
        and "hydra.launcher.tasks_per_node=2" in run.output
    ), run.output[-3000:]


def test_slurm_launcher_takes_one_task_per_device_from_launch_nproc_per_node():
    """hydra/launcher=slurm is the plugin's submitit_slurm with tasks and GPUs per node from
    launch.nproc_per_node; the SLURM keys are the plugin's own, passed through."""
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                "launch.nproc_per_node=8",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.nodes=2",
                "hydra.launcher.timeout_min=90",
                "run.dir=unused",
            ],
        )
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (
        launcher["_target_"]
        == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    )
    assert {
        k: launcher[k]
        for k in ("tasks_per_node", "gpus_per_node", "partition", "nodes", "timeout_min")
    } == {
        "tasks_per_node": 8,
        "gpus_per_node": 8,
        "partition": "gpu",
        "nodes": 2,
        "timeout_min": 90,
    }
