"""Summed next-token cross-entropy in fp32 over (possibly vocab-sharded) logits, without
full-vocabulary fp32 temporaries.

``F.cross_entropy(logits.float(), …)`` keeps an fp32 copy of the logits and its fp32 log-softmax for
backward: 8 bytes per vocabulary entry per token (8 GiB for seq 8192 × a 128k vocabulary). Here the
log-sum-exp is computed over row chunks, so only one chunk is fp32 at a time, and backward rebuilds
the softmax chunk by chunk from the logits (kept in their own dtype, bf16 in mixed precision) and
the per-row log-sum-exp: the gradient is ``softmax - one_hot`` and needs nothing else, so the
trainer has it written over the logits (``in_place``). Under tensor parallel the logits are sharded
on the vocabulary (the head's output, a DTensor ``Shard(-1)``); each chunk's max, sum of
exponentials and target logit are then completed with one all-reduce each over the tensor-parallel
group, as ``loss_parallel`` does, and no rank ever holds the full vocabulary. With
``compile.enabled``, and on an accelerator always, the per-chunk math runs as torch.compile'd
kernels, fused so that each reads the chunk once instead of passing fp32 temporaries through memory.
The same kernel gives each token's log-probability and its gradient (``target_log_probs``), for a
loss that is not a sum over tokens (preference tuning).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from composer3d.data import IGNORE_INDEX

CHUNK_ELEMENTS = 2**25  # fp32 elements of one chunk's temporaries (128 MiB)


# A low-precision chunk minus an fp32 row vector computes in fp32 (type promotion), with no fp32
# copy of the chunk.
def _chunk_row_max(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.amax(dim=1).float()  # a max is exact in any dtype


def _chunk_sum_exp(chunk: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    return (chunk - peak.unsqueeze(1)).exp_().sum(dim=1)


def _chunk_logsumexp(chunk: torch.Tensor) -> torch.Tensor:
    peak = _chunk_row_max(chunk)
    return peak + _chunk_sum_exp(chunk, peak).log()


def _chunk_grad_in_place(
    chunk: torch.Tensor,
    lse: torch.Tensor,
    index: torch.Tensor,
    here: torch.Tensor,
    weight: torch.Tensor,
) -> None:
    """Overwrites ``chunk`` with (softmax(chunk) − one_hot(target)) · weight, in its own dtype: each
    chunk's gradient needs only its own logits, so the gradient takes their memory and never exists
    beside them."""
    probs = (chunk - lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, index, -here.float().unsqueeze(1))
    chunk.copy_(probs.mul_(weight))


class ChunkKernels(NamedTuple):
    """The per-chunk math: eager, or compiled so each runs as one fused kernel that reads the (bf16)
    chunk once, instead of an fp32 copy, a max, a subtraction, an exp and a sum that each go through
    memory."""

    row_max: Callable
    sum_exp: Callable
    logsumexp: Callable
    grad_in_place: Callable


EAGER_KERNELS = ChunkKernels(_chunk_row_max, _chunk_sum_exp, _chunk_logsumexp, _chunk_grad_in_place)


@functools.cache
def compiled_kernels() -> ChunkKernels:
    """torch.compile'd chunk kernels, made on first use (shapes: one compile for full chunks, one
    for the last)."""
    return ChunkKernels(*(torch.compile(kernel) for kernel in EAGER_KERNELS))


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        group,
        kernels: ChunkKernels,
        in_place: bool,
        per_token: bool,
    ) -> torch.Tensor:
        rows, vocab = logits.shape
        local = targets - vocab_start
        here = (local >= 0) & (local < vocab) & (targets != IGNORE_INDEX)
        index = torch.where(here, local, 0).unsqueeze(1)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        step = max(1, CHUNK_ELEMENTS // max(1, vocab))
        for start in range(0, rows, step):
            chunk = logits[start : start + step]
            if group is None:
                lse[start : start + step] = kernels.logsumexp(chunk)
                continue
            peak = kernels.row_max(chunk)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            sum_exp = kernels.sum_exp(chunk, peak)
            dist.all_reduce(sum_exp, group=group)
            lse[start : start + step] = peak + sum_exp.log()
        target_logit = logits.gather(1, index).squeeze(1).float() * here
        if group is not None:
            dist.all_reduce(target_logit, group=group)
        trained = targets != IGNORE_INDEX
        ctx.save_for_backward(logits, lse, index, here, trained)
        ctx.step, ctx.kernels, ctx.in_place = step, kernels, in_place
        losses = (lse - target_logit) * trained
        return losses if per_token else losses.sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # In place, the logits become their gradient: a head's matmul saved its input and weight,
        # not its output, so nothing else reads them after this loss. A node that did save them (an
        # op whose backward needs its output) fails autograd's version check on them loudly; a
        # second backward (retain_graph) fails the same way.
        logits, lse, index, here, trained = ctx.saved_tensors
        grad = logits if ctx.in_place else logits.clone()
        # grad_loss: a scalar (the sum), or one per row (per_token)
        weight = (trained * grad_loss).float().unsqueeze(1)
        for start in range(0, logits.shape[0], ctx.step):
            rows = slice(start, start + ctx.step)
            ctx.kernels.grad_in_place(grad[rows], lse[rows], index[rows], here[rows], weight[rows])
        return grad, None, None, None, None, None, None


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, compiled: bool = False, in_place: bool = False
) -> torch.Tensor:
    """Σ −log softmax(logits)[target] over targets that are not IGNORE_INDEX, in fp32.

    ``logits`` (batch, seq, vocab): a plain tensor, a replicated DTensor, or a DTensor sharded on
    the vocabulary (its last dim) over a 1-D mesh, e.g. a tensor-parallel head's output; ``targets``
    (batch, seq) hold global vocabulary ids. The result is a plain scalar, the same on every rank of
    the vocabulary's group. ``compiled`` runs the per-chunk math through torch.compile
    (``compile.enabled``). ``in_place``: backward writes the logits' gradient over them, so it never
    exists beside them (the size of the logits less at the peak), for a caller that holds no other
    reference to them (the trainer); logits that are a leaf, the caller's own data, are never
    overwritten.
    """
    return _sharded(logits, targets, compiled, in_place, per_token=False)


def target_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, compiled: bool = False, in_place: bool = False
) -> torch.Tensor:
    """log softmax(logits)[target] per token, (batch, seq) fp32, 0 where the target is
    IGNORE_INDEX: ``cross_entropy_sum``'s terms, negated and not summed, with the same chunks,
    vocabulary sharding and gradient (each token's scaled by its own output gradient)."""
    batch, seq = targets.shape
    return -_sharded(logits, targets, compiled, in_place, per_token=True).view(batch, seq)


def _sharded(
    logits: torch.Tensor, targets: torch.Tensor, compiled: bool, in_place: bool, per_token: bool
) -> torch.Tensor:
    in_place = in_place and logits.grad_fn is not None
    group, vocab_start = None, 0
    if isinstance(logits, DTensor) and all(p.is_replicate() for p in logits.placements):
        logits = logits.to_local()  # every rank holds the whole vocabulary
    if isinstance(logits, DTensor):
        mesh, placements = logits.device_mesh, logits.placements
        if mesh.ndim != 1 or not (
            isinstance(placements[0], Shard) and placements[0].dim in (-1, logits.ndim - 1)
        ):
            raise ValueError(
                f"logits must be sharded on the vocabulary over one mesh dim, got {placements} on "
                f"a {mesh.ndim}-D mesh"
            )
        # DTensor shards like torch.chunk: every rank but the last holds ceil(vocab / size) entries
        per_rank = math.ceil(logits.shape[-1] / mesh.size())
        vocab_start = min(mesh.get_local_rank() * per_rank, logits.shape[-1])
        group = mesh.get_group()
        logits = logits.to_local()
    kernels = compiled_kernels() if compiled else EAGER_KERNELS
    return _ShardedCrossEntropy.apply(
        logits.flatten(0, 1),
        targets.flatten(0, 1),
        vocab_start,
        group,
        kernels,
        in_place,
        per_token,
    )
