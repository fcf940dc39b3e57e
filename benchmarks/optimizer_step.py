"""The optimizer step: fused AdamW with the gradient clip apart and handed to its step, and the
compiled AdamW (``optim.implementation=compiled``), one process, CPU or accelerator.

    python benchmarks/optimizer_step.py [--layers 16 --dim 2048 --vocab 128256] [--steps 15]
                                        [--rounds 2]

What ``training/grad.clip_grad_norm_`` saves by handing the clip to the optimizer
(``divides_in_step``): apart, the clip reads and writes every fp32 gradient once (a foreach
multiply) before AdamW reads them again; handed over, the fused kernel divides each gradient as it
reads it and stores the quotient back, 4 bytes a parameter less. The compiled step
(``optim/compiled_adamw.py``) divides as it reads and stores nothing back: 4 bytes fewer again,
in kernels Inductor writes (its first step compiles them: printed too), in one graph or, as training
steps it, one call a block, blocks of one shape sharing a graph. Each row prints the bytes a
parameter that way moves and the rate that makes. Over one model's parameters (Llama 3.2 1B's shapes
with an untied head by default: the embedding, the head and each block's seven matrices and two
norms) with random gradients: the norm, the clip and the step, the median of ``--steps`` after three
warm-ups, each way ``--rounds`` times in turn, and how far the ways' parameters are apart after the
same steps (the clip's factor is the same; one multiplies by it, the others divide by its inverse).
On the CPU a small model (a smoke run: its times say little).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from composer3d.launch.distributed import is_accelerator, resolve_device
from composer3d.optim.build import numbered_blocks
from composer3d.optim.compiled_adamw import CompiledAdamW
from composer3d.plan.calibrate import optimizer_step_seconds


def llama_shapes(layers: int, dim: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters' names and shapes of a Llama 3 model with an untied head (4 query heads per KV
    head, 8/3·4 MLP)."""
    kv, hidden = dim // 4, 4 * dim
    block = [
        ("wq", (dim, dim)),
        ("wk", (kv, dim)),
        ("wv", (kv, dim)),
        ("wo", (dim, dim)),
        ("w1", (hidden, dim)),
        ("w3", (hidden, dim)),
        ("w2", (dim, hidden)),
        ("attention_norm", (dim,)),
        ("ffn_norm", (dim,)),
    ]
    return [
        ("tok_embeddings.weight", (vocab, dim)),
        ("output.weight", (vocab, dim)),
        ("norm.weight", (dim,)),
    ] + [(f"layers.{i}.{name}.weight", shape) for i in range(layers) for name, shape in block]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = resolve_device("auto")
    accelerator = is_accelerator(device)
    layers, dim, vocab = (
        args.layers or (16 if accelerator else 2),
        args.dim or (2048 if accelerator else 64),
        args.vocab or (128256 if accelerator else 1024),
    )
    generator = torch.Generator(device).manual_seed(0)
    names, shapes = zip(*llama_shapes(layers, dim, vocab))
    weights = [torch.randn(s, device=device, generator=generator) * 0.02 for s in shapes]
    grads = [
        torch.randn(s, device=device, generator=generator) for s in shapes
    ]  # a norm far above the clip's 1
    # each way: its optimizer, whether the clip is handed to it, and the bytes a parameter it moves
    # (the norm reads each gradient; apart, the clip reads and writes it; the step reads the weight,
    # gradient and two moments and writes the weight and moments, and the fused kernel also the
    # divided gradient)
    ways = {
        "fused, clip apart": (partial(torch.optim.AdamW, fused=True), False, 4 + 8 + 28),
        "fused, clip in step": (partial(torch.optim.AdamW, fused=True), True, 4 + 32),
        "compiled, one graph": (CompiledAdamW, True, 4 + 28),
        "compiled, by block": (CompiledAdamW, True, 4 + 28),
    }  # as training builds it: a call a block
    made = {}
    for name, (optimizer_class, handed, _) in ways.items():
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        by_block = {"block_of": numbered_blocks(names, params)} if name.endswith("by block") else {}
        made[name] = params, optimizer_class(params, lr=1e-3, **by_block)
    numel = sum(w.numel() for w in weights)
    print(
        f"{device.type}: {numel / 1e6:,.1f}M fp32 parameters, AdamW, the clip at 1.0 (the first of "
        f"{args.steps + 3} steps compiles)"
    )
    print(f"  {'round':>5} {'way':<24} {'ms':>9} {'bytes/param':>12} {'GB/s':>8}")
    for round_ in range(args.rounds):
        for name, (_, handed, moved) in ways.items():
            params, optimizer = made[name]
            seconds, first = optimizer_step_seconds(
                params, grads, optimizer, 1.0, handed, args.steps, device
            )
            print(
                f"  {round_ + 1:>5} {name:<24} {seconds * 1e3:>9.2f} {moved:>12} "
                f"{moved * numel / seconds / 1e9:>8.1f}"
            )
            if round_ == 0 and name.startswith("compiled"):
                print(f"  {'':>5} {'(its first step compiles)':<24} {first * 1e3:>9.0f}")
    first, *others = made.values()
    spread = max(
        (a - b).abs().max().item() for params, _ in others for a, b in zip(first[0], params)
    )
    print(f"  parameters after the same steps, the ways at most {spread:.3g} apart")


if __name__ == "__main__":
    main()
