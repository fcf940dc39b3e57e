"""composer3d's training step next to a plain PyTorch training loop on the same model, side by side
in one process.

    python benchmarks/throughput.py [--shape cpu|1b] [--device auto|cpu|cuda|…] [--steps 20]
                                    [--warmup 3] [--rounds 3] [--compile] [--json]

Both sides train composer3d's native Llama (``composer3d.models.llama.Llama``) on random tokens:
  - composer3d: a world-size-1 Trainer built in-process from the Hydra config (``data=synthetic``),
    timing ``trainer.train_step(); trainer.zero_grad()``;
  - plain: the model built directly on the device, bf16 autocast on accelerators (fp32 on the CPU),
    AdamW with fused kernels where the device has them, ``clip_grad_norm_`` at composer3d's
    ``train.grad_clip``, batches pre-built on the device; ``--compile`` compiles each block and the
    loss.
Each timed step ends with one device synchronization (none on the CPU); the plain loop waits on the
device nowhere else, composer3d's step runs as it is. The sides run alternately in rounds (order
swapped every round, each side built afresh per round, building untimed) so that load from other
processes on a shared machine hits both alike. For each side: median and minimum step time over all
rounds, tokens/s, TFLOP/s (6·N + 12·L·H·Q·T per token, N without the embedding table), MFU where the
device's peak is known, peak memory (accelerators only); then the composer3d/plain ratios.

Shapes: ``cpu`` (default on the CPU): dim 128, 4 layers, 4 heads, vocab 256, seq 128, batch 8.
``1b`` (default on accelerators): Llama-3.2-1B dims with an untied head, seq 8192, micro-batch 1.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from composer3d.config.registration import register_configs
from composer3d.data import build_sequences
from composer3d.launch import distributed
from composer3d.launch.rank import prepare_rank
from composer3d.models.llama import Llama
from composer3d.parallel.mesh import Layout, ParallelMesh
from composer3d.training.flops import embedding_params, flops_per_token, peak_flops
from composer3d.training.trainer import Trainer

SHAPES = {
    "cpu": [
        "model=tiny",
        "model.dim=128",
        "model.n_layers=4",
        "model.n_heads=4",
        "model.n_kv_heads=4",
        "model.vocab_size=256",
        "train.seq_len=128",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
    ],
    "1b": [
        "model=llama3_1b",
        "model.tie_embeddings=false",
        "model.ffn_hidden_dim=8192",
        "train.seq_len=8192",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
    ],
}
SIDES = ("composer3d", "plain")
NOISY_SPREAD = 1.25  # median / minimum step time above which the table warns of other load


def build_config(
    shape: str, device: str, compile_: bool, overrides: Sequence[str] = ()
) -> tuple[DictConfig, dict, torch.device]:
    """The run's config as composer3d-train would resolve it (the layout for one rank, device,
    compute dtype)."""
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train",
            overrides=[
                "data=synthetic",
                "run.dir=unused",
                "checkpoint.enabled=false",
                "logging.progress_bar=false",
                f"launch.device={device}",
                f"compile.enabled={str(compile_).lower()}",
                *SHAPES[shape],
                *overrides,
            ],
        )
    layout, resolved = prepare_rank(cfg, None)
    return cfg, layout, resolved


@contextmanager
def one_rank(
    cfg: DictConfig, layout: Layout, device: torch.device
) -> Iterator[tuple[ParallelMesh, object]]:
    """(mesh, sequences) for a one-rank Trainer, inside the (one-rank) process group it needs."""
    distributed.init_process_group(device, None)
    try:
        yield (
            ParallelMesh(layout, device.type),
            build_sequences(
                cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model
            ),
        )
    finally:
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


# ------------------------------------------------------------------------------------ the two sides


def build_composer3d(
    cfg: DictConfig, mesh: ParallelMesh, device: torch.device, sequences
) -> Callable[[], None]:
    trainer = Trainer(cfg, mesh, device, sequences)

    def step() -> None:
        trainer.train_step()
        trainer.zero_grad()

    return step


def init_weights(model: nn.Module, std: float) -> None:
    """Normal matrices, unit norm weights: the values do not matter for speed, only that they are
    finite."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=std)
            else:
                nn.init.ones_(p)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def build_plain(cfg: DictConfig, device: torch.device) -> Callable[[], None]:
    """The loop a careful engineer writes by hand for the same model, batch and optimizer
    settings."""
    with torch.device("meta"):  # allocate once, on the device, without a throwaway CPU init
        model = Llama(cfg.model)
    model.to_empty(device=device)
    init_weights(model, cfg.model.init_std)
    model.init_buffers(device)
    loss_fn = cross_entropy
    if cfg.compile.enabled:
        for block in model.layers.values():
            block.compile()
        loss_fn = torch.compile(cross_entropy)
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=device.type in _get_fused_kernels_supported_devices(),
    )
    t = cfg.train
    tokens = torch.randint(
        cfg.model.vocab_size, (4, t.micro_batch_size, t.seq_len + 1), device=device
    )
    batches = itertools.cycle([(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in tokens])
    params = list(model.parameters())

    def step() -> None:
        inputs, targets = next(batches)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type != "cpu"):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# -------------------------------------------------------------------------------------- measurement


