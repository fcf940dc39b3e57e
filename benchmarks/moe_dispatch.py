"""Expert parallel's token exchange and expert load, measured side by side for several ep degrees in
one run.

    python benchmarks/moe_dispatch.py [--ep 1 2 4] [--tokens 4096] [--dim 256] [--hidden 512]
                                      [--experts 8] [--top-k 2] [--steps 5] [--device auto] [--json]

For each ep degree it runs one mixture-of-experts layer (composer3d's ``models.moe``, its experts
split over ep ranks: gloo processes on the CPU, NCCL on accelerators when there are enough) through
forward and backward on ``--tokens`` tokens per rank, and reports per rank:
  - rows sent to other ranks per step by the forward's all-to-alls (dispatch and combine; backward
    sends as many again), their bytes, and the same predicted for a uniform router: tokens · top_k ·
    (ep−1)/ep rows each way;
  - time per step (the median), and the load of the busiest and idlest expert over the mean (1.0 =
    balanced), at initialization and after ``--steps`` steps of the auxiliary-loss-free bias update
    (DeepSeek-V3's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, ep: int, args, store: str, out: dict) -> None:
    import torch.distributed._functional_collectives as funcol

    from composer3d.launch.distributed import shut_down
    from composer3d.models.moe import MoE

    os.environ["OMP_NUM_THREADS"] = "1"
    device = torch.device(args.device, rank) if args.device != "cpu" else torch.device("cpu")
    backend = (
        "gloo" if device.type == "cpu" else dist.Backend.default_device_backend_map[device.type]
    )
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ep)
    sent = {"rows": 0}
    exchange = funcol.all_to_all_single_autograd

    def counting(tensor, output_split_sizes, input_split_sizes, group):
        me = dist.get_rank(group)
        sent["rows"] += sum(n for i, n in enumerate(input_split_sizes) if i != me)
        return exchange(tensor, output_split_sizes, input_split_sizes, group)

    # the layer's dispatch and combine both go through it
    funcol.all_to_all_single_autograd = counting
    cfg = SimpleNamespace(
        experts=args.experts,
        top_k=args.top_k,
        shared_experts=0,
        expert_hidden_dim=args.hidden,
        dense_layers=0,
        score_func="softmax",
        normalize_top_k=True,
        route_scale=1.0,
        aux_loss_coef=0.0,
        bias_update_rate=args.bias_rate,
        capacity_factor=0.0,
    )
    torch.manual_seed(0)  # every rank builds the same whole layer, then keeps its experts
    layer = MoE(args.dim, args.hidden, cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        # logits of unit scale: scores that differ between experts
        layer.gate.weight.normal_(0, args.dim**-0.5)
    layer.init_buffers()
    # Tokens share a common direction, as real hidden states do, so the router starts out
    # unbalanced.
    common = torch.randn(args.dim, generator=torch.Generator().manual_seed(0))
    if ep > 1:
        local = args.experts // ep
        for name in ("w1", "w2", "w3"):
            whole = getattr(layer.experts, name)
            setattr(
                layer.experts,
                name,
                torch.nn.Parameter(whole.detach()[rank * local : (rank + 1) * local].clone()),
            )
        layer.ep_group = dist.group.WORLD
    layer.to(device)
    generator = torch.Generator().manual_seed(1 + rank)
    times, loads = [], []
    for step in range(args.steps + 1):
        x = (
            (torch.randn(1, args.tokens, args.dim, generator=generator) + common)
            .to(device)
            .requires_grad_()
        )
        sent["rows"] = 0
        if device.type != "cpu":
            torch.accelerator.synchronize()
        began = time.perf_counter()
        layer(x).square().mean().backward()
        if device.type != "cpu":
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - began)
        counts = layer.routed_tokens.clone()
        dist.all_reduce(counts)
        loads.append(((counts.max() / counts.mean()).item(), (counts.min() / counts.mean()).item()))
        with torch.no_grad():  # DeepSeek-V3's bias update on the global load
            layer.expert_bias += args.bias_rate * torch.sign(counts.mean() - counts)
        layer.routed_tokens.zero_()
    if rank == 0:
        element = torch.tensor([], dtype=torch.float32).element_size()
        out[ep] = {
            "rows_sent_per_step": sent["rows"],  # the last step's forward: dispatch and combine
            "bytes_sent_per_step": sent["rows"] * args.dim * element,
            "rows_uniform_router": 2 * args.tokens * args.top_k * (ep - 1) / ep,
            "step_time_s_median": statistics.median(times[1:]),
            "load_max_init": loads[0][0],
            "load_min_init": loads[0][1],
            "load_max_last": loads[-1][0],
            "load_min_last": loads[-1][1],
        }
    shut_down(finished=True)  # collect and wait first: gloo can abort at exit otherwise


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bias-rate", type=float, default=0.01)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.device == "auto":
        accelerator = torch.accelerator.current_accelerator()
        enough = accelerator is not None and torch.accelerator.device_count() >= max(args.ep)
        args.device = accelerator.type if enough else "cpu"
    results = mp.Manager().dict()
    for ep in args.ep:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(
                _worker, args=(ep, args, os.path.join(tmp, "store"), results), nprocs=ep, join=True
            )
    rows = {ep: results[ep] for ep in args.ep}
    if args.json:
        print(json.dumps({"device": args.device, "results": rows}))
        return
    print(
        f"device {args.device}; {args.tokens} tokens per rank, dim {args.dim}, {args.experts} "
        "experts, "
        f"top-{args.top_k}, fp32"
    )
    print(
        f"{'ep':>3} {'rows sent/step':>15} {'uniform router':>15} {'MiB sent/step':>14} "
        f"{'step ms':>9} "
        f"{'load max/min at init':>21} {'after bias steps':>17}"
    )
    for ep, r in rows.items():
        print(
            f"{ep:>3} {r['rows_sent_per_step']:>15} {r['rows_uniform_router']:>15.0f} "
            f"{r['bytes_sent_per_step'] / 2**20:>14.2f} {r['step_time_s_median'] * 1e3:>9.1f} "
            f"{r['load_max_init']:>10.2f}/{r['load_min_init']:<10.2f} "
            f"{r['load_max_last']:>8.2f}/{r['load_min_last']:.2f}"
        )


if __name__ == "__main__":
    main()
