"""ZeRO-1's gradient buckets (parallel/data_parallel/zero_buckets.py,
parallel/data_parallel/zero.py) on 4 gloo ranks against plain PyTorch: the reduced gradient slices
and the updated parameters equal an AdamW step on the all-reduced gradients; the collectives are one
reduce-scatter (in the reduce dtype) and one all-gather per bucket, no all-reduce; the first
bucket's reduce-scatter starts while the backward still has layers to go, and only the last
micro-batch reduces."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import spawn
from torch.distributed.device_mesh import init_device_mesh

from composer3d.parallel.data_parallel.zero import OptimizerStateSharder
from composer3d.parallel.data_parallel.zero_buckets import plan_buckets

# 1765 parameters: slices of uneven lengths, a parameter cut between ranks, a rank holding parts of
# several
SIZES = [16 * 32, 32, 32 * 32, 32, 32 * 5, 5]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5)
    )


def test_buckets_are_laid_out_back_to_front_without_splitting_a_parameter():
    buckets = plan_buckets(SIZES, 600, 4)
    assert [b.members for b in buckets] == [
        [5, 4, 3],
        [2],
        [1, 0],
    ]  # the last layer's first: the backward's order
    assert [b.offsets for b in buckets] == [[0, 5, 165], [0], [0, 32]]
    assert [b.length for b in buckets] == [
        200,
        1024,
        544,
    ]  # 197 padded to a multiple of the 4 ranks


def _recording(events: list, kind: str, name: str):
    original = getattr(dist, name)

    def collective(*args, **kwargs):
        events.append((kind, str(args[1].dtype) if len(args) > 1 else None))
        return original(*args, **kwargs)

    setattr(dist, name, collective)


def _zero1_matches_plain_adamw(rank, world, reduce_dtype, micro_batches, gather_dtype):
    reduce_dtype, gather_dtype = getattr(torch, reduce_dtype), getattr(torch, gather_dtype)
    model, reference, computing = _model(), _model(), _model()
    mesh = init_device_mesh("cpu", (world,))
    sharder = OptimizerStateSharder(
        list(model.parameters()),
        [mesh] * len(SIZES),
        reduce_dtype,
        bucket_bytes=600 * reduce_dtype.itemsize,
        backwards_per_step=micro_batches,
        gather_dtype=gather_dtype,
    )
    # the reference's fp32 parameters are the masters; it computes from them rounded to the gather
    # dtype
    assert sharder.keeps_masters == (gather_dtype != torch.float32)
    optimizer = torch.optim.AdamW(sharder.shards, lr=1e-2)
    sharder.attach(optimizer)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    events: list = []
    # the names zero_buckets calls (torch >= 2.13: *_single)
    _recording(
        events,
        "reduce_scatter",
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor",
    )
    _recording(
        events,
        "all_gather",
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor",
    )
    _recording(events, "all_reduce", "all_reduce")
    data = torch.Generator().manual_seed(rank)
    for step in range(2):
        events.clear()
        inputs = torch.randn(micro_batches, 4, 16, generator=data)
        for x in inputs:
            # the first layer's output: its gradient comes before the first layer's backward
            hidden = model[0](x)
            hidden.register_hook(
                lambda grad: events.append(("backward reaches the first layer", None))
            )
            model[1:](hidden).square().sum().backward()
            events.append(("micro-batch done", None))
        sharder.finish_reduction()
        reduce_scatters = [e for e in events if e[0] == "reduce_scatter"]
        assert {e[1] for e in reduce_scatters} == {str(reduce_dtype)}, events
        assert [e[0] for e in events if e[0] != "reduce_scatter"] == [
            "backward reaches the first layer",
            "micro-batch done",
        ] * micro_batches, events
        # the last micro-batch's backward alone reduces: two buckets go before it reaches the first
        # layer, one after
        last = [e[0] for e in events[len(events) - 5 :]]
        assert (
            last
            == [
                "reduce_scatter",
                "reduce_scatter",
                "backward reaches the first layer",
                "reduce_scatter",
                "micro-batch done",
            ]
            and len(reduce_scatters) == 3
        ), events
        assert all(p.grad is None for p in model.parameters()), "the buckets hold the gradients"

        with torch.no_grad():
            for c, p in zip(computing.parameters(), reference.parameters()):
                c.copy_(p.to(gather_dtype))
        for x in inputs:  # the reference: the gradient of all ranks' micro-batches, all-reduced
            computing(x).square().sum().backward()
        for c, p in zip(computing.parameters(), reference.parameters()):
            dist.all_reduce(c.grad)
            p.grad, c.grad = c.grad, None
        tolerance = (
            dict(rtol=1e-5, atol=1e-5)
            if reduce_dtype == torch.float32
            else dict(rtol=2e-2, atol=2e-2)
        )
        for shard, p, (lo, hi) in zip(sharder.shards, reference.parameters(), sharder.bounds):
            torch.testing.assert_close(shard.grad, p.grad.view(-1)[lo:hi], **tolerance)
        held = sum(s.numel() for s in sharder.shards)
        assert abs(held - sum(SIZES) / world) <= len(SIZES), (
            f"rank {rank} owns {held} of {sum(SIZES)} elements"
        )

        events.clear()
        optimizer.step()
        reference_optimizer.step()
        # one per bucket, in the gather dtype
        assert events == [("all_gather", str(gather_dtype))] * 3, events
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q.to(gather_dtype).float(), **tolerance)
            assert torch.equal(p, p.to(gather_dtype).float()), (
                "every rank computes from the rounded values"
            )
        for shard, p, q, (lo, hi) in zip(
            sharder.shards, model.parameters(), reference.parameters(), sharder.bounds
        ):
            # the masters keep every bit
            torch.testing.assert_close(shard, q.view(-1)[lo:hi], **tolerance)
            assert torch.equal(p.view(-1)[lo:hi], shard.to(gather_dtype).float())
        if sharder.keeps_masters:
            assert all(
                s.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                for s, p in zip(sharder.shards, model.parameters())
            ), "masters of their own"
            held = torch.cat([s.detach() for s in sharder.shards])
            assert not torch.equal(held, held.to(gather_dtype).float()), (
                "masters rounded: the updates' bits lost"
            )
            assert sharder.master_bytes() == 4 * held.numel()
        else:
            assert sharder.master_bytes() == 0
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)


# bf16 gather: the parameters travel in the compute dtype (precision.param_dtype), fp32 masters in
# the optimizer
@pytest.mark.parametrize(
    "reduce_dtype, micro_batches, gather_dtype",
    [("float32", 1, "float32"), ("bfloat16", 2, "float32"), ("float32", 1, "bfloat16")],
)
def test_zero1_reduce_scatters_buckets_during_the_backward(
    tmp_path, reduce_dtype, micro_batches, gather_dtype
):
    spawn(_zero1_matches_plain_adamw, 4, tmp_path, reduce_dtype, micro_batches, gather_dtype)


def _norm_in_one_reduction(rank, world):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from composer3d.parallel.mesh import Layout
    from composer3d.training.grad import clip_grad_norm_

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same full gradients on every rank
    full = [torch.randn(8, 6), torch.randn(8), torch.randn(6, 4), torch.randn(8, 4), torch.randn(5)]
    # as TP × FSDP, FSDP's norms, replicated, TP only (a mesh dim of its own), a plain tensor
    placed = [
        distribute_tensor(full[0], mesh, [Shard(0), Shard(1)]),
        distribute_tensor(full[1], mesh, [Shard(0), Replicate()]),
        distribute_tensor(full[2], mesh, [Replicate(), Replicate()]),
        distribute_tensor(full[3], mesh["tp"], [Shard(0)]),
        full[4].clone(),
    ]
    params = []
    for grad in placed:
        param = nn.Parameter(torch.zeros_like(grad))
        # clipped in place below; ``placed`` stays whole for the fused step's check
        param.grad = grad.clone()
        params.append(param)
    expected = torch.cat([g.reshape(-1) for g in full]).norm()
    with CommDebugMode() as comm:
        norm = clip_grad_norm_(params, 1.0, Layout(dp_shard=2, tp=2))
    # one all-reduce for every mesh and dimension
    assert comm.get_total_counts() == 1, comm.get_comm_counts()
    torch.testing.assert_close(norm, expected)

    def grads(ps):
        return torch.cat(
            [
                (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).reshape(-1)
                for p in ps
            ]
        )

    torch.testing.assert_close(grads(params).norm(), torch.tensor(1.0), rtol=1e-5, atol=1e-5)

    # Handed to fused AdamW, the clip happens in its step: the gradients are left whole until then,
    # and the step divides them by the same factor, which makes the update of the gradients clipped
    # here
    handed = []
    for grad in placed:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        handed.append(param)

    # one parameter group per tensor: a fused step takes no mix of meshes or of plain and DTensor
    def adamw(
        group,
    ):
        return torch.optim.AdamW([{"params": [p]} for p in group], lr=0.1, fused=True)

    stepper = adamw(handed)
    with CommDebugMode() as comm:
        norm = clip_grad_norm_(handed, 1.0, Layout(dp_shard=2, tp=2), optimizer=stepper)
    assert comm.get_total_counts() == 1, comm.get_comm_counts()
    torch.testing.assert_close(grads(handed).norm(), expected)  # not scaled before the step
    torch.testing.assert_close(stepper.grad_scale, expected)
    adamw(params).step()
    stepper.step()
    for clipped_here, clipped_in_step in zip(params, handed):
        torch.testing.assert_close(clipped_in_step.grad, clipped_here.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(clipped_in_step, clipped_here, rtol=1e-6, atol=1e-7)


def test_gradient_norm_over_several_meshes_is_one_all_reduce(tmp_path):
    spawn(_norm_in_one_reduction, 4, tmp_path)
