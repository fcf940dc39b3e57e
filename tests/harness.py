"""Runs composer3d-train as a user would (a subprocess; N local gloo workers) and reads what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Small and fast: the tiny model on a slice of the stdlib corpus, fp32, deterministic.
FAST = [
    "model=tiny", "data.max_tokens=200000", "train.seq_len=64", "train.global_batch_size=8",
    "train.micro_batch_size=2", "logging.progress_bar=false", "train.deterministic=true", "launch.device=cpu",
]


@dataclass
class RunResult:
    returncode: int
    output: str
    seconds: float
    run_dir: Path

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def run_info(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    @property
    def effects(self) -> list[dict]:
        """Per rank, what the switches did to the model and optimizer (``train(probe_effects=True)``)."""
        return [json.loads(p.read_text()) for p in sorted((self.run_dir / "effects").glob("rank*.json"))]


FAULT_INJECTION = Path(__file__).parent / "fault_injection"


def train(run_dir: Path, *overrides: str, nproc: int = 1, timeout: float = 600, check: bool = True,
          env: dict | None = None, faults: dict | None = None, probe_effects: bool = False) -> RunResult:
    """``faults``: COMPOSER3D_TEST_* variables for tests/fault_injection, which every process of the run loads;
    ``probe_effects``: each rank records its model's and optimizer's state after the first step (``effects``)."""
    if probe_effects:
        faults = {**(faults or {}), "COMPOSER3D_TEST_EFFECTS": str(Path(run_dir) / "effects")}
    args = [sys.executable, "-m", "composer3d.train", f"launch.nproc_per_node={nproc}", f"run.dir={run_dir}", *overrides]
    child_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    child_env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})})
    if faults:
        child_env.update(faults)
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULT_INJECTION), child_env.get("PYTHONPATH")]))
    start = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=child_env)
    result = RunResult(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, Path(run_dir))
    if check and proc.returncode != 0:
        raise AssertionError(f"composer3d-train {' '.join(overrides)} failed ({proc.returncode}):\n{result.output[-6000:]}")
    return result


def spawn(fn, world_size: int, tmp_path: Path, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; a worker's traceback fails the test."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(fn, world_size, str(tmp_path / "store"), args), nprocs=world_size, join=True)


def _worker(rank: int, fn, world_size: int, store: str, args) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
