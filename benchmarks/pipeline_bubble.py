"""Pipeline bubble and activation memory per schedule, measured side by side in one run.

    python benchmarks/pipeline_bubble.py [--pp 2] [--microbatches 8] [--steps 3] [--dim 256]
                                         [--layers 8] [--device auto]

For each schedule it trains a few steps of a Llama-shaped model with ``parallel.pp`` ranks (gloo on
CPU, or the accelerator if there is one) and reports, per rank:
  - idle fraction: 1 − (time inside stage compute: forward, backward, weight-grad chunks) / (time of
    the step), next to the theory (P−1)/(v·M) of the bubble relative to compute (P ranks, v stages
    per rank, M microbatches);
  - peak activation memory: the most bytes of tensors saved for backward alive at once on the rank
    (tracked with autograd's saved-tensor hooks, so it works on CPU where there are no device memory
    counters).
The first step is warm-up and not counted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = [
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv",
    "dualpipev",
]


class SavedTensorMeter:
    """Bytes of distinct storages autograd holds for backward, and their peak."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.live:
            self.live[key] = storage.nbytes()
            self.peak = max(self.peak, sum(self.live.values()))
        self.refs[key] = self.refs.get(key, 0) + 1
        holder = _Holder(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key], self.live[key]

    @contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor):
            yield


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _instrument(stage, busy: list[float]) -> None:
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(stage, name, None)
        if original is None:
            continue

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                busy.append(time.perf_counter() - start)

        setattr(stage, name, timed)


def _worker(rank: int, world: int, store: str, schedule: str, args, results):
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
    )
    from hydra import compose, initialize_config_module

    from composer3d.config.registration import register_configs
    from composer3d.data import build_sequences
    from composer3d.launch.distributed import Env, shut_down
    from composer3d.launch.rank import prepare_rank
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.trainer import Trainer

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train",
            overrides=[
                "data=synthetic",
                f"model.dim={args.dim}",
                f"model.n_layers={args.layers}",
                "model.n_heads=8",
                "model.n_kv_heads=8",
                "train.seq_len=256",
                f"train.global_batch_size={args.microbatches}",
                "train.micro_batch_size=1",
                f"parallel.pp={world}",
                f"parallel.pp_schedule={schedule}",
                "run.dir=unused",
                "checkpoint.enabled=false",
                f"launch.device={args.device}",
            ],
        )
    # validates; resolves the device and dtype
    layout, device = prepare_rank(cfg, Env(rank, rank, world))
    dist.init_process_group(
        dist.get_default_backend_for_device(device),
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
    )
    trainer = Trainer(
        cfg,
        ParallelMesh(layout, device.type),
        device,
        build_sequences(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, 0),
    )
    busy: list[float] = []
    stages = getattr(trainer.pipeline, "_stages", None) or [
        trainer.pipeline._stage
    ]  # multi- or single-stage
    for stage in stages:
        _instrument(stage, busy)
    meter = SavedTensorMeter()
    idle = []
    for step in range(args.steps + 1):
        busy.clear()
        dist.barrier()
        start = time.perf_counter()
        with meter.track():
            trainer.train_step()
        elapsed = time.perf_counter() - start
        trainer.zero_grad()
        if step > 0:  # warm-up: shape inference, lazy init
            idle.append(1 - sum(busy) / elapsed)
    results[(schedule, rank)] = (sum(idle) / len(idle), meter.peak, len(stages))
    shut_down(finished=True)  # collect and wait first: gloo can abort at exit otherwise


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--schedules", nargs="*", default=SCHEDULES)
    parser.add_argument(
        "--device", default="auto", help="auto: one accelerator per rank where there are, else CPU"
    )
    args = parser.parse_args()
    results = mp.Manager().dict()
    for schedule in args.schedules:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(
                _worker,
                args=(args.pp, f"{tmp}/store", schedule, args, results),
                nprocs=args.pp,
                join=True,
            )
    P, M = args.pp, args.microbatches
    print(f"pp={P}, microbatches={M}, model dim {args.dim} × {args.layers} layers, seq 256")
    print(
        f"{'schedule':<26}{'v':>3}{'theory (P-1)/(vM)':>19}{'idle fraction per rank':>32}"
        f"{'peak saved activations MiB':>36}"
    )
    for schedule in args.schedules:
        rows = [results[(schedule, r)] for r in range(P)]
        v = rows[0][2]
        idle = " ".join(f"{row[0]:.3f}" for row in rows)
        memory = " ".join(f"{row[1] / 2**20:.1f}" for row in rows)
        print(f"{schedule:<26}{v:>3}{(P - 1) / (v * M):>19.3f}{idle:>32}{memory:>36}")


if __name__ == "__main__":
    main()
