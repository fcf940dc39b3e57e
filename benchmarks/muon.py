"""Muon beside AdamW: tokens to a target loss, and what Muon's distributed step moves and computes.

    python benchmarks/muon.py [--steps 60] [--target 2.8] [--lrs 1e-3 3e-3 1e-2]
                              [--nproc 4] [--traffic-steps 2] [--layouts ...]
                              [--parts convergence traffic] [--json]
                              [-- hydra overrides for every run, e.g. model=tiny]

``convergence``: the tiny model trained in one process on the same tokens (the stdlib corpus, the
same seed and order) with optim.name=adamw and optim.name=muon at each learning rate (Muon's
default scale, match_adamw, makes AdamW's rate its own), printing the tokens each takes to reach
``--target`` and its last loss.

``traffic``: on ``--nproc`` gloo ranks, each layout's optimizer step with optim.name=muon, its
``all_to_all_single`` calls counted (the elements every rank sends, summed over the ranks) beside
the minimum for each matrix gathered once and scattered once (for each matrix the cheapest owner:
the distinct pieces it lacks sent to it once, its result sent to every other holder once), and each
rank's Newton–Schulz FLOPs beside the even share of its meshes' matrices.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
from itertools import product
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

BASE = [
    "model=tiny",
    "data.max_tokens=200000",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "logging.progress_bar=false",
    "launch.device=cpu",
    "checkpoint.enabled=false",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
]
LAYOUTS = {
    "fsdp4": ["parallel.dp_shard=4"],
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "fsdp2_tp2_sp": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2_fsdp4_moe": ["model=tiny_moe", "parallel.dp_shard=4", "parallel.ep=2"],
}


def _worker(rank: int, nproc: int, jobs: list, ports: list[int], count: bool) -> None:
    from hydra import compose, initialize_config_module

    from composer3d.commands.train import run
    from composer3d.config.checks import resolve_model_config
    from composer3d.config.registration import register_configs
    from composer3d.launch import distributed
    from composer3d.optim.muon import Muon

    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    sent = {"elements": 0, "calls": 0, "steps": 0}
    found: dict = {}
    if count:
        original_all_to_all, original_step = dist.all_to_all_single, Muon.step

        def all_to_all_single(output, input, *args, **kwargs):
            sent["elements"] += input.numel()
            sent["calls"] += 1
            return original_all_to_all(output, input, *args, **kwargs)

        def step(self, closure=None):
            found["optimizer"] = self
            dist.all_to_all_single = all_to_all_single
            try:
                return original_step(self, closure)
            finally:
                dist.all_to_all_single = original_all_to_all
                sent["steps"] += 1

        Muon.step = step
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        for (name, run_dir, overrides), port in zip(jobs, ports):
            os.environ["MASTER_PORT"] = str(port)
            sent.update(elements=0, calls=0, steps=0)
            cfg = compose(
                "train",
                overrides=[f"launch.nproc_per_node={nproc}", f"run.dir={run_dir}", *overrides],
            )
            resolve_model_config(cfg.model)
            run(cfg, distributed.job_env(), Path(run_dir))
            if count:
                optimizer = found.pop("optimizer")
                result = {
                    **sent,
                    **optimizer.orthogonalizer.work(),
                    "minimum": _minimum(optimizer) if rank == 0 else None,
                }
                Path(run_dir, f"traffic{rank}.json").write_text(json.dumps(result))


def _minimum(optimizer) -> int:
    """Elements a step must move for each matrix gathered once and scattered once: per matrix, the
    owner that needs least (its missing distinct pieces, plus every other holder's piece), from
    every rank's pieces as DTensor places them."""
    total = 0
    for plan in optimizer.orthogonalizer.plans:
        for matrix in plan.matrices:
            distinct = {p.key: p.numel for p in matrix.pieces}
            costs = []
            for owner in {p.rank for p in matrix.pieces} | set(range(plan.size)):
                held = {p.key for p in matrix.pieces if p.rank == owner}
                gather = sum(n for k, n in distinct.items() if k not in held)
                scatter = sum(p.numel for p in matrix.pieces if p.rank != owner)
                costs.append(gather + scatter)
            total += min(costs)
    return total


def _start(jobs: list, nproc: int, count: bool) -> None:
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in jobs]
    multiprocessing.set_forkserver_preload(["torch", "composer3d.commands.train", "hydra"])
    mp.start_processes(
        _worker,
        args=(nproc, jobs, [s.port for s in stores], count),
        nprocs=nproc,
        join=True,
        start_method="forkserver",
    )


