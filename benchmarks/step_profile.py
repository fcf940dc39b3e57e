"""Where composer3d's training step spends its time, by kernel family, on one process (issue 29,
item 5: MFU).

    python benchmarks/step_profile.py [--shape cpu|1b] [--device auto|cpu|cuda|…] [--compile]
                                      [--warmup 3] [--steps 5] [--top 12] [--trace FILE.json]
                                      [--json] [OVERRIDE ...]

Builds a world-size-1 Trainer as ``benchmarks/throughput.py`` does (``data=synthetic``; extra Hydra
overrides such as ``memory.activation_checkpointing=selective`` go at the end), runs --warmup steps
(compilation, optimizer state), times --steps steps with one device synchronization each, then
profiles --steps more with ``torch.profiler``.

On an accelerator the profile's device kernels are grouped into families by name: matmul
(cuBLAS/CUTLASS GEMMs), attention (flash/cuDNN/efficient SDPA), compiled (Triton kernels inductor
generated), elementwise (eager ATen kernels: norms, activations, the loss), optimizer (foreach/fused
AdamW), copy (casts, memcpy/memset), communication, other. Per family: milliseconds per step and
share of the step; the step's time the device spent in no kernel (host-bound gaps, launch latency);
the matmul and attention families' achieved TFLOP/s against the device's peak (the model's useful
FLOPs, 4·N + 2·N_trained for the matmuls and 6·L·H·Q·T for attention per token, over that family's
kernel time; recomputation under activation checkpointing is counted as time, not as useful FLOPs);
MFU; and the --top kernels. On the CPU the same table groups the host's ATen operators by self time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
from throughput import SHAPES, build_config, model_flops_per_token, one_rank, synchronize
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from composer3d.launch import distributed
from composer3d.models.llama import Llama
from composer3d.training.flops import embedding_params, peak_flops
from composer3d.training.trainer import Trainer

# Kernel (or ATen operator) name fragments per family, first match wins: attention before matmul
# (flash kernels are GEMM-shaped), communication before copy.
FAMILIES = [
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn_generated", "efficient_attention")),
    (
        "communication",
        (
            "nccl",
            "gloo",
            "all_gather",
            "allgather",
            "reduce_scatter",
            "all_reduce",
            "allreduce",
            "c10d",
        ),
    ),
    (
        "matmul",
        (
            "gemm",
            "cutlass",
            "cublas",
            "xmma",
            "nvjet",
            "sm90_",
            "sm100_",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::_scaled_mm",
            "aten::matmul",
        ),
    ),
    ("optimizer", ("multi_tensor", "foreach", "adam", "fused_adam")),
    ("compiled", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy", "cast", "convert", "aten::to", "fill")),
    (
        "elementwise",
        (
            "elementwise",
            "reduce",
            "vectorized",
            "softmax",
            "norm",
            "silu",
            "mul",
            "add",
            "exp",
            "nll",
            "cross_entropy",
            "index",
            "gather",
            "scatter",
            "where",
            "cat",
            "aten::",
        ),
    ),
]


def family(name: str) -> str:
    lowered = name.lower()
    return next(
        (fam for fam, fragments in FAMILIES if any(f in lowered for f in fragments)), "other"
    )


def kernel_times(prof, on_device: bool) -> dict[str, float]:
    """Microseconds per kernel name over the profiled steps: device kernels' own time on an
    accelerator, the host's ATen operators' self time on the CPU (where they are the kernels)."""
    times: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        # a named region (the optimizer step's) spans kernels counted on their own
        if event.is_user_annotation:
            continue
        if on_device and event.device_type != DeviceType.CPU:
            times[event.key] += event.self_device_time_total
        elif (
            not on_device and event.device_type == DeviceType.CPU and event.key.startswith("aten::")
        ):
            times[event.key] += event.self_cpu_time_total
    return times


def model_flop_split(cfg) -> tuple[int, int]:
    """Useful FLOPs per token: (matmuls, attention), composer3d's convention
    (``training.flops``)."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    matmul_params = sum(p.numel() for p in model.parameters()) - embedding_params(model)
    total = model_flops_per_token(cfg)
    return 6 * matmul_params, total - 6 * matmul_params


