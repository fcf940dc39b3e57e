"""Activation offload (memory.activation_offload), measured beside the same run without it (one
process).

    python benchmarks/activation_offload.py [--models dim2048x16] [--steps 4] [--same-process]

Per model and activation checkpointing mode (none, full; op-level selective compiled with
--compile), without and with offload: the bytes of saved activations that went to host memory in a
step (offload's own counters), the step time, and on an accelerator the device memory the forward
leaves for backward (allocated when the final norm starts, over what was allocated before the step)
and the step's peak. On the CPU the host is the device's memory: nothing is freed there, the bytes
moved and the copies' cost are what it shows. Defaults: the tiny model and a 512-wide one on the
CPU, a 2048-wide 16-layer model at 4096 tokens on an accelerator.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from memory_compile import MODELS as CPU_MODELS
from memory_compile import trainer_for

from composer3d.config.registration import register_configs
from composer3d.launch.distributed import resolve_device

MODELS = {
    **CPU_MODELS,
    "dim2048x16": [
        "model=tiny",
        "model.dim=2048",
        "model.n_layers=16",
        "model.n_heads=16",
        "model.n_kv_heads=8",
        "train.seq_len=4096",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
    ],
}
MODES = {
    "none": [],
    "full": ["memory.activation_checkpointing=full"],
    "selective (op), compiled": [
        "memory.activation_checkpointing=selective",
        "compile.enabled=true",
    ],
}


def measure(overrides: list[str], steps: int) -> dict:
    trainer = trainer_for(overrides)
    device = trainer.device
    accelerator = device.type != "cpu"
    before, held, times = [0], [], []

    def at_the_head(module, inputs):  # every block's forward done, no backward begun
        if accelerator:
            torch.accelerator.synchronize()
            held.append(torch.accelerator.memory_allocated(device) - before[0])

    trainer.model.norm.register_forward_pre_hook(at_the_head)
    offload = getattr(trainer.model, "activation_offload", None)
    for _ in range(steps + 2):  # the first two: compilation, allocator warm-up
        if offload is not None:
            offload.reset()
        if accelerator:
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats(device)
            before[0] = torch.accelerator.memory_allocated(device)
        start = time.perf_counter()
        trainer.train_step()
        trainer.zero_grad()
        if accelerator:
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return {
        "step_s": statistics.mean(times[2:]),
        "offloaded_bytes": offload.counters.bytes_offloaded if offload is not None else 0,
        "held_bytes": held[-1] if held else None,
        "peak_bytes": torch.accelerator.max_memory_allocated(device) - before[0]
        if accelerator
        else None,
    }


def in_fresh_process(overrides: list[str], steps: int, same_process: bool) -> dict:
    """Each measurement in its own process (compiled graphs and the allocator's state must not carry
    over)."""
    if same_process:
        return _run(overrides, steps)
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run, (overrides, steps))


def _run(overrides: list[str], steps: int) -> dict:
    register_configs()
    dist.init_process_group(
        dist.get_default_backend_for_device(resolve_device("auto")),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
    )
    try:
        return measure(overrides, steps)
    finally:
        dist.destroy_process_group()


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    accelerator = resolve_device("auto").type != "cpu"
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=["dim2048x16"] if accelerator else ["tiny", "dim512x8"],
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--compile", action="store_true", help="also op-level selective checkpointing, compiled"
    )
    parser.add_argument(
        "--same-process", action="store_true", help="everything in this process (a smoke run)"
    )
    args = parser.parse_args()
    run = partial(in_fresh_process, steps=args.steps, same_process=args.same_process)
    modes = [m for m in MODES if args.compile or "compiled" not in m]
    for name in args.models:
        print(f"== {name}")
        for mode in modes:
            plain = run(MODELS[name] + MODES[mode])
            moved = run(MODELS[name] + MODES[mode] + ["memory.activation_offload=true"])
            print(
                f"  checkpointing {mode:<25} offloaded {_mib(moved['offloaded_bytes']):>10} a "
                "step; "
                f"held for backward {_mib(plain['held_bytes'])} -> {_mib(moved['held_bytes'])}; "
                f"peak {_mib(plain['peak_bytes'])} -> {_mib(moved['peak_bytes'])}; "
                f"step {plain['step_s']:.3f} -> {moved['step_s']:.3f} s"
            )


if __name__ == "__main__":
    main()
