"""Smoke runs of the benchmarks on the CPU with tiny settings, so none of them rots unnoticed; what they measure is
checked by their own output, not timed here."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _run(name: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a smoke test, not a measurement: leave the other core alone
    proc = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    return proc.stdout


def test_throughput_benchmark_runs_both_sides_on_cpu():
    stdout = _run("throughput.py", "--device", "cpu", "--shape", "cpu", "--steps", "2", "--warmup", "1",
                  "--rounds", "1", "--json")
    result = json.loads(stdout)
    assert result["device"] == "cpu" and result["shape"] == "cpu"
    for side in ("composer3d", "plain"):
        r = result[side]
        assert 0 < r["step_time_s_min"] <= r["step_time_s_median"], r
        assert r["tokens_per_s"] > 0 and r["tflops_per_s"] > 0, r
        assert r["mfu"] is None and r["peak_mem_bytes"] is None, r  # no known peak, no allocator stats on the CPU
    assert math.isfinite(result["ratio_step_time"]) and result["ratio_step_time"] > 0


def test_pipeline_bubble_benchmark_measures_each_schedule():
    stdout = _run("pipeline_bubble.py", "--dim", "64", "--layers", "4", "--steps", "1", "--schedules", "1f1b", "zbv",
                  "--device", "cpu")
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] in (["1f1b"], ["zbv"])]
    assert [row[0] for row in rows] == ["1f1b", "zbv"], stdout
    assert all(0 <= float(value) < 1 for row in rows for value in row[3:5]), "idle fractions per rank"


def test_checkpoint_blocking_benchmark_compares_sync_and_async():
    stdout = _run("checkpoint_blocking.py", "--dim", "64", "--layers", "2", "--steps", "4", "--device", "cpu")
    assert "async / sync blocking ratio" in stdout, stdout
