"""Where a training step's peak device memory is, by the site that allocated it (issue 29: memory ≤
torchtitan).

    python benchmarks/memory_peak.py [--shape cpu|1b] [--device auto|cuda|…] [--compile] [--steps 3]
                                     [--top 20] [OVERRIDE ...]

Builds a world-size-1 Trainer as ``benchmarks/step_profile.py`` does (extra Hydra overrides such as
``memory.activation_checkpointing=selective`` go at the end) and runs --steps steps (the first makes
AdamW's moments, so a later step's peak is the one every step reaches) while the CUDA caching
allocator records each allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``). The trace is then replayed to the moment the most
bytes were allocated, and what was live there is printed by allocation site (the innermost frame,
and the innermost of composer3d's), with the allocations that led up to it. The replayed peak
matches ``max_memory_allocated``; the reserved peak beside it is what the caching allocator held.
Only CUDA's allocator keeps such a trace: elsewhere the benchmark says so and exits with 2
(``plan.measure`` measures a CPU rank's peak).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from throughput import SHAPES, build_config, one_rank, synchronize

from composer3d.launch import distributed
from composer3d.training.trainer import Trainer

GIB = 2**30
MAX_EVENTS = 3_000_000  # a 1B step makes ~5k; the ring buffer drops the oldest beyond this


def site(frames: list[dict]) -> str:
    """The innermost frame in torch or composer3d, then up to three of composer3d's own."""

    def named(frame: dict) -> str:
        return f"{os.path.basename(frame['filename'])}:{frame['line']}:{frame['name']}"

    ours = [named(f) for f in frames if "composer3d" in f["filename"]]
    inner = next(
        (named(f) for f in frames if "composer3d" in f["filename"] or "torch" in f["filename"]),
        "(no Python frame: the autograd engine's C++)",
    )
    return " <- ".join(dict.fromkeys([inner, *ours[:3]]))


def replay_to_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(the most bytes live at once, the allocations live then, in the order they were made) from an
    allocator trace's alloc and free_requested events (a block is freed when the program frees it,
    as ``memory_allocated`` counts it)."""
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, peak_at = total, i
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    live = {}
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return peak, list(live.values())


def by_site(live: list[dict]) -> list[tuple[str, int, int]]:
    """(site, bytes, allocations) of the live allocations, the most bytes first."""
    sites = defaultdict(lambda: [0, 0])
    for event in live:
        entry = sites[site(event["frames"])]
        entry[0] += event["size"]
        entry[1] += 1
    return sorted(
        ((name, size, count) for name, (size, count) in sites.items()), key=lambda s: -s[1]
    )


def trace_steps(cfg, layout, device: torch.device, steps: int) -> list[dict]:
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks="python")
    try:
        with one_rank(cfg, layout, device) as (mesh, sequences):
            trainer = Trainer(cfg, mesh, device, sequences)
            for _ in range(steps):
                trainer.train_step()
                trainer.zero_grad()
            synchronize(device)
            return torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", help="auto: the machine's accelerator")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--compile", action="store_true", help="compile.enabled=true")
    parser.add_argument("--steps", type=int, default=3, help="training steps traced")
    parser.add_argument("--top", type=int, default=20, help="allocation sites listed")
    parser.add_argument(
        "overrides", nargs="*", help="composer3d Hydra overrides, e.g. memory.ac_policy=..."
    )
    args = parser.parse_args()
    # not touched yet: the trainer sets its allocator up first
    kind = distributed.device_type(args.device)
    if kind != "cuda":
        print(
            f"memory_peak: the {kind} device's allocator keeps no trace of its allocations (CUDA's "
            "does); "
            "on the CPU composer3d-plan plan.measure=true measures a rank's peak",
            file=sys.stderr,
        )
        sys.exit(2)
    cfg, layout, device = build_config(args.shape, args.device, args.compile, args.overrides)
    trace = trace_steps(cfg, layout, device, args.steps)
    peak, live = replay_to_peak(trace)
    print(
        f"{args.shape} on {torch.cuda.get_device_name(device)}, {args.steps} steps, {len(trace)} "
        "allocator events: "
        f"peak {peak / GIB:.3f} GiB replayed, {torch.cuda.max_memory_allocated(device) / GIB:.3f} "
        "allocated, "
        f"{torch.cuda.max_memory_reserved(device) / GIB:.3f} reserved (torch's counters)"
    )
    print("live at the peak, by allocation site (GiB, allocations):")
    for name, size, count in by_site(live)[: args.top]:
        print(f"  {size / GIB:8.3f} {count:6d}  {name}")
    print("the last allocations before the peak (MiB):")
    for event in live[-8:]:
        print(f"  {event['size'] / 2**20:10.1f}  {site(event['frames'])}")


if __name__ == "__main__":
    main()
