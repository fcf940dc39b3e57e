"""Generation speed with the KV cache against recomputing the whole sequence per token, side by
side.

    python benchmarks/generate.py [--shape cpu|400m] [--device auto|cpu|cuda|…] [--new-tokens 128]
                                  [--prompt 32] [--batch 1] [--no-compile] [--json]

Builds the native model of ``--shape`` (random weights) on the device — bf16 compute on an
accelerator, fp32 on the CPU, as ``precision.param_dtype=auto`` — and generates greedily from the
same random prompt through ``composer3d.generation`` three ways: ``generate.cache=none`` (the whole
sequence through the model each step), the static KV cache (the prompt once, then a token a step),
and that cache with compiled steps (``generate.compile``: CUDA graphs on a GPU). Each path runs once
untimed (warm-up; the compiled one with the timed run's shapes, so the timed run replays the graph
it compiled), then timed; every step reads its token back to the host, as composer3d-generate does,
so the time is the device's. Prints tokens/s of each path, their ratios, and whether they generated
the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from composer3d.config.schema import GenerateConfig, ModelConfig
from composer3d.generation import Recompute, generate
from composer3d.launch.distributed import resolve_device
from composer3d.models import build_model, count_params
from composer3d.models.init import materialize

SHAPES = {
    "cpu": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=64),
    # ~0.4B parameters, the size issue 29 measured today's path at (7.9 tokens/s on an H100)
    "400m": dict(
        dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, vocab_size=50304, multiple_of=256
    ),
}


def timed(
    model,
    prompt: list[int],
    cache: str,
    new_tokens: int,
    batch: int,
    device,
    dtype,
    compile: bool = False,
) -> tuple[float, list]:
    settings = GenerateConfig(
        max_new_tokens=new_tokens, stop_at_eos=False, cache=cache, compile=compile
    )
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        # compiled: the warm-up has the timed run's shapes, so its graphs (and cache) are the ones
        # replayed
        warm = (
            settings
            if compile
            else GenerateConfig(max_new_tokens=4, stop_at_eos=False, cache=cache)
        )
        generate(model, [prompt] * batch, warm, None, str, device)
        started = time.perf_counter()
        results = generate(model, [prompt] * batch, settings, None, str, device)
        seconds = time.perf_counter() - started
    return batch * len(results[0].completion_ids) / seconds, results[0].completion_ids


def divergence(
    model, prompt: list[int], reference: list[int], other: list[int], device, dtype
) -> dict | None:
    """Where two paths' greedy tokens part (None: they do not), and why: both paths' logits along
    the reference's tokens at that step, their largest difference beside the reference's margin
    between its top two. A margin below the difference is a near-tie flipped by rounding (bf16
    kernels that sum in another order); a margin far above it is a wrong cache."""
    step = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if step is None:
        return None
    ids = torch.tensor([prompt + reference[:step]], device=device)
    logits = []
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        for decoder in (Recompute(model), model.decoder(ids.shape[1] + 1, "static")):
            last = decoder(ids[:, : len(prompt)], torch.ones_like(ids[:, : len(prompt)]))
            for i in range(len(prompt), ids.shape[1]):
                last = decoder(ids[:, i : i + 1], torch.ones_like(ids[:, : i + 1]))
            logits.append(last[0].float())
    top = logits[0].topk(2).values
    return {
        "step": step,
        "logit_difference": (logits[0] - logits[1]).abs().max().item(),
        "top_two_margin": (top[0] - top[1]).item(),
    }


def progress(line: str) -> None:
    """Each path's rate as it is known, on stderr: a compile that runs long still leaves the eager
    rows behind."""
    print(f"[{time.strftime('%X')}] {line}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument(
        "--device", default="auto", help="auto: the accelerator where there is one, else the CPU"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument(
        "--batch", type=int, default=1, help="copies of the prompt generated as one batch"
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out the compiled steps (no compiler wait)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = ModelConfig(name="llama", max_seq_len=args.prompt + args.new_tokens, **SHAPES[args.shape])
    model = build_model(cfg)
    materialize(model, device, seed=0)
    model.eval()
    prompt = torch.randint(
        cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    recompute, recompute_ids = timed(
        model, prompt, "none", args.new_tokens, args.batch, device, dtype
    )
    progress(f"recompute: {recompute:.1f} tokens/s")
    cached, cached_ids = timed(model, prompt, "static", args.new_tokens, args.batch, device, dtype)
    progress(f"KV cache: {cached:.1f} tokens/s")
    compiled, compiled_ids = (
        (float("nan"), cached_ids)
        if args.no_compile
        else timed(
            model, prompt, "static", args.new_tokens, args.batch, device, dtype, compile=True
        )
    )
    result = {
        "device": str(device),
        "shape": args.shape,
        "params": count_params(model),
        "dtype": str(dtype),
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "recompute_tokens_per_s": recompute,
        "cached_tokens_per_s": cached,
        "ratio": cached / recompute,
        "compiled_tokens_per_s": compiled,
        "compiled_ratio": compiled / recompute,
        "same_tokens": cached_ids == recompute_ids,
        "compiled_same_tokens": compiled_ids == cached_ids,
        "cache_vs_recompute": divergence(model, prompt, recompute_ids, cached_ids, device, dtype),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"model: {result['params'] / 1e6:.1f}M params on {device} ({dtype}); prompt {args.prompt} "
        "tokens, "
        f"{args.new_tokens} new, batch {args.batch}, greedy"
    )
    print(f"{'path':<28}{'tokens/s':>12}")
    print(f"{'recompute (cache=none)':<28}{recompute:>12.1f}")
    print(f"{'KV cache (cache=static)':<28}{cached:>12.1f}")
    print(f"{'KV cache, compiled steps':<28}{compiled:>12.1f}")
    parting = result["cache_vs_recompute"]
    print(
        f"cached / recompute: {result['ratio']:.1f}x; "
        + (
            "the same tokens"
            if parting is None
            else f"tokens part at step {parting['step']}: there the paths' logits differ by up to "
            f"{parting['logit_difference']:.3g}, the recompute path's top two are "
            f"{parting['top_two_margin']:.3g} apart"
        )
    )
    print(
        f"compiled / recompute: {result['compiled_ratio']:.1f}x; same tokens as the eager cache: "
        f"{result['compiled_same_tokens']}"
    )


if __name__ == "__main__":
    main()
