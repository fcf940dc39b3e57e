"""Context parallel's attention per rank against cp: the bytes autograd saves and the bytes the ring sends.

    python benchmarks/context_parallel.py [--cp 1 2 4] [--seq 4096] [--dim 512] [--heads 8] [--kv-heads 4]
                                          [--batch 1] [--style ring] [--steps 3] [--device auto] [--json]

One group of max(cp) processes (gloo on the CPU, the accelerator's backend on one: launch/distributed.py) runs each
cp degree in turn, as max(cp)/cp independent groups of cp ranks: the native model's attention layer (models/llama:
q/k/v projections, RoPE at global positions, attention, output projection) under ``parallel.cp_style``, forward
and backward, on each rank's head-tail share of one causal sequence of ``--seq`` tokens. Per rank it reports:
  - the bytes of the tensors autograd saves for backward (each storage once, parameters left out): the attention
    activation memory that context parallel cuts. It falls as 1/cp from cp 2 on; against cp 1 (the model's own
    SDPA) the ring keeps one more copy of the attention output (its (batch, heads, tokens, dim) result, which the
    output projection's reshape then copies), +24% at these shapes;
  - the bytes the ring sends per step (forward and backward, every pass of keys/values and of their gradients),
    beside the planner's count (``composer3d.plan.context.collectives``);
  - the median time of a step, and the largest difference of this rank's output from full attention's (one
    process, the same weights) at the tokens it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def _saved_bytes(parameters: set[int]):
    """A saved-tensors hook pair that adds up the bytes of each storage autograd saves once (not the weights)."""
    seen: set[int] = set()
    total = [0]

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in parameters:
            seen.add(key)
            total[0] += storage.nbytes()
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), total


def _worker(rank: int, world: int, args, port: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from composer3d.launch.distributed import Env, init_process_group, resolve_device, shut_down
    from composer3d.models.llama.attention import Attention, rope_tables
    from composer3d.parallel import ring_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    device = resolve_device(args.device, rank)
    init_process_group(device, Env(rank, rank, world))
    sent = [0]
    pass_on = ring_attention._Ring.pass_on

    def counting(ring, tensor):
        sent[0] += tensor.numel() * tensor.element_size()
        return pass_on(ring, tensor)

    ring_attention._Ring.pass_on = counting
    torch.manual_seed(0)  # the same weights and sequence on every rank (and in the one-process reference)
    attention = Attention(args.dim, args.heads, args.kv_heads).to(device)
    x = torch.randn(args.batch, args.seq, args.dim, device=device)
    cos, sin = rope_tables(args.dim // args.heads, args.seq, 500000.0, device)
    reference = attention(x, cos, sin, None).detach()
    for cp in args.cp:
        cp_mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("replica", "cp"))["cp"] \
            if cp > 1 else None
        out[(cp, rank)] = _measure(attention, x, cos, sin, reference, cp_mesh, args, sent)
        attention.context_parallel = None
    shut_down(finished=True)


def _measure(attention, x, cos, sin, reference, cp_mesh, args, sent: list[int]) -> dict:
    """One rank's steps of ``attention`` on its share of ``x`` (all of it without ``cp_mesh``)."""
    import torch.distributed as dist

    from composer3d.parallel.context import ContextParallel

    device = x.device
    held, plan = torch.arange(args.seq, device=device), None  # cp 1: the model's own causal attention
    if cp_mesh is not None:
        context = ContextParallel(cp_mesh, args.style)
        held, plan = context.token_index(args.seq, device), context.attention_plan(args.seq, None, device)
        attention.context_parallel = context
    local = x.index_select(1, held).requires_grad_()
    parameters = {p.untyped_storage().data_ptr() for p in attention.parameters()}
    times, saved, error = [], 0, 0.0
    for _ in range(args.steps):
        sent[0] = 0
        dist.barrier()
        began = time.perf_counter()
        hooks, total = _saved_bytes(parameters)
        with hooks:
            output = attention(local, cos[held], sin[held], plan)
        output.sum().backward()
        if device.type != "cpu":
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - began)
        saved = total[0]
        error = (output.detach() - reference.index_select(1, held)).abs().max().item()
    return {"tokens": int(held.numel()), "saved_bytes": saved, "sent_bytes": sent[0],
            "step_s": statistics.median(times), "max_error": error}


