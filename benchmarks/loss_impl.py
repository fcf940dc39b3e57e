"""The head and cross-entropy side by side (train.loss_impl), forward + backward, one process, CPU
or accelerator.

    python benchmarks/loss_impl.py [--tokens 8192 --dim 2048 --vocab 128256] [--steps 10]
                                   [--no-compile] [--fused-rows 256,1024,2048]

Per implementation, over the same hidden states, head weight and targets: the mean time of the
head's matmul plus the loss, forward and backward (after two warm-up steps: compilation), its summed
loss beside the reference's (a sum over the tokens: one fp32 step of a sum near 96,000 is 0.0078),
how far its gradients (∂x and ∂W of the loss over the token count, as the trainer backpropagates it)
are from the reference's at most, as a share of the reference's largest element (bf16's rounding is
within 2^-9 = 0.002), and on an accelerator the peak memory the step allocates over what existed
before it ('-' on the CPU).
  - log_softmax: ``F.cross_entropy`` over the full logits in fp32 (one log-softmax pass; the
    reference);
  - chunked: composer3d's chunked loss over the head's logits (train.loss_impl=chunked), eager and
    with its compiled kernels (compile.enabled);
  - fused: the head and loss per chunk of rows, ∂W per chunk of the vocabulary
    (train.loss_impl=fused), eager and compiled (what an accelerator runs), its rows a chunk in the
    name (``CHUNK_ELEMENTS`` over the vocabulary); ``--fused-rows`` adds the compiled fused loss at
    other row counts a chunk: its ∂x matmul is (rows × vocab) · (vocab × dim), so few rows make a
    long, thin GEMM, and more rows hold more logits at once (∂W's pass then takes as many elements a
    chunk: rows × vocab over all the tokens).
Defaults: a Llama-3 1B head (dim 2048, vocab 128256, 8192 tokens, bf16) on an accelerator; a small
fp32 one on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from composer3d.launch.distributed import is_accelerator, resolve_device
from composer3d.training import fused_loss
from composer3d.training.fused_loss import fused_linear_cross_entropy_sum
from composer3d.training.loss import cross_entropy_sum


def log_softmax(x, weight, targets):
    return F.cross_entropy((x @ weight.t()).float(), targets, reduction="sum")


IMPLEMENTATIONS = {
    "log_softmax (reference)": log_softmax,
    # in place, as the trainer runs it: the logits' gradient written over them
    "chunked, eager": lambda x, w, t: cross_entropy_sum(
        (x @ w.t()).unsqueeze(0), t.unsqueeze(0), in_place=True
    ),
    "chunked, compiled kernels": lambda x, w, t: cross_entropy_sum(
        (x @ w.t()).unsqueeze(0), t.unsqueeze(0), compiled=True, in_place=True
    ),
    "fused, eager": lambda x, w, t: fused_linear_cross_entropy_sum(x, w, t, grad_scale=1 / len(t)),
    "fused, compiled": lambda x, w, t: fused_linear_cross_entropy_sum(
        x, w, t, compiled=True, grad_scale=1 / len(t)
    ),
}


def measure(
    loss_fn, x, weight, targets, steps: int, accelerator: bool
) -> tuple[float, float, list[torch.Tensor], int | None]:
    """(mean seconds of forward + backward, the loss, the gradients, peak bytes over what existed
    before the step)."""
    times, peak = [], None
    for _ in range(steps + 2):
        x.grad = weight.grad = None
        if accelerator:
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
            before = torch.accelerator.memory_allocated()
        start = time.perf_counter()
        loss = loss_fn(x, weight, targets)
        (loss / len(targets)).backward()  # the trainer's normalization: 1 / the token count
        if accelerator:
            torch.accelerator.synchronize()
            peak = torch.accelerator.max_memory_allocated() - before
        times.append(time.perf_counter() - start)
    return statistics.mean(times[2:]), loss.item(), [x.grad, weight.grad], peak


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled rows")
    parser.add_argument(
        "--fused-rows",
        default="",
        help="comma-separated rows a chunk for more fused, compiled rows",
    )
    args = parser.parse_args()
    device = resolve_device("auto")
    accelerator = is_accelerator(device)
    tokens, dim, vocab = (
        args.tokens or (8192 if accelerator else 512),
        args.dim or (2048 if accelerator else 64),
        args.vocab or (128256 if accelerator else 4096),
    )
    dtype = torch.bfloat16 if accelerator else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    x = (torch.randn(tokens, dim, device=device, generator=generator)).to(dtype).requires_grad_()
    weight = (
        (torch.randn(vocab, dim, device=device, generator=generator) * dim**-0.5)
        .to(dtype)
        .requires_grad_()
    )
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    print(
        f"{device.type}: {tokens} tokens, dim {dim}, vocab {vocab}, "
        f"{str(dtype).removeprefix('torch.')}"
    )
    print(
        f"  {'implementation':<34} {'step ms':>9} {'loss - reference':>17} "
        f"{'grad - reference':>17} {'peak MiB':>9}"
    )
    default_rows = fused_loss.CHUNK_ELEMENTS // vocab
    runs = [
        (
            name + (f", {min(default_rows, tokens)} rows" if name.startswith("fused") else ""),
            loss_fn,
            default_rows,
        )
        for name, loss_fn in IMPLEMENTATIONS.items()
    ]
    runs += [
        (f"fused, compiled, {rows} rows", IMPLEMENTATIONS["fused, compiled"], rows)
        for rows in map(int, filter(None, args.fused_rows.split(",")))
    ]
    reference = reference_grads = None
    for name, loss_fn, rows in runs:
        if args.no_compile and "compiled" in name:
            continue
        # the fused loss's rows a chunk (the chunked loss keeps its own)
        fused_loss.CHUNK_ELEMENTS = rows * vocab
        seconds, loss, grads, peak = measure(loss_fn, x, weight, targets, args.steps, accelerator)
        reference = loss if reference is None else reference
        reference_grads = grads if reference_grads is None else reference_grads
        apart = max(
            ((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference_grads)
        )
        print(
            f"  {name:<34} {seconds * 1e3:>9.2f} {loss - reference:>17.3g} {apart:>17.3g} "
            f"{'-' if peak is None else f'{peak / 2**20:.0f}':>9}"
        )


if __name__ == "__main__":
    main()
