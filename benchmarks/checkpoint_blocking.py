"""How long a checkpoint save blocks training, synchronous vs async, measured side by side.

    python benchmarks/checkpoint_blocking.py [--nproc 2] [--dim 512] [--layers 8] [--steps 12]
                                             [--device auto]

Runs composer3d-train twice with the same model and layout (checkpoint.interval=2), once with
checkpoint.async_mode=none and once with async, and prints the time each save held the training loop
(``checkpoint_blocked_s`` in metrics.jsonl), the mean step time without a save, and the checkpoint
size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(mode: str, args, root: Path) -> dict:
    run_dir = root / mode
    overrides = [
        f"launch.nproc_per_node={args.nproc}",
        f"launch.device={args.device}",
        f"run.dir={run_dir}",
        "data=synthetic",
        "logging.progress_bar=false",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        f"train.steps={args.steps}",
        "train.seq_len=128",
        f"train.global_batch_size={2 * args.nproc}",
        "train.micro_batch_size=2",
        "checkpoint.interval=2",
        "checkpoint.keep_last=1",
        f"checkpoint.async_mode={mode}",
    ]
    subprocess.run(
        [sys.executable, "-m", "composer3d.commands.train", *overrides],
        check=True,
        capture_output=True,
    )
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    blocked = [
        m["checkpoint_blocked_s"] for m in metrics[1:] if "checkpoint_blocked_s" in m
    ]  # skip warm-up save
    plain = [m["step_time_s"] for m in metrics[1:] if "checkpoint_blocked_s" not in m]
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    info = json.loads((run_dir / "run.json").read_text())
    return {
        "mode": mode,
        "blocked_s": statistics.mean(blocked),
        "step_s": statistics.mean(plain),
        "checkpoint_mb": size / 2**20,
        "params": info["num_params"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--device", default="auto", help="auto: one accelerator per rank where there are, else CPU"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(mode, args, Path(tmp)) for mode in ("none", "async")]
    print(
        f"model: {results[0]['params'] / 1e6:.1f}M params, checkpoint "
        f"{results[0]['checkpoint_mb']:.0f} MiB, "
        f"{args.nproc} ranks"
    )
    print(f"{'mode':<8}{'save blocks training (s)':>26}{'step without save (s)':>24}")
    for r in results:
        print(f"{r['mode']:<8}{r['blocked_s']:>26.3f}{r['step_s']:>24.3f}")
    print(f"async / sync blocking ratio: {results[1]['blocked_s'] / results[0]['blocked_s']:.2f}")


if __name__ == "__main__":
    main()