def profile_step(cfg, layout, device, warmup: int, steps: int, trace: str | None):
    with one_rank(cfg, layout, device) as (mesh, sequences):
        trainer = Trainer(cfg, mesh, device, sequences)

        def step() -> None:
            trainer.train_step()
            trainer.zero_grad()

        for _ in range(warmup):
            step()
        synchronize(device)
        step_times = []
        # timed without the profiler, whose bookkeeping slows a host-bound step
        for _ in range(steps):
            started = time.perf_counter()
            step()
            synchronize(device)
            step_times.append(time.perf_counter() - started)
        activities = [ProfilerActivity.CPU]
        if distributed.is_accelerator(device):
            activities.append(getattr(ProfilerActivity, device.type.upper()))
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            synchronize(device)
        if trace:
            prof.export_chrome_trace(trace)
        return step_times, kernel_times(prof, distributed.is_accelerator(device))


def report(
    cfg,
    device: torch.device,
    step_times: list[float],
    kernels: dict[str, float],
    steps: int,
    top: int,
) -> dict:
    step_s = sorted(step_times)[len(step_times) // 2]
    per_step_ms = {name: us / steps / 1e3 for name, us in kernels.items()}
    families: dict[str, float] = defaultdict(float)
    for name, ms in per_step_ms.items():
        families[family(name)] += ms
    busy_ms = sum(families.values())
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    matmul_flops, attention_flops = model_flop_split(cfg)
    peak = peak_flops(device, cfg.precision.param_dtype)

    def tflops(flops_per_token: int, ms: float) -> float | None:
        return flops_per_token * tokens / (ms / 1e3) / 1e12 if ms else None

    return {
        "device": str(device),
        "torch_version": torch.__version__,
        "compile": bool(cfg.compile.enabled),
        "activation_checkpointing": cfg.memory.activation_checkpointing,
        "tokens_per_step": tokens,
        "measured": "kernel" if distributed.is_accelerator(device) else "host op",
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "mfu": (matmul_flops + attention_flops) * tokens / step_s / peak if peak else None,
        "peak_tflops": peak / 1e12 if peak else None,
        "families_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "kernel_ms": busy_ms,
        "idle_ms": max(step_s * 1e3 - busy_ms, 0.0),
        "matmul_tflops": tflops(matmul_flops, families.get("matmul", 0.0)),
        "attention_tflops": tflops(attention_flops, families.get("attention", 0.0)),
        "top": sorted(per_step_ms.items(), key=lambda kv: -kv[1])[:top],
    }


def print_report(r: dict) -> None:
    mode = (
        "compiled" if r["compile"] else "eager"
    ) + f", activation checkpointing {r['activation_checkpointing']}"
    print(
        f"step profile on {r['device']} (torch {r['torch_version']}, {mode}), "
        f"{r['tokens_per_step']} tokens/step"
    )
    mfu = f", MFU {r['mfu']:.1%} of {r['peak_tflops']:.0f} TFLOP/s" if r["mfu"] is not None else ""
    print(f"step {r['step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s{mfu}")
    unit = r["measured"]
    print(f"{'family':<15}{'ms/step':>10}{'share':>8}")
    for fam, ms in r["families_ms"].items():
        print(f"{fam:<15}{ms:>10.2f}{ms / r['step_ms']:>8.1%}")
    print(f"{'no ' + unit:<15}{r['idle_ms']:>10.2f}{r['idle_ms'] / r['step_ms']:>8.1%}")
    for fam in ("matmul", "attention"):
        achieved = r[f"{fam}_tflops"]
        if achieved is not None:
            of_peak = f" ({achieved / r['peak_tflops']:.0%} of peak)" if r["peak_tflops"] else ""
            print(f"{fam}: {achieved:.3g} useful TFLOP/s{of_peak}")
    print(f"top {len(r['top'])} {unit}s (ms/step):")
    for name, ms in r["top"]:
        print(f"  {ms:8.2f}  {family(name):<13} {name[:110]}")


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
    parser.add_argument("--compile", action="store_true", help="compile.enabled=true")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, then as many profiled")
    parser.add_argument("--top", type=int, default=12, help="kernels listed by time")
    parser.add_argument("--trace", help="also write the profiled steps' Chrome trace here")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    parser.add_argument(
        "overrides", nargs="*", help="composer3d Hydra overrides, e.g. train.loss_impl=fused"
    )
    args = parser.parse_args()
    shape = args.shape or ("cpu" if distributed.device_type(args.device) == "cpu" else "1b")
    cfg, layout, device = build_config(shape, args.device, args.compile, args.overrides)
    print(f"profiling {shape} on {device}", file=sys.stderr, flush=True)
    step_times, kernels = profile_step(cfg, layout, device, args.warmup, args.steps, args.trace)
    result = report(cfg, device, step_times, kernels, args.steps, args.top)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)


if __name__ == "__main__":
    main()
