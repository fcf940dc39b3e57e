"""Ring attention's blocks, merge and backward in one process (a "virtual ring"): every cp rank's
share computed by the block kernels of the device (``composer3d.parallel.context.attention_blocks``)
and checked against full attention per token and per gradient — the way to check the accelerator's
kernels without a process group — and timed against the device's own full attention.

The reference is plain PyTorch in fp64 (scores, mask, softmax, autograd) over the whole sequence;
the device's full SDPA in the same dtype is measured against it too, so a half-precision ring is
judged by the error half precision makes anyway. Prints one row per (dtype, cp, mask): the kernels
the blocks ran, max |error| of the output and of the q/k/v gradients (ring and full SDPA), and the
forward + backward time of the ring's blocks for one rank (all blocks / cp) against full attention
on one device.

    python benchmarks/virtual_ring.py                              # the accelerator if there is one
    python benchmarks/virtual_ring.py --device cpu --seq 256 --json
    python benchmarks/virtual_ring.py --windows 0 1024    # and under a sliding window
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from composer3d.launch.distributed import resolve_device
from composer3d.parallel.context.attention_blocks import (
    KERNELS,
    block_backward,
    block_forward,
    kernel_for,
)
from composer3d.parallel.context.balance import head_tail
from composer3d.parallel.context.ring_attention import (
    fold_heads,
    merge_block,
    query_heads,
    ring_blocks,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _documents(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Packed documents of uneven lengths, cut at different places in each row (ids in global
    order)."""
    gen = torch.Generator().manual_seed(1)
    starts = torch.zeros(batch, seq, dtype=torch.long)
    for row in range(batch):
        starts[row, torch.randint(1, seq, (max(1, seq // 97),), generator=gen)] = 1
    return starts.cumsum(1).to(device)


def _mask(
    seq: int, documents: torch.Tensor | None, device: torch.device, window: int = 0
) -> torch.Tensor:
    index = torch.arange(seq, device=device)
    behind = index[:, None] - index[None, :]
    mask = ((behind >= 0) & (behind < (window or seq)))[None, None]
    if documents is not None:
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    return mask


def reference(q, k, v, grad_out, documents, window: int = 0):
    """Full attention in fp64 with autograd: output and q/k/v gradients (kv heads repeated, then
    folded back); ``window``: each query's keys, itself included (0: all earlier)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~_mask(q.shape[2], documents, q.device, window), -torch.inf)
    out = scores.softmax(-1) @ v.repeat_interleave(group, 1)
    out.backward(grad_out.double())
    return out.detach(), q.grad, k.grad, v.grad


def full_sdpa(q, k, v, grad_out, documents, window: int = 0):
    """The device's own full attention in the inputs' dtype (a bool mask only with documents or a
    window)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    masked = documents is not None or window
    mask = _mask(q.shape[2], documents, q.device, window) if masked else None
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def virtual_ring(q, k, v, grad_out, documents, cp: int, kernel: str | None = None, window: int = 0):
    """Every cp rank's ring forward and backward in this process, by the same block plan, kernels
    and merge the ring runs (``kernel``: one kernel for every block instead of the device's choice;
    ``window``: a sliding window); returns (output, dq, dk, dv) in global token order and the
    kernels the blocks used."""
    seq, scale = q.shape[2], q.shape[-1] ** -0.5
    placement = head_tail(cp, seq)
    held = [placement.token_index(rank, q.device) for rank in range(cp)]
    local = lambda t, rank: t.index_select(2, held[rank]).contiguous()  # noqa: E731
    kv = [query_heads(torch.stack([local(k, s), local(v, s)]), q.shape[1]) for s in range(cp)]
    out, dq, dk, dv = (
        torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, q, k, v)
    )
    kernels = set()
    for rank in range(cp):
        plan = ring_blocks(rank, placement, documents, window)
        q_r, grad_r = local(q, rank), local(grad_out, rank)
        out_r = torch.zeros(q_r.shape, dtype=torch.float32, device=q.device)
        lse_r = torch.full(q_r.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device)
        for source in range(cp):
            for block in plan[source]:
                kernels.add(kernel or kernel_for(q_r, block))
                merge_block(
                    out_r,
                    lse_r,
                    block.queries,
                    *block_forward(q_r, kv[source][0], kv[source][1], block, scale, kernel),
                )
        out_r = out_r.to(q.dtype)
        out[..., held[rank], :] = out_r.float()
        for source in range(cp):
            for block in plan[source]:
                bq, bk, bv = block_backward(
                    grad_r, q_r, kv[source][0], kv[source][1], out_r, lse_r, block, scale, kernel
                )
                dq[..., held[rank][block.queries], :] += bq.float()
                dk[..., held[source][block.keys], :] += fold_heads(bk.float(), k.shape[1])
                dv[..., held[source][block.keys], :] += fold_heads(bv.float(), k.shape[1])
    return (out, dq, dk, dv), sorted(kernels)


def _max_error(got, want) -> list[float]:
    return [(g.double() - w).abs().max().item() for g, w in zip(got, want)]


def _time(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(device, dtype_name, cp, documents_on, kernel, window, args) -> dict:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    q, grad_out = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(kv_shape, generator=gen).to(device, dtype) for _ in range(2))
    documents = _documents(args.batch, args.seq, device) if documents_on else None
    want = reference(q, k, v, grad_out, documents, window)
    ring, kernels = virtual_ring(q, k, v, grad_out, documents, cp, kernel, window)
    full = full_sdpa(q, k, v, grad_out, documents, window)
    row = {
        "dtype": dtype_name,
        "cp": cp,
        "mask": "documents" if documents_on else "causal",
        "window": window,
        "kernels": kernels,
        "ring_error": dict(zip(("out", "dq", "dk", "dv"), _max_error(ring, want))),
        "sdpa_error": dict(zip(("out", "dq", "dk", "dv"), _max_error(full, want))),
    }
    if args.repeats:
        row["ring_rank_s"] = (
            _time(
                lambda: virtual_ring(q, k, v, grad_out, documents, cp, kernel, window),
                device,
                args.repeats,
            )
            / cp
        )
        row["full_s"] = _time(
            lambda: full_sdpa(q, k, v, grad_out, documents, window), device, args.repeats
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=sorted(DTYPES),
        help="default: fp32 and bf16 on an accelerator, fp32 on the CPU",
    )
    parser.add_argument("--cp", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        choices=["auto", *KERNELS],
        help="block kernels to check: auto (the device's choice per block) and any forced for "
        "every "
        "block (a forced kernel runs only where it applies: cuda_flash in half precision without "
        "documents)",
    )
    parser.add_argument(
        "--windows",
        nargs="+",
        type=int,
        default=[0],
        help="sliding windows to check, in keys a query sees (0: causal over every earlier key)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (0: check only)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtypes = args.dtypes or (["fp32"] if device.type == "cpu" else ["fp32", "bf16"])
    rows = [
        measure(device, dtype, cp, documents, None if kernel == "auto" else kernel, window, args)
        for kernel in args.kernels
        for dtype in dtypes
        for cp in args.cp
        for documents in (False, True)
        for window in args.windows
        if kernel != "cuda_flash" or (dtype != "fp32" and not documents and not window)
    ]
    if args.json:
        print(json.dumps({"device": str(device), "seq": args.seq, "rows": rows}))
        return
    print(
        f"virtual ring on {device}, seq {args.seq}, heads {args.heads}/{args.kv_heads}, head_dim "
        f"{args.head_dim}"
    )
    print(
        f"{'dtype':5} {'cp':>2} {'mask':9} {'window':>6} {'kernels':28} "
        f"{'ring err out/dq/dk/dv':34} {'sdpa err':34} "
        f"{'ring/rank s':>11} {'full s':>8}"
    )
    for r in rows:
        errors = lambda e: "/".join(f"{x:.1e}" for x in e.values())  # noqa: E731
        print(
            f"{r['dtype']:5} {r['cp']:>2} {r['mask']:9} {r['window']:>6} "
            f"{','.join(r['kernels']):28} "
            f"{errors(r['ring_error']):34} "
            f"{errors(r['sdpa_error']):34} {r.get('ring_rank_s', float('nan')):11.4f} "
            f"{r.get('full_s', float('nan')):8.4f}"
        )


if __name__ == "__main__":
    main()