def measure(
    build: Callable[[], Callable[[], None]], device: torch.device, warmup: int, steps: int
) -> tuple[list[float], int | None]:
    """Step times of a freshly built side after ``warmup`` steps, and its peak memory (None on the
    CPU).

    Built afresh every round and dropped after it, so the two sides never share device memory (at
    the 1b shape each holds ~24 GB of weights and AdamW state) and each peak is that side's own;
    building is not timed.
    """
    step = build()
    for _ in range(warmup):  # compilation, optimizer state allocation
        step()
    synchronize(device)
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.accelerator.max_memory_allocated() if device.type != "cpu" else None
    del step
    # a trainer can hold reference cycles (FSDP's hooks): free it before the other side builds
    gc.collect()
    return times, peak


def model_flops_per_token(cfg: DictConfig) -> int:
    """composer3d's convention (``composer3d.training.flops``: 6·N + 12·L·H·Q·T) for the model both
    sides train."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    attention_width = model.layers[
        "0"
    ].attention.wq.out_features  # H·Q, whatever the config spells out
    return flops_per_token(
        sum(p.numel() for p in model.parameters()),
        embedding_params(model),
        cfg.model.n_layers,
        attention_width,
        cfg.train.seq_len,
    )


def summary(
    times: list[float], peak_mem: int | None, tokens_per_step: int, flops: int, peak: float | None
) -> dict:
    median = statistics.median(times)
    tokens_per_s = tokens_per_step / median
    tflops = tokens_per_s * flops / 1e12
    return {
        "step_time_s_median": median,
        "step_time_s_min": min(times),
        "tokens_per_s": tokens_per_s,
        "tflops_per_s": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
        "peak_mem_bytes": peak_mem,
    }


def print_table(result: dict) -> None:
    print(
        f"composer3d vs plain PyTorch: shape {result['shape']} on {result['device']} (torch "
        f"{result['torch_version']}, "
        f"{result['threads']} threads, {'compiled' if result['compile'] else 'eager'}), "
        f"{result['rounds']} rounds "
        f"x {result['steps']} steps after {result['warmup']} warmup, {result['tokens_per_step']} "
        "tokens/step"
    )
    print(
        f"{'side':<11} {'median s':>9} {'min s':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'peak mem':>10}"
    )
    for side in SIDES:
        r = result[side]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_bytes'] / 2**30:.2f} GiB" if r["peak_mem_bytes"] is not None else "-"
        print(
            f"{side:<11} {r['step_time_s_median']:9.4f} {r['step_time_s_min']:9.4f} "
            f"{r['tokens_per_s']:10.0f} "
            f"{r['tflops_per_s']:8.3f} {mfu:>6} {mem:>10}"
        )
    print(
        f"composer3d/plain: step time {result['ratio_step_time']:.3f}x (minimums "
        f"{result['ratio_step_time_min']:.3f}x), "
        f"tokens/s {result['ratio_tokens_per_s']:.3f}x"
    )
    spread = max(
        result[side]["step_time_s_median"] / result[side]["step_time_s_min"] for side in SIDES
    )
    if spread > NOISY_SPREAD:  # a busy machine: oversubscribed threads stall whole steps
        print(
            f"note: a median step is up to {spread:.1f}x the fastest one: other processes are "
            "using the cores; "
            "compare the minimums, or rerun with fewer threads (OMP_NUM_THREADS=1)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="auto", help="auto: the machine's accelerator, else the CPU"
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="default: cpu on the CPU, 1b on an accelerator"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile per block on both sides"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    args = parser.parse_args()

    # the device not touched yet
    default_shape = "cpu" if distributed.device_type(args.device) == "cpu" else "1b"
    shape = args.shape or default_shape
    cfg, layout, device = build_config(shape, args.device, args.compile)
    with one_rank(cfg, layout, device) as (mesh, sequences):
        builders = {
            "composer3d": lambda: build_composer3d(cfg, mesh, device, sequences),
            "plain": lambda: build_plain(cfg, device),
        }
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        peaks: dict[str, list[int]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            # swap the order: drift hits both sides alike
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                print(f"round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                side_times, peak = measure(builders[side], device, args.warmup, args.steps)
                times[side] += side_times
                if peak is not None:
                    peaks[side].append(peak)

    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    flops, peak = model_flops_per_token(cfg), peak_flops(device, cfg.precision.param_dtype)
    result = {
        "device": str(device),
        "torch_version": torch.__version__,
        "shape": shape,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops,
        "peak_flops": peak,
    }
    for side in SIDES:
        result[side] = summary(
            times[side], max(peaks[side], default=None), tokens_per_step, flops, peak
        )
    result["ratio_step_time"] = (
        result["composer3d"]["step_time_s_median"] / result["plain"]["step_time_s_median"]
    )
    result["ratio_step_time_min"] = (
        result["composer3d"]["step_time_s_min"] / result["plain"]["step_time_s_min"]
    )
    result["ratio_tokens_per_s"] = (
        result["composer3d"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    )
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
