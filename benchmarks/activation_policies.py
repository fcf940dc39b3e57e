"""Activation checkpointing policies side by side (memory.activation_checkpointing,
memory.ac_policy), one process, CPU or accelerator.

    python benchmarks/activation_policies.py [--models tiny dim512x8] [--steps 4] [--compile]
                                             [--same-process]

Per model, for no checkpointing, op-level selective with each policy (all_matmuls: every matmul's
output kept; alternate_matmuls: every other one's, torchtitan's) and full checkpointing, one row
each:
  - peak activations: the activations at a step's peak memory by torch's memory tracker
    (``FSDPMemTracker``, tensors by category: the same bytes on any device, what selective
    checkpointing keeps in its own cache included; the logits' gradient, which the loss writes over
    them, counts as theirs);
  - kept after forward: the tracker's activations as the model's forward returns: what the policy
    keeps for backward, and the logits;
  - step time: mean over --steps steps after two warm-up steps, eager, and compiled with --compile;
  - on an accelerator, the step's peak allocated device memory (``torch.accelerator``); '-' on the
    CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from memory_compile import MODELS, in_fresh_process, trainer_for
from torch.distributed._tools.mem_tracker import _ModState

from composer3d.launch.distributed import is_accelerator
from composer3d.training.metrics import memory_breakdown

SELECTIVE = ["memory.activation_checkpointing=selective", "memory.ac_every=0"]
POLICIES = {
    "none": [],
    "selective all_matmuls": [*SELECTIVE, "memory.ac_policy=all_matmuls"],
    "selective alternate_matmuls": [*SELECTIVE, "memory.ac_policy=alternate_matmuls"],
    "full": ["memory.activation_checkpointing=full"],
}


def measure(overrides: list[str], steps: int) -> tuple[int, int, float, int | None]:
    """(peak activation bytes of a step, mean step seconds after two warm-up steps (compilation),
    the peak device memory of the last timed step), from one trainer."""
    trainer = trainer_for(overrides)
    accelerator = is_accelerator(trainer.device)
    times, peak = [], None
    for _ in range(steps + 2):
        if accelerator:
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.train_step()
        trainer.zero_grad()
        if accelerator:
            torch.accelerator.synchronize()
            peak = torch.accelerator.max_memory_allocated()
        times.append(time.perf_counter() - start)
    # The tracker logging.memory_breakdown uses, over one more step (optimizer state exists, as in
    # steady state)
    with memory_breakdown(trainer.model, trainer.optimizer) as (peaks, trainer.memory_tracker):
        trainer.train_step()
    forward_end = trainer.memory_tracker.memory_tracking[trainer.model].snapshots[
        _ModState.POST_FW
    ][-1]
    kept = sum(
        v
        for categories in forward_end.values()
        for k, v in categories.items()
        if str(k).endswith("ACT")
    )
    trainer.memory_tracker = None
    return peaks["ACT"], kept, statistics.mean(times[2:]), peak


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--compile", action="store_true", help="also time each policy with compile.enabled=true"
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="measure everything in this process (a smoke run; the numbers may leak into each "
        "other)",
    )
    args = parser.parse_args()
    run = partial(in_fresh_process, same_process=args.same_process)
    mib = 2**20
    for name in args.models:
        print(f"== {name}")
        print(
            f"  {'policy':<28} {'peak activations MiB':>20} {'kept after forward MiB':>22} "
            f"{'step s':>8} "
            f"{'compiled s':>10} {'peak device MiB':>15}"
        )
        for label, policy in POLICIES.items():
            overrides = MODELS[name] + policy
            activations, kept, seconds, peak = run(measure, overrides, args.steps)
            compiled = (
                run(measure, overrides + ["compile.enabled=true"], args.steps)[2]
                if args.compile
                else None
            )
            print(
                f"  {label:<28} {activations / mib:>20.3f} {kept / mib:>22.3f} {seconds:>8.3f} "
                f"{'-' if compiled is None else f'{compiled:.3f}':>10} "
                f"{'-' if peak is None else f'{peak / mib:.1f}':>15}"
            )


if __name__ == "__main__":
    main()
