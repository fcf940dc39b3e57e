"""The memory options side by side (one process, each option in a fresh one): what each keeps on the
compute device and what it costs.

    # the CPU: bytes by category, step time
    python benchmarks/memory_options.py
    # a GPU: the longest sequence each option set trains
    python benchmarks/memory_options.py --longest --model 1b

Options: ZeRO-Offload (``parallel.offload=optimizer``, ``cpu``), activation offload (with full
checkpointing), sequence tiling of the MLP and the loss, and all of them together, against the same
run without.

Default: one training step measured by torch's memory tracker (the tensors alive at the step's peak,
by category — parameters, gradients, optimizer state, activations, temporaries — and by device),
plus the bytes each option itself moved to the host (the model state ZeRO-Offload keeps there,
activation offload's counter). On the CPU the host is the device's own memory and the tracker counts
host tensors too: there the "to host" column is what an option takes off an accelerator, the
tiling's effect shows in the activations and temporaries, and the step time is the cost.
``--longest`` (an accelerator): for each option set, sequences doubled from ``--start`` until the
step runs out of device memory; the longest that trained, its peak and its tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from memory_compile import in_fresh_process, trainer_for

from composer3d.training.metrics import memory_breakdown, model_state_bytes

MODELS = {  # where the MLP hidden and the logits are most of the activations, as at long sequences
    "tiny": [
        "model=tiny",
        "train.seq_len=256",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
    ],
    "cpu": [
        "model=tiny",
        "model.dim=256",
        "model.n_layers=4",
        "model.n_heads=4",
        "model.n_kv_heads=4",
        "model.vocab_size=8192",
        "train.seq_len=1024",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
    ],
    "1b": [
        "model=llama3_1b",
        "model.tie_embeddings=false",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
    ],
}
OPTIONS = {
    "none": [],
    "offload=optimizer": ["parallel.offload=optimizer"],
    "offload=cpu": ["parallel.offload=cpu"],
    "full checkpointing": ["memory.activation_checkpointing=full"],
    "full ckpt + activation offload": [
        "memory.activation_checkpointing=full",
        "memory.activation_offload=true",
    ],
    "tile_mlp=4": ["memory.tile_mlp=4"],
    "tile_loss=4": ["memory.tile_loss=4"],
    "all of them": [
        "parallel.offload=cpu",
        "memory.activation_checkpointing=full",
        "memory.activation_offload=true",
        "memory.tile_mlp=4",
        "memory.tile_loss=4",
    ],
}


def one_step(overrides: list[str], steps: int) -> dict:
    """Peak bytes by category and device in a steady-state step, bytes moved to the host, seconds a
    step."""
    trainer = trainer_for(overrides)
    trainer.train_step()  # the optimizer state exists, as in every later step
    trainer.zero_grad()
    offload = getattr(trainer.model, "activation_offload", None)
    if offload is not None:
        offload.reset()  # its counters: the measured step's alone
    with memory_breakdown(trainer.model, trainer.optimizer) as (peaks, trainer.memory_tracker):
        trainer.train_step()
    trainer.memory_tracker = None
    trainer.zero_grad()
    moved = offload.counters.bytes_offloaded if offload is not None else 0
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        trainer.zero_grad()
        times.append(time.perf_counter() - start)
    # offload=optimizer: fp32 masters and two moments each
    host_state = getattr(trainer.optimizer, "pairs", [])
    on_host = sum(3 * m.numel() * m.element_size() for _, m, _ in host_state)
    # FSDP's: parameter shards, their gradients, the optimizer state
    if trainer.cfg.parallel.offload == "cpu":
        on_host = model_state_bytes(trainer.model, trainer.optimizer)
    return {
        "peaks": dict(peaks),
        "step_s": statistics.median(times),
        "model_state_on_host": on_host,
        "activations_moved": moved,
    }


def longest(overrides: list[str], start: int, limit: int, steps: int) -> dict:
    """The longest power-of-two multiple of ``start`` that trains ``steps`` steps, its peak and
    tokens/s."""
    best = {"seq_len": 0}
    seq = start
    while seq <= limit:
        try:
            trainer = trainer_for(
                [
                    *overrides,
                    f"train.seq_len={seq}",
                    f"model.max_seq_len={seq}",
                    "data.synthetic_sequences=8",
                ]
            )
            times = []
            for _ in range(steps + 1):
                torch.accelerator.synchronize()
                began = time.perf_counter()
                trainer.train_step()
                trainer.zero_grad()
                torch.accelerator.synchronize()
                times.append(time.perf_counter() - began)
            best = {
                "seq_len": seq,
                "peak": torch.accelerator.max_memory_allocated(),
                "tokens_per_s": seq / statistics.median(times[1:]),
            }
            del trainer
        except torch.OutOfMemoryError:
            break
        finally:
            torch.accelerator.empty_cache()
            torch.accelerator.reset_peak_memory_stats()
        seq *= 2
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=list(MODELS), default="cpu")
    parser.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--longest", action="store_true", help="an accelerator: the longest sequence per option set"
    )
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--limit", type=int, default=2**20)
    parser.add_argument(
        "--same-process", action="store_true", help="a smoke run: everything in this process"
    )
    args = parser.parse_args()
    mib = 2**20
    model = MODELS[args.model]
    if args.longest:
        print(f"{'options':<34}{'longest':>10}{'peak':>12}{'tokens/s':>12}")
        for name in args.options:
            r = in_fresh_process(
                longest,
                [*model, *OPTIONS[name]],
                args.start,
                args.limit,
                args.steps,
                same_process=args.same_process,
            )
            print(
                f"{name:<34}{r['seq_len']:>10,}{r.get('peak', 0) / 2**30:>10.1f} "
                f"G{r.get('tokens_per_s', 0):>12,.0f}"
            )
        return
    print(
        f"{'options':<34}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'temp':>9}"
        f"{'to host':>9}"
        f"{'step s':>8}   (MiB at the step's peak, by category)"
    )
    for name in args.options:
        r = in_fresh_process(
            one_step, [*model, *OPTIONS[name]], args.steps, same_process=args.same_process
        )
        p = r["peaks"]
        moved = r["model_state_on_host"] + r["activations_moved"]
        print(
            f"{name:<34}"
            + "".join(f"{p.get(k, 0) / mib:>9.2f}" for k in ("PARAM", "GRAD", "OPT", "ACT", "TEMP"))
            + f"{moved / mib:>9.2f}{r['step_s']:>8.3f}"
        )


if __name__ == "__main__":
    main()
