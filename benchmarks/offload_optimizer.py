"""The optimizer step of ZeRO-Offload, side by side: the parameters' AdamW on the device (no
offload) against the host step composer3d's ``parallel.offload=optimizer`` runs — fused CPU AdamW
(its default), foreach CPU AdamW, and its masters and moments in memory-mapped files
(``parallel.offload_dir``) — and, on CUDA, torchao's CPUOffloadOptimizer. Each step times a backward
that makes the gradients (torchao copies them to the host from its gradient hooks, during the
backward) and the optimizer step. Prints seconds (min / median over ``--steps``) and fp32 parameter
bytes updated per second.

    python benchmarks/offload_optimizer.py --params 1e9 --tensors 64          # on a GPU machine
    python benchmarks/offload_optimizer.py --params 2e7 --device cpu           # host step only
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from composer3d.launch.distributed import resolve_device
from composer3d.memory.optimizer_offload import HostOffloadOptimizer


def _params(total: float, tensors: int, device: torch.device) -> list[torch.nn.Parameter]:
    rows = max(1, int(total / tensors / 4096))
    gen = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(rows, 4096, generator=gen).to(device))
        for _ in range(tensors)
    ]


def _backward(params: list[torch.nn.Parameter]) -> None:
    """Gradients made by autograd (torchao's optimizer copies them to the host from its gradient
    hooks)."""
    sum((p * 1e-3).sum() for p in params).backward()


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _time(make_optimizer, params, device, steps: int) -> list[float]:
    optimizer = make_optimizer(params)
    times = []
    for _ in range(steps + 1):  # the first step makes the state: not timed
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        _backward(params)
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    if hasattr(optimizer, "close"):
        optimizer.close()
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=2e8, help="parameters in all (fp32)")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--device", default="auto", help="auto (the accelerator if there is one) | cpu | cuda"
    )
    args = parser.parse_args()
    device = resolve_device(args.device)
    settings = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    params = _params(args.params, args.tensors, device)
    numel = sum(p.numel() for p in params)
    with tempfile.TemporaryDirectory() as files:
        candidates = {
            "host fused AdamW (offload=optimizer)": lambda ps: HostOffloadOptimizer(
                [{"params": ps}], torch.optim.AdamW, device, fused=True, **settings
            ),
            "host foreach AdamW": lambda ps: HostOffloadOptimizer(
                [{"params": ps}], torch.optim.AdamW, device, foreach=True, **settings
            ),
            "host fused AdamW, state in files (offload_dir)": lambda ps: HostOffloadOptimizer(
                [{"params": ps}],
                torch.optim.AdamW,
                device,
                offload_dir=files,
                fused=True,
                **settings,
            ),
        }
        if device.type != "cpu":
            candidates["device fused AdamW (no offload)"] = lambda ps: torch.optim.AdamW(
                ps, fused=True, **settings
            )
            if device.type == "cuda":
                from torchao.optim import CPUOffloadOptimizer

                candidates["torchao CPUOffloadOptimizer"] = lambda ps: CPUOffloadOptimizer(
                    ps, torch.optim.AdamW, fused=True, **settings
                )
        print(
            f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'host'}"
            "), "
            f"{numel / 1e6:.0f}M fp32 parameters in {len(params)} tensors, host threads "
            f"{torch.get_num_threads()}"
        )
        for name, make in candidates.items():
            times = _time(make, params, device, args.steps)
            best, median = min(times), statistics.median(times)
            print(
                f"{name:50s} step {best:8.3f} s min {median:8.3f} s median  "
                f"{numel * 4 / median / 1e9:6.2f} GB/s"
            )


if __name__ == "__main__":
    main()
