"""Context parallel's attention per rank against cp: the bytes autograd saves and the bytes the ring
sends.

    python benchmarks/context_parallel.py [--cp 1 2 4] [--seq 4096] [--dim 512] [--heads 8]
                                          [--kv-heads 4] [--batch 1] [--style ring] [--documents 0]
                                          [--balance head_tail ...] [--steps 3] [--device auto]
                                          [--json]

One group of max(cp) processes (gloo on the CPU, the accelerator's backend on one:
launch/distributed.py) runs each cp degree in turn, as max(cp)/cp independent groups of cp ranks:
the native model's attention layer (models/llama: q/k/v projections, RoPE at global positions,
attention, output projection) under ``parallel.cp_style``, forward and backward, on each rank's
share (``--balance``: ``parallel.cp_balance``, each in turn) of ``--batch`` causal sequences of
``--seq`` tokens, or with ``--documents MEAN`` of packed documents of exponentially distributed
length (mean MEAN tokens, the same seeded draw for every cp and balance), masked as training masks
them. Per rank it reports:
  - the bytes of the tensors autograd saves for backward (each storage once, parameters left out):
    the attention activation memory that context parallel cuts. It falls as 1/cp from cp 2 on;
    against cp 1 (the model's own SDPA) the ring keeps one more copy of the attention output (its
    (batch, heads, tokens, dim) result, which the output projection's reshape then copies), +24% at
    these shapes;
  - the bytes the ring sends per step (forward and backward, every pass of keys/values and of their
    gradients), beside the planner's count (``composer3d.plan.context.collectives``);
  - the median time of a step, and the largest difference of this rank's output from full
    attention's (one process, the same weights) at the tokens it holds;
  - the attention work of the busiest rank over the mean: counted (the scores the ring's blocks
    compute, ``parallel.cp_balance.rank_work``) and measured (the CPU time of this rank's thread in
    the ring's block kernels, forward and backward: what the rank computes, not its waits, and not
    inflated where processes share cores).
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
    """A saved-tensors hook pair that adds up the bytes of each storage autograd saves once (not the
    weights)."""
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
    from composer3d.models.llama.attention import Attention, document_mask, rope_tables
    from composer3d.parallel.context import ring_attention
    from composer3d.parallel.context.balance import document_ids

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    # a thread a rank, as OMP_NUM_THREADS asks (read when the forkserver loaded torch)
    torch.set_num_threads(1)
    device = resolve_device(args.device, rank)
    init_process_group(device, Env(rank, rank, world))
    sent, compute = [0], [0.0]
    pass_on = ring_attention._Ring.pass_on

    def counting(ring, tensor):
        sent[0] += tensor.numel() * tensor.element_size()
        return pass_on(ring, tensor)

    def timed(kernel):
        def run(*args, **kwargs):
            began = time.thread_time()
            result = kernel(*args, **kwargs)
            if device.type != "cpu":
                torch.accelerator.synchronize()
            compute[0] += time.thread_time() - began
            return result

        return run

    ring_attention._Ring.pass_on = counting
    ring_attention.block_forward = timed(ring_attention.block_forward)
    ring_attention.block_backward = timed(ring_attention.block_backward)
    # the same weights and sequence on every rank (and in the one-process reference)
    torch.manual_seed(0)
    attention = Attention(args.dim, args.heads, args.kv_heads).to(device)
    x = torch.randn(args.batch, args.seq, args.dim, device=device)
    positions = _packed_positions(args, device)
    documents = None if positions is None else document_ids(positions)
    cos, sin = rope_tables(args.dim // args.heads, args.seq, 500000.0, device)
    # RoPE at each token's position in its document, (batch, seq, …) tables
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    mask = None if documents is None else document_mask(documents, args.dim // args.heads)
    reference = attention(x, cos, sin, mask).detach()
    for cp in args.cp:
        cp_mesh = (
            init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("replica", "cp"))["cp"]
            if cp > 1
            else None
        )
        for balance in args.balance if cp > 1 else ["-"]:
            out[(cp, balance, rank)] = _measure(
                attention,
                x,
                (cos, sin),
                positions,
                mask,
                reference,
                cp_mesh,
                balance,
                args,
                sent,
                compute,
            )
        attention.context_parallel = None
    shut_down(finished=True)


def _packed_positions(args, device) -> torch.Tensor | None:
    """``--batch`` rows of documents of exponentially distributed length (mean ``--documents``), as
    packed data holds them: positions restarting at every document; None for causal rows."""
    if not args.documents:
        return None
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.batch):
        positions = []
        while len(positions) < args.seq:
            positions.extend(
                range(
                    max(
                        1, int(torch.empty(1).exponential_(1 / args.documents, generator=generator))
                    )
                )
            )
        rows.append(positions[: args.seq])
    return torch.tensor(rows, device=device)


def _measure(
    attention,
    x,
    rope,
    positions,
    mask,
    reference,
    cp_mesh,
    balance: str,
    args,
    sent: list[int],
    compute: list[float],
) -> dict:
    """One rank's steps of ``attention`` on its share of ``x`` (all of it without ``cp_mesh``) under
    ``balance``."""
    import torch.distributed as dist

    from composer3d.parallel.context.balance import document_ids, rank_work
    from composer3d.parallel.context.context_parallel import ContextParallel

    device = x.device
    documents = None if positions is None else document_ids(positions)
    held, plan, work = (
        torch.arange(args.seq, device=device),
        mask,
        [1],
    )  # cp 1: the model's own attention, all the work
    if cp_mesh is not None:
        context = ContextParallel(cp_mesh, args.style, balance)
        context.place(positions, args.seq)  # as the trainer places each batch
        held, plan = (
            context.token_index(args.seq, device),
            context.attention_plan(args.seq, documents, device),
        )
        work = rank_work(
            context.placement(args.seq), None if documents is None else documents.cpu()
        )
        attention.context_parallel = context
    cos, sin = (table.index_select(table.dim() - 2, held) for table in rope)
    local = x.index_select(1, held).requires_grad_()
    parameters = {p.untyped_storage().data_ptr() for p in attention.parameters()}
    times, computes, saved, error = [], [], 0, 0.0
    for _ in range(args.steps):
        sent[0], compute[0] = 0, 0.0
        dist.barrier()
        began = time.perf_counter()
        hooks, total = _saved_bytes(parameters)
        with hooks:
            output = attention(local, cos, sin, plan)
        output.sum().backward()
        if device.type != "cpu":
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - began)
        computes.append(compute[0])
        saved = total[0]
        error = (output.detach() - reference.index_select(1, held)).abs().max().item()
    return {
        "tokens": int(held.numel()),
        "saved_bytes": saved,
        "sent_bytes": sent[0],
        "step_s": statistics.median(times),
        "compute_s": statistics.median(computes),
        "work": work,
        "max_error": error,
    }


def predicted_ring_bytes(args, cp: int, element_size: int) -> float:
    """The planner's count of the ring's bytes for one attention layer (``plan.context``)."""
    from composer3d.parallel.mesh import Layout
    from composer3d.plan.context import collectives
    from composer3d.plan.layouts import Candidate
    from composer3d.plan.shapes import ModelShape, stage_sets

    shape = ModelShape(
        dim=args.dim,
        n_layers=1,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.dim // args.heads,
        ffn=args.dim,
        vocab=1,
        tied=False,
    )
    candidate = Candidate(
        layout=Layout(cp=cp),
        zero_stage=3,
        sequence_parallel=False,
        pp_schedule="1f1b",
        stages_per_rank=1,
        micro_batch_size=args.batch,
        microbatches=1,
        activation_checkpointing="none",
        cp_style=args.style,
    )
    stages = stage_sets(shape, 1, 1, "1f1b")[0]
    return sum(
        col.bytes
        for col in collectives(shape, candidate, stages, args.seq, element_size)
        if col.kind == "send"
    )


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
    parser.add_argument(
        "--documents", type=int, default=0, help="mean document length (0: one causal sequence)"
    )
    parser.add_argument(
        "--balance", nargs="+", default=["head_tail"], choices=("head_tail", "documents")
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = mp.Manager().dict()
    world = max(args.cp)
    if any(world % cp for cp in args.cp):
        parser.error(
            f"--cp {args.cp}: each must divide the largest, {world} (the processes they share)"
        )
    # forked from one server that imported torch and composer3d once (each spawned process would
    # import them anew)
    mp.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "composer3d.models.llama.attention",
            "composer3d.parallel.context.context_parallel",
            "composer3d.launch.distributed",
        ]
    )
    mp.start_processes(
        _worker,
        args=(world, args, _free_port(), out),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )
    rows = []
    for cp, balance in [
        (cp, balance) for cp in args.cp for balance in (args.balance if cp > 1 else ["-"])
    ]:
        ranks = [out[(cp, balance, r)] for r in range(world)]
        computes = [r["compute_s"] for r in ranks]
        rows.append(
            {
                "cp": cp,
                "balance": balance,
                "tokens_per_rank": ranks[0]["tokens"],
                "saved_bytes_per_rank": max(r["saved_bytes"] for r in ranks),
                "ring_bytes_per_rank": max(r["sent_bytes"] for r in ranks),
                "ring_bytes_predicted": predicted_ring_bytes(args, cp, 4)
                if cp > 1 and args.style == "ring"
                else 0,
                "step_s": max(r["step_s"] for r in ranks),
                "compute_s": max(computes),
                "max_error": max(r["max_error"] for r in ranks),
                # busiest rank over the mean: the ring's counted scores, and its measured
                # block-kernel time
                "work_busiest_over_mean": max(ranks[0]["work"]) / statistics.mean(ranks[0]["work"]),
                "compute_busiest_over_mean": max(computes) / statistics.mean(computes)
                if any(computes)
                else 1.0,
            }
        )
    base = rows[0]["saved_bytes_per_rank"] * rows[0]["cp"]
    for row in rows:
        row["saved_vs_one_over_cp"] = row["saved_bytes_per_rank"] * row["cp"] / base
    if args.json:
        print(json.dumps(rows))
        return
    masking = f"documents of mean {args.documents} tokens" if args.documents else "causal"
    print(
        f"attention (dim {args.dim}, {args.heads} heads, {args.kv_heads} KV heads), {args.batch} × "
        f"{args.seq} tokens "
        f"({masking}), cp_style={args.style}, fp32, per rank; busiest/mean: the busiest rank's "
        "attention work over "
        "the mean, counted (scores) and measured (block kernels' CPU time):"
    )
    print(
        f"{'cp':>3}{'balance':>11}{'tokens':>8}{'saved MiB':>11}{'× cp / cp 1':>13}{'ring MiB':>10}"
        f"{'predicted':>11}"
        f"{'step ms':>9}{'counted':>9}{'measured':>10}{'max |Δ| vs full':>17}"
    )
    for r in rows:
        print(
            f"{r['cp']:>3}{r['balance']:>11}{r['tokens_per_rank']:>8}"
            f"{r['saved_bytes_per_rank'] / 2**20:>11.2f}"
            f"{r['saved_vs_one_over_cp']:>13.3f}{r['ring_bytes_per_rank'] / 2**20:>10.2f}"
            f"{r['ring_bytes_predicted'] / 2**20:>11.2f}{r['step_s'] * 1e3:>9.1f}"
            f"{r['work_busiest_over_mean']:>9.2f}"
            f"{r['compute_busiest_over_mean']:>10.2f}{r['max_error']:>17.2e}"
        )


if __name__ == "__main__":
    main()
