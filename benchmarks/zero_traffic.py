"""Data-parallel traffic per step, per collective, against the ZeRO paper's 2Φ(N−1)/N.

    python benchmarks/zero_traffic.py [--nproc 4] [--steps 3]
                                      [--modes zero1 zero2 zero3 ddp zero1_ep] [--json]
                                      [-- hydra overrides,
                                          e.g. precision.reduce_dtype=bfloat16 model=tiny]

Trains a few steps of each data-parallel mode on ``nproc`` gloo ranks of this machine (the real
trainer, through ``composer3d.commands.train.run``) and counts every collective the training steps
issue (``torch.distributed``'s functions wrapped; the start-up, logging and checkpoints outside the
steps are not counted). Bytes are what each rank sends under the ring algorithms: (N−1)/N of the
whole buffer for a reduce-scatter or an all-gather, 2(N−1)/N for an all-reduce (N the ranks of its
group). Φ is the parameters' bytes: Φ_r in ``precision.reduce_dtype`` (what the gradients travel
in), Φ_p in ``precision.param_dtype`` (what the all-gathers carry: FSDP's mixed precision and
ZeRO-1's gather alike; fp32 on the CPU by default). A reduce-scatter plus an all-gather move (Φ_r +
Φ_p)(N−1)/N — 2Φ(N−1)/N when both dtypes agree (bf16 and bf16: 2 + 2 bytes an element); ZeRO-3
gathers twice. ``zero1_ep``: ZeRO-1 under expert parallel (``model=tiny_moe``, ep 2): the routed
experts' buckets over the ranks holding the same experts (M of them), the rest over all N: 2Φ(N−1)/N
is then the sum over the two groups, 2Φ_dense(N−1)/N + 2Φ_experts(M−1)/M, Φ_experts a rank's own
experts. Counts cover the data-parallel collectives (torch.distributed's); tensor parallel's DTensor
collectives are not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = {
    "zero1": ["parallel.zero_stage=1"],
    "zero2": ["parallel.zero_stage=2"],
    "zero3": ["parallel.zero_stage=3"],
    "ddp": ["parallel.dp_replicate={nproc}", "parallel.dp_shard=1"],
    "zero1_ep": ["model=tiny_moe", "parallel.zero_stage=1", "parallel.ep=2"],
}
# what each collective's buffer is: its input (reductions) or its output (gathers), and how much of
# it a rank sends
COLLECTIVES = {
    "all_reduce": ("tensor", 0, 2.0),
    "broadcast": ("tensor", 0, 1.0),
    "reduce_scatter_tensor": ("input", 1, 1.0),
    "reduce_scatter_single": ("input", 1, 1.0),
    "all_gather_into_tensor": ("output_tensor", 0, 1.0),
    "all_gather_single": ("output_tensor", 0, 1.0),
}


class CollectiveCounter:
    """Wraps ``torch.distributed``'s collectives: calls and bytes sent per collective while
    ``counting`` is set. A collective that calls another (old names forwarding to new ones) is
    counted once, as the outer one."""

    def __init__(self):
        self.counting = False
        self._depth = 0
        self.reset()
        for name, (keyword, position, ring) in COLLECTIVES.items():
            if hasattr(dist, name):
                setattr(
                    dist, name, self._wrapped(name, getattr(dist, name), keyword, position, ring)
                )

    def reset(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.sent: dict[str, float] = defaultdict(float)  # bytes this rank sends (ring algorithms)
        self.buffer: dict[str, int] = defaultdict(int)  # bytes of the whole buffers
        self.dtypes: dict[str, set] = defaultdict(set)
        self.events: list[
            tuple[str, int]
        ] = []  # (collective, buffer bytes) in call order, for tests of order

    def _wrapped(self, name, original, keyword, position, ring):
        def collective(*args, **kwargs):
            outer = self._depth == 0
            self._depth += 1
            try:
                if outer and self.counting:
                    self._count(
                        name,
                        kwargs.get(keyword, args[position] if len(args) > position else None),
                        kwargs.get("group", None),
                        ring,
                    )
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return collective

    def _count(self, name, tensor, group, ring) -> None:
        ranks = dist.get_world_size(group)
        key = name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")
        size = tensor.numel() * tensor.element_size()
        self.calls[key] += 1
        self.buffer[key] += size
        self.sent[key] += ring * size * (ranks - 1) / ranks
        self.dtypes[key].add(str(tensor.dtype).removeprefix("torch."))
        self.events.append((key, size))

    def summary(self, steps: int) -> dict:
        return {
            key: {
                "calls_per_step": self.calls[key] / steps,
                "sent_bytes_per_step": self.sent[key] / steps,
                "buffer_bytes_per_step": self.buffer[key] / steps,
                "dtypes": sorted(self.dtypes[key]),
            }
            for key in sorted(self.calls)
        }


def expected_sent_bytes(
    mode: str, groups: list[tuple[int, int]], reduce_bytes: int, param_bytes: int
) -> float | None:
    """The ZeRO paper's bytes a rank sends per step: reduce-scatter + all-gather (ZeRO-1/2),
    all-reduce (DDP), over ``groups`` ((ranks, parameters) each: every parameter over all ranks, but
    ZeRO-1's experts under ep). None for ZeRO-3: its blocks gather again in the backward, its root
    (embedding, norm, head) stays gathered, so it sends between (Φ_r + Φ_p) and (Φ_r + 2Φ_p) times
    (N−1)/N."""
    per_element = {
        "zero1": reduce_bytes + param_bytes,
        "zero1_ep": reduce_bytes + param_bytes,
        "zero2": reduce_bytes + param_bytes,
        "ddp": 2 * reduce_bytes,
    }.get(mode)
    return (
        None
        if per_element is None
        else sum(params * per_element * (n - 1) / n for n, params in groups)
    )


def _worker(
    rank: int, nproc: int, jobs: list[tuple[str, str, list[str]]], ports: list[int], steps: int
) -> None:
    from hydra import compose, initialize_config_module

    from composer3d.commands.train import run
    from composer3d.config.checks import resolve_model_config
    from composer3d.config.registration import register_configs
    from composer3d.launch import distributed
    from composer3d.parallel.data_parallel.zero_buckets import local
    from composer3d.training.trainer import Trainer

    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    counter = CollectiveCounter()
    train_step = Trainer.train_step
    zero1_groups = []  # ZeRO-1's sets of buckets: (ranks, this rank's parameters' elements) each

    def counted_step(self):
        counter.counting = True
        try:
            return train_step(self)
        finally:
            counter.counting = False
            if self.sharder:
                zero1_groups[:] = [
                    (buckets.ranks, sum(local(p).numel() for p in buckets.params))
                    for buckets, _ in self.sharder.parts
                ]

    Trainer.train_step = counted_step
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        for (mode, run_dir, overrides), port in zip(jobs, ports):
            os.environ["MASTER_PORT"] = str(port)
            counter.reset()
            zero1_groups.clear()
            cfg = compose(
                "train",
                overrides=[
                    f"launch.nproc_per_node={nproc}",
                    f"run.dir={run_dir}",
                    f"train.steps={steps}",
                    *overrides,
                ],
            )
            resolve_model_config(cfg.model)
            run(cfg, distributed.job_env(), Path(run_dir))
            if rank == 0:
                info = json.loads((Path(run_dir) / "run.json").read_text())
                result = {
                    "mode": mode,
                    "ranks": nproc,
                    "params": info["num_params"],
                    "reduce_dtype": cfg.precision.reduce_dtype,
                    "param_dtype": cfg.precision.param_dtype,
                    "collectives": counter.summary(steps),
                    "groups": zero1_groups or [(nproc, info["num_params"])],
                }
                (Path(run_dir) / "traffic.json").write_text(json.dumps(result))


def measure(modes: list[str], nproc: int, steps: int, overrides: list[str]) -> list[dict]:
    """Each mode's counts (rank 0's: data-parallel traffic is the same on every rank)."""
    base = [
        "data.name=synthetic",
        "train.seq_len=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "logging.progress_bar=false",
        "launch.device=cpu",
        "checkpoint.enabled=false",
    ]
    named = any(o.startswith("model=") for o in overrides)

    def job(mode: str) -> list[str]:
        mine = [
            o.format(nproc=nproc) for o in MODES[mode] if not (named and o.startswith("model="))
        ]
        model = [] if named or any(o.startswith("model=") for o in mine) else ["model=tiny"]
        return [*model, *base, *mine, *overrides]

    with tempfile.TemporaryDirectory() as root:
        jobs = [(mode, str(Path(root) / mode), job(mode)) for mode in modes]
        stores = [
            dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in jobs
        ]
        # forked from one server that imported torch and composer3d once, not each rank importing
        # them anew
        multiprocessing.set_forkserver_preload(
            ["torch", "torch.distributed.fsdp", "composer3d.commands.train", "hydra"]
        )
        mp.start_processes(
            _worker,
            args=(nproc, jobs, [s.port for s in stores], steps),
            nprocs=nproc,
            join=True,
            start_method="forkserver",
        )
        return [json.loads((Path(run_dir) / "traffic.json").read_text()) for _, run_dir, _ in jobs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args(argv)
    results = measure(args.modes, args.nproc, args.steps, args.overrides)
    for r in results:
        itemsize = {
            name: torch.empty(0, dtype=getattr(torch, name)).element_size()
            for name in (r["reduce_dtype"], r["param_dtype"])
        }
        r["zero_paper_bytes"] = sum(
            2 * params * itemsize[r["reduce_dtype"]] * (n - 1) / n for n, params in r["groups"]
        )
        r["expected_bytes"] = expected_sent_bytes(
            r["mode"], r["groups"], itemsize[r["reduce_dtype"]], itemsize[r["param_dtype"]]
        )
        r["sent_bytes_per_step"] = sum(c["sent_bytes_per_step"] for c in r["collectives"].values())
    if args.json:  # one line, the last: the workers' logs go to the same stdout
        print(json.dumps(results))
        return
    print(
        f"bytes each rank sends per step on {args.nproc} gloo ranks (ring algorithms), against "
        "2Φ(N−1)/N in the "
        "reduce dtype (each mode's parameters; zero1_ep: summed over its two groups)"
    )
    print(
        f"{'mode':8} {'collective':15} {'calls':>6} {'dtypes':18} {'sent bytes':>12} "
        f"{'/ 2Φ(N−1)/N':>12}"
    )
    for r in results:
        groups = ", ".join(f"{params:,} over {n}" for n, params in r["groups"])
        print(f"{r['mode']:8} parameters {groups}: 2Φ(N−1)/N = {r['zero_paper_bytes']:,.0f}")
        for key, c in r["collectives"].items():
            print(
                f"{r['mode']:8} {key:15} {c['calls_per_step']:6.1f} {','.join(c['dtypes']):18} "
                f"{c['sent_bytes_per_step']:12,.0f} "
                f"{c['sent_bytes_per_step'] / r['zero_paper_bytes']:12.4f}"
            )
        expected = r["expected_bytes"]
        print(
            f"{r['mode']:8} {'total':15} {'':6} {'':18} {r['sent_bytes_per_step']:12,.0f} "
            f"{r['sent_bytes_per_step'] / r['zero_paper_bytes']:12.4f}  "
            + (
                f"(expected {expected / r['zero_paper_bytes']:.4f})"
                if expected
                else "(blocks gathered twice, the root once)"
            )
        )


if __name__ == "__main__":
    sys.exit(main())
