"""ZeRO-1's gradient reduction: buckets reduce-scattered during the backward, as Megatron's
distributed optimizer.

The parameters' local tensors are laid out back to front (the order the backward reaches them) in
flat buckets of about ``bucket_bytes``, each padded to a multiple of the data-parallel ranks and cut
into that many equal slices: rank r owns slice r of every bucket. A post-accumulate-grad hook moves
each gradient into its bucket's fp32 buffer (accumulating over the step's backwards, then freeing
the parameter's own .grad); once every gradient of a bucket has had its last backward of the step,
the bucket is reduce-scattered asynchronously in ``reduce_dtype`` while the backward goes on.
``finish`` launches what no hook did (parameters without a gradient, schedules that accumulate
weight gradients outside autograd's hooks) and waits: each rank then holds the summed gradient of
its slices only. The same buffers carry the all-gather of the updated parameters afterwards
(``OptimizerStateSharder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# torch >= 2.13 names them *_single (the older names warn that they are deprecated); torch 2.11/2.12
# have only those
def reduce_scatter(out: torch.Tensor, source: torch.Tensor, group: dist.ProcessGroup):
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(out, source, group=group, async_op=True)


def all_gather(out: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup):
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(out, mine, group=group, async_op=True)


@dataclass
class Bucket:
    members: list[int]  # indices of its parameters
    offsets: list[int]  # where each starts in the bucket
    length: int  # elements, padded to a multiple of the ranks
    # fp32 (the parameters' dtype): gradients, then gathered parameters
    buffer: torch.Tensor | None = None
    # this rank's slice, summed over the ranks, in the parameters' dtype
    reduced: torch.Tensor | None = None
    waiting: int = 0  # members whose gradient is not complete yet this step
    # the in-flight reduce-scatter and what it must keep alive
    work: list = field(default_factory=list)


def plan_buckets(sizes: list[int], bucket_elements: int, ranks: int) -> list[Bucket]:
    """Parameters (by element count) back to front into buckets of at most ``bucket_elements`` (one
    larger parameter makes a bucket of its own); never a parameter split across two buckets."""
    buckets: list[Bucket] = []
    members: list[int] = []
    offsets: list[int] = []
    filled = 0
    for index in reversed(range(len(sizes))):
        if members and filled + sizes[index] > bucket_elements:
            buckets.append(Bucket(members, offsets, -(-filled // ranks) * ranks))
            members, offsets, filled = [], [], 0
        members.append(index)
        offsets.append(filled)
        filled += sizes[index]
    if members:
        buckets.append(Bucket(members, offsets, -(-filled // ranks) * ranks))
    return buckets


class GradientBuckets:
    def __init__(
        self,
        params: list[torch.Tensor],
        group: dist.ProcessGroup,
        reduce_dtype: torch.dtype,
        bucket_bytes: int,
        backwards_per_step: int,
    ):
        self.params, self.group, self.reduce_dtype = params, group, reduce_dtype
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        dtypes = {local(p).dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                "ZeRO-1 keeps one dtype of parameters (the fp32 masters), got "
                f"{sorted(map(str, dtypes))}"
            )
        self.dtype = dtypes.pop()
        self.backwards_per_step = backwards_per_step
        sizes = [local(p).numel() for p in params]
        self.buckets = plan_buckets(
            sizes, max(1, bucket_bytes // reduce_dtype.itemsize), self.ranks
        )
        self.place = {}  # parameter index -> (bucket, offset in it)
        for bucket in self.buckets:
            device = local(params[bucket.members[0]]).device
            bucket.buffer = torch.zeros(bucket.length, dtype=self.dtype, device=device)
            # one rank (the experts under ep = dp_shard): its gradients are the sum, in the buffer
            # itself
            bucket.reduced = (
                bucket.buffer
                if self.ranks == 1
                else torch.zeros(bucket.length // self.ranks, dtype=self.dtype, device=device)
            )
            bucket.waiting = len(bucket.members)
            for index, offset in zip(bucket.members, bucket.offsets):
                self.place[index] = (bucket, offset)
        # backwards whose gradient each parameter has had this step
        self.backwards = [0] * len(params)
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(lambda p, i=index: self._on_gradient(i))

    def owned(self, index: int) -> tuple[int, int, Bucket, int]:
        """This rank's part of parameter ``index``: (lo, hi) of its flat local tensor, its bucket,
        and where that part starts in the bucket's reduced slice (lo == hi: none of it)."""
        bucket, offset = self.place[index]
        lo, hi = self.owned_by(index, self.rank)
        return lo, hi, bucket, offset + lo - self.rank * (bucket.length // self.ranks)

    def owned_by(self, index: int, rank: int) -> tuple[int, int]:
        """(lo, hi) of parameter ``index``'s flat local tensor that ``rank`` of the group owns."""
        bucket, offset = self.place[index]
        width, numel = bucket.length // self.ranks, local(self.params[index]).numel()
        lo = min(max(rank * width - offset, 0), numel)
        hi = min(max((rank + 1) * width - offset, 0), numel)
        return lo, hi

    @torch.no_grad()
    def _take_gradient(self, index: int, accumulate: bool) -> None:
        param = self.params[index]
        bucket, offset = self.place[index]
        target = bucket.buffer[offset : offset + local(param).numel()]
        grad = param.grad
        if grad is None:
            if not accumulate:
                target.zero_()
            return
        # in the parameter's layout (``tensor.keep_grads_in_param_layout``)
        grad = local(grad).reshape(-1)
        target.add_(grad) if accumulate else target.copy_(grad)
        param.grad = None  # the bucket holds it now

    def _on_gradient(self, index: int) -> None:
        done = self.backwards[index]
        if done >= self.backwards_per_step:
            raise RuntimeError(
                f"parameter {index} had more backwards in a step than the "
                f"{self.backwards_per_step} micro-batches ZeRO-1 expects"
            )
        self._take_gradient(index, accumulate=done > 0)
        self.backwards[index] = done + 1
        if done + 1 == self.backwards_per_step:
            bucket = self.place[index][0]
            bucket.waiting -= 1
            if bucket.waiting == 0:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.ranks == 1:
            bucket.work = [None, None, bucket.reduced]
            return
        source = (
            bucket.buffer
            if self.reduce_dtype == self.dtype
            else bucket.buffer.to(self.reduce_dtype)
        )
        out = (
            bucket.reduced
            if self.reduce_dtype == self.dtype
            else torch.empty(
                bucket.length // self.ranks, dtype=self.reduce_dtype, device=source.device
            )
        )
        work = reduce_scatter(out, source, self.group)
        bucket.work = [work, source, out]

    def finish(self) -> None:
        """Launch the buckets no hook completed, wait for every reduce-scatter, and start the next
        step afresh."""
        for bucket in self.buckets:
            if bucket.work:
                continue
            for index in bucket.members:
                if self.backwards[index] < self.backwards_per_step:
                    self._take_gradient(index, accumulate=self.backwards[index] > 0)
            self._launch(bucket)
        for bucket in self.buckets:
            work, _, out = bucket.work
            if work is not None:
                work.wait()
            if out is not bucket.reduced:
                bucket.reduced.copy_(out)
            bucket.work, bucket.waiting = [], len(bucket.members)
        self.backwards = [0] * len(self.params)

    def buffer_bytes(self) -> int:
        return sum(
            (b.buffer.numel() + (b.reduced is not b.buffer) * b.reduced.numel())
            * b.buffer.element_size()
            for b in self.buckets
        )
