"""Ring attention: exact attention of this rank's queries over the whole sequence, the keys and
values of each cp rank passed round the ring of cp ranks, one block at a time, and merged by
log-sum-exp.

No rank ever holds more than two ranks' keys and values (the block it computes on and the one
arriving), so attention memory per rank falls as 1/cp; the next block's send/receive is posted
before the current block's compute. The work is cut at chunk granularity (the
``cp_balance.Placement``: which chunks each rank holds): a pair of chunks is either wholly before
the query chunk (attended without a mask), the same chunk (causal), or after it (skipped). With
packed documents a pair whose queries and keys share no document is skipped too, and the rest carry
their mask; under a sliding window a pair wholly before every query's window is skipped, and one the
window cuts carries its band.

The backward is exact: it passes the keys and values round the ring again, each block's gradients
computed against the merged output and log-sum-exp of the forward (flash attention's identity), and
the key/value gradients travel with their block until they are back at its owner. Each block runs
the kernel its device has (``attention_blocks``: flash for CPU; flash attention on CUDA for unmasked
half-precision blocks, tiled exact scores for the rest), so the CPU runs the same ring and merge
code the accelerator does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from composer3d.parallel.context.attention_blocks import Block, block_backward, block_forward
from composer3d.parallel.context.balance import Placement, sees, window_cuts, window_reaches


def ring_blocks(
    rank: int, placement: Placement, documents: torch.Tensor | None, window: int = 0
) -> list[list[Block]]:
    """For each source rank, the blocks of this rank's queries that attend to the source's keys, the
    chunks each holds given by ``placement`` (``documents``: (batch, seq_len) document ids in global
    order, or None for causal attention; ``window``: the keys a query sees, itself included, under
    a sliding window, 0 for all earlier ones)."""
    chunk, held = placement.chunk, placement.held
    device = None if documents is None else documents.device
    # query index − key index within a block, before the chunks' distance
    index = torch.arange(chunk, device=device)
    offset = index[:, None] - index[None, :]
    plan = []
    for source in range(len(held)):
        blocks = []
        for qi, q_chunk in enumerate(held[rank]):
            for ki, k_chunk in enumerate(held[source]):
                apart = q_chunk - k_chunk
                if apart < 0 or not window_reaches(window, chunk, apart):
                    continue  # keys after every query of the chunk, or before every one's window
                causal, mask = apart == 0, None
                windowed = window_cuts(window, chunk, apart)
                if documents is not None or windowed:
                    behind = offset + apart * chunk
                    unmasked = sees(behind, 0)  # the kernels' own rule: causal, or none
                    allowed = sees(behind, window).unsqueeze(0)
                    if documents is not None:
                        allowed = allowed & (
                            documents[:, q_chunk * chunk : (q_chunk + 1) * chunk, None]
                            == documents[:, None, k_chunk * chunk : (k_chunk + 1) * chunk]
                        )
                    if not allowed.any():
                        continue  # no query of this chunk shares a document with these keys
                    # a document starts inside the pair, or the window cuts it
                    if not torch.equal(allowed, unmasked.expand_as(allowed)):
                        causal, mask = False, allowed.unsqueeze(1)
                blocks.append(
                    Block(
                        slice(qi * chunk, (qi + 1) * chunk),
                        slice(ki * chunk, (ki + 1) * chunk),
                        causal,
                        mask,
                    )
                )
        plan.append(blocks)
    return plan


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: list[list[Block]],
    group,
    rank: int,
    size: int,
) -> torch.Tensor:
    """Attention of ``q`` (batch, heads, local tokens, head_dim) over the keys and values (batch, kv
    heads, local tokens, head_dim) of every rank of ``group``, as ``ring_blocks`` plans it;
    differentiable."""
    return _RingAttention.apply(q, k, v, _Ring(group, rank, size), blocks)


class _Ring:
    """This rank's neighbours: blocks go to the next rank and come from the previous one."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.previous = dist.get_global_rank(group, (rank - 1) % size)

    def source(self, step: int) -> int:
        """Whose block this rank holds at ``step`` (its own at step 0)."""
        return (self.rank - step) % self.size

    def pass_on(self, tensor: torch.Tensor):
        """Send ``tensor`` to the next rank and receive the previous rank's; returns (pending works,
        receive buffer)."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, self.next, self.group),
                dist.P2POp(dist.irecv, received, self.previous, self.group),
            ]
        )
        return works, received


def _wait(works) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, blocks: list[list[Block]]):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        scale = q.shape[-1] ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            last = step == ring.size - 1
            if not last:
                works, arriving = ring.pass_on(kv)
            k_heads, v_heads = query_heads(kv, q.shape[1])
            for block in blocks[ring.source(step)]:
                block_out, block_lse = block_forward(q, k_heads, v_heads, block, scale)
                merge_block(out, lse, block.queries, block_out, block_lse)
            if not last:
                _wait(works)
                kv = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.blocks, ctx.scale = ring, blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, grad_out = ctx.ring, grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        # of the block held, its owner's
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(ring.size):
            last = step == ring.size - 1
            if not last:
                works, arriving = ring.pass_on(kv)
            k_heads, v_heads = query_heads(kv, q.shape[1])
            for block in ctx.blocks[ring.source(step)]:
                dq, dk, dv = block_backward(
                    grad_out, q, k_heads, v_heads, out, lse, block, ctx.scale
                )
                grad_q[..., block.queries, :] += dq
                grad_kv[0][..., block.keys, :] += fold_heads(dk, kv.shape[2])
                grad_kv[1][..., block.keys, :] += fold_heads(dv, kv.shape[2])
            if not last:
                _wait(works)
                kv = arriving
            # on to the rank that holds this block next; after the last step, back to the block's
            # owner
            works, grad_kv = ring.pass_on(grad_kv)
            _wait(works)
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None


def merge_block(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: slice,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
):
    """Fold a block's normalized output into the running one (in place): weights by log-sum-exp."""
    merged = torch.logaddexp(lse[..., rows], block_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(lse[..., rows] - merged).unsqueeze(
        -1
    ) + block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1)
    lse[..., rows] = merged


def query_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys and values (2, batch, kv heads, tokens, d) repeated to the query heads (grouped-query
    attention)."""
    group = heads // kv.shape[2]
    return kv if group == 1 else kv.repeat_interleave(group, dim=2)


def fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients of repeated keys/values summed back onto their kv head."""
    batch, heads, tokens, dim = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(batch, kv_heads, heads // kv_heads, tokens, dim).sum(2)