def convergence(steps: int, target: float, lrs: list[float], overrides: list[str]) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as root:
        jobs = [
            (
                f"{name} lr {lr:g}",
                str(Path(root) / f"{name}_{lr:g}"),
                [*BASE, f"train.steps={steps}", f"optim.name={name}", f"optim.lr={lr}", *overrides],
            )
            for lr, name in product(lrs, ("adamw", "muon"))
        ]
        _start(jobs, 1, count=False)
        for name, run_dir, _ in jobs:
            lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
            reached = next((r for r in records if r["loss"] <= target), None)
            # the global batch's tokens, as the step logs its throughput
            per_step = round(records[0]["tokens_per_s"] * records[0]["step_time_s"])
            results.append(
                {
                    "run": name,
                    "tokens_to_target": reached["step"] * per_step if reached else None,
                    "last_loss": records[-1]["loss"],
                    "steps": len(records),
                }
            )
    return results


def traffic(nproc: int, steps: int, layouts: list[str], overrides: list[str]) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as root:
        jobs = [
            (
                name,
                str(Path(root) / name),
                [*BASE, f"train.steps={steps}", "optim.name=muon", *layout, *overrides],
            )
            for name, layout in LAYOUTS.items()
            if name in layouts
        ]
        _start(jobs, nproc, count=True)
        for name, run_dir, _ in jobs:
            ranks = [
                json.loads(Path(run_dir, f"traffic{r}.json").read_text()) for r in range(nproc)
            ]
            results.append(
                {
                    "layout": name,
                    "moved_per_step": sum(r["elements"] for r in ranks) / ranks[0]["steps"],
                    "minimum_per_step": ranks[0]["minimum"],
                    "all_to_alls_per_step": ranks[0]["calls"] / ranks[0]["steps"],
                    "gflop_per_rank": [r["flops"] / 1e9 for r in ranks],
                    "even_gflop": [r["even_flops"] / 1e9 for r in ranks],
                }
            )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--target", type=float, default=2.8)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--traffic-steps", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--parts", nargs="+", default=["convergence", "traffic"], choices=["convergence", "traffic"]
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    out: dict = {}
    if "convergence" in args.parts:
        out["convergence"] = convergence(args.steps, args.target, args.lrs, args.overrides)
    if "traffic" in args.parts:
        out["traffic"] = traffic(args.nproc, args.traffic_steps, args.layouts, args.overrides)
    if args.json:
        print(json.dumps(out))
        return
    for r in out.get("convergence", []):
        reached = f"{r['tokens_to_target']:,}" if r["tokens_to_target"] else "not reached"
        print(
            f"{r['run']:<16} tokens to loss {args.target}: {reached:>12}   "
            f"loss after {r['steps']} steps {r['last_loss']:.4f}"
        )
    for r in out.get("traffic", []):
        flops = ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(r["gflop_per_rank"], r["even_gflop"]))
        print(
            f"{r['layout']:<14} elements moved a step {r['moved_per_step']:,.0f} "
            f"(minimum {r['minimum_per_step']:,}; ratio "
            f"{r['moved_per_step'] / r['minimum_per_step']:.3f}) in "
            f"{r['all_to_alls_per_step']:.0f} all-to-alls a rank; Newton–Schulz GFLOP per rank "
            f"/ even share: {flops}"
        )


if __name__ == "__main__":
    main()
