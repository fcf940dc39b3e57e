"""Effect of the memory switches, measured side by side in one run (one process, CPU or
accelerator).

    python benchmarks/memory_compile.py [--steps 4] [--models tiny dim512x8] [--same-process]

For the tiny model and a larger CPU-feasible one (dim 512, 8 layers, seq 256) it prints
  - peak activation memory with activation checkpointing none / selective (op-level) / selective
    (every 2nd block) / full — torch's FSDP memory tracker (``FSDPMemTracker``: tensors by category,
    works on CPU);
  - model-state bytes (params + grads + optimizer state) with adamw vs adamw_8bit;
  - mean step time without and with ``compile.enabled`` (first steps excluded: compilation), with
    activation checkpointing none / selective (op-level) / full: compiled, selective should cost
    about what none does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch.distributed as dist
import torch.multiprocessing as mp
from hydra import compose, initialize_config_module

from composer3d.config.checks import validate
from composer3d.config.registration import register_configs
from composer3d.data import build_sequences
from composer3d.launch.distributed import resolve_device
from composer3d.parallel.mesh import ParallelMesh
from composer3d.training.metrics import memory_breakdown, model_state_bytes
from composer3d.training.trainer import Trainer

MODELS = {
    "tiny": [
        "model=tiny",
        "train.seq_len=128",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
    ],
    "dim512x8": [
        "model=tiny",
        "model.dim=512",
        "model.n_layers=8",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        "train.seq_len=256",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
    ],
}


def trainer_for(overrides: list[str]) -> Trainer:
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train",
            overrides=["data=synthetic", "run.dir=unused", "checkpoint.enabled=false", *overrides],
        )
    layout = validate(cfg, 1)
    device = resolve_device("auto")
    cfg.precision.param_dtype = "float32" if device.type == "cpu" else "bfloat16"
    sequences = build_sequences(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, 0)
    return Trainer(cfg, ParallelMesh(layout, device.type), device, sequences)


def peak_activation_bytes(overrides: list[str]) -> int:
    trainer = trainer_for(overrides)
    trainer.train_step()  # optimizer state exists, like in a steady-state step
    trainer.zero_grad()
    # The tracker training's logging.memory_breakdown uses: FSDP's for a sharded model, the plain
    # one where FSDP does not run (one rank has no data-parallel dim, so no FSDP since the
    # step-overhead change).
    with memory_breakdown(trainer.model, trainer.optimizer) as (peaks, trainer.memory_tracker):
        trainer.train_step()
    trainer.memory_tracker = None
    trainer.zero_grad()
    return peaks["ACT"]


def state_bytes(overrides: list[str]) -> int:
    trainer = trainer_for(overrides)
    trainer.train_step()
    return model_state_bytes(trainer.model, trainer.optimizer)


def step_seconds(overrides: list[str], steps: int) -> float:
    trainer = trainer_for(overrides)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        trainer.train_step()
        trainer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.mean(times[2:])


def in_fresh_process(fn, *args, same_process: bool = False):
    """Each measurement in its own process: compiled graphs (ours, torchao's optimizer step) and
    allocator state of one model must not leak into the next. ``same_process``: all in this one (a
    quick smoke run)."""
    if same_process:
        return _run(fn, *args)
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run, (fn, *args))


def _run(fn, *args):
    """``fn(*args)`` in a one-rank process group (a module-level function: the pool pickles it by
    name)."""
    register_configs()
    dist.init_process_group(
        dist.get_default_backend_for_device(resolve_device("auto")),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
    )
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="measure everything in this process (a smoke run; the numbers may leak into each "
        "other)",
    )
    args = parser.parse_args()
    measure = partial(in_fresh_process, same_process=args.same_process)
    mib = 2**20
    for name in args.models:
        model = MODELS[name]
        print(f"== {name}")
        for label, ac in (
            ("none", []),
            ("selective (op)", ["memory.activation_checkpointing=selective"]),
            (
                "selective (every 2nd)",
                ["memory.activation_checkpointing=selective", "memory.ac_every=2"],
            ),
            ("full", ["memory.activation_checkpointing=full"]),
        ):
            print(
                f"  activation checkpointing {label:<22} peak activations "
                f"{measure(peak_activation_bytes, model + ac) / mib:8.1f} MiB"
            )
        for opt in ("adamw", "adamw_8bit"):
            print(
                f"  optimizer {opt:<11} model state "
                f"{measure(state_bytes, model + [f'optim.name={opt}']) / mib:8.2f} MiB"
            )
        for label, ac in (
            ("none", []),
            ("selective (op)", ["memory.activation_checkpointing=selective"]),
            ("full", ["memory.activation_checkpointing=full"]),
        ):
            plain = measure(step_seconds, model + ac, args.steps)
            compiled = measure(step_seconds, model + ac + ["compile.enabled=true"], args.steps)
            print(
                f"  step time, checkpointing {label:<15} eager {plain:.3f} s, compiled "
                f"{compiled:.3f} s "
                f"(ratio {compiled / plain:.2f})"
            )


if __name__ == "__main__":
    main()