def predicted_ring_bytes(args, cp: int, element_size: int) -> float:
    """The planner's count of the ring's bytes for one attention layer (``plan.context``)."""
    from composer3d.plan.context import collectives
    from composer3d.plan.layouts import Candidate
    from composer3d.plan.shapes import ModelShape, stage_sets

    shape = ModelShape(dim=args.dim, n_layers=1, n_heads=args.heads, n_kv_heads=args.kv_heads,
                       head_dim=args.dim // args.heads, ffn=args.dim, vocab=1, tied=False)
    candidate = Candidate(pp=1, dp_replicate=1, dp_shard=1, tp=1, zero_stage=3, sequence_parallel=False,
                          pp_schedule="1f1b", stages_per_rank=1, micro_batch_size=args.batch, microbatches=1,
                          activation_checkpointing="none", cp=cp, cp_style=args.style)
    stages = stage_sets(shape, 1, 1, "1f1b")[0]
    return sum(col.bytes for col in collectives(shape, candidate, stages, args.seq, element_size) if col.kind == "send")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--style", default="ring", choices=("ring", "allgather", "ulysses"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = mp.Manager().dict()
    world = max(args.cp)
    if any(world % cp for cp in args.cp):
        parser.error(f"--cp {args.cp}: each must divide the largest, {world} (the processes they share)")
    # forked from one server that imported torch and composer3d once (each spawned process would import them anew)
    mp.set_forkserver_preload(["torch", "torch.distributed", "composer3d.models.llama.attention",
                               "composer3d.parallel.context", "composer3d.launch.distributed"])
    mp.start_processes(_worker, args=(world, args, _free_port(), out), nprocs=world, join=True,
                       start_method="forkserver")
    rows = []
    for cp in args.cp:
        ranks = [out[(cp, r)] for r in range(world)]
        rows.append({"cp": cp, "tokens_per_rank": ranks[0]["tokens"],
                     "saved_bytes_per_rank": max(r["saved_bytes"] for r in ranks),
                     "ring_bytes_per_rank": max(r["sent_bytes"] for r in ranks),
                     "ring_bytes_predicted": predicted_ring_bytes(args, cp, 4) if cp > 1 and args.style == "ring" else 0,
                     "step_s": max(r["step_s"] for r in ranks), "max_error": max(r["max_error"] for r in ranks)})
    base = rows[0]["saved_bytes_per_rank"] * rows[0]["cp"]
    for row in rows:
        row["saved_vs_one_over_cp"] = row["saved_bytes_per_rank"] * row["cp"] / base
    if args.json:
        print(json.dumps(rows))
        return
    print(f"attention (dim {args.dim}, {args.heads} heads, {args.kv_heads} KV heads), {args.batch} × {args.seq} tokens, "
          f"cp_style={args.style}, fp32, per rank:")
    print(f"{'cp':>3}{'tokens':>8}{'saved MiB':>11}{'× cp / cp 1':>13}{'ring MiB':>10}{'predicted':>11}"
          f"{'step ms':>9}{'max |Δ| vs full':>17}")
    for r in rows:
        print(f"{r['cp']:>3}{r['tokens_per_rank']:>8}{r['saved_bytes_per_rank'] / 2**20:>11.2f}"
              f"{r['saved_vs_one_over_cp']:>13.3f}{r['ring_bytes_per_rank'] / 2**20:>10.2f}"
              f"{r['ring_bytes_predicted'] / 2**20:>11.2f}{r['step_s'] * 1e3:>9.1f}{r['max_error']:>17.2e}")


if __name__ == "__main__":
    main()
