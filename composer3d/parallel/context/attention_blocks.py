"""The attention of one block of ring attention — one chunk of queries over one chunk of keys — with
its log-sum-exp, forward and backward, by the kernel the device has.

The ring (``ring_attention``) merges blocks by their log-sum-exp and computes each block's gradients
against the merged output and log-sum-exp (flash attention's identity), so a block kernel must
return the log-sum-exp and take it back in its backward. torch's fused SDPA kernels do, through
their aten ops:

- ``cpu_flash``: the flash-attention-for-CPU kernel (any float dtype, an additive mask);
- ``cuda_flash``: flash attention (fp16/bf16, no mask, head_dim a multiple of 8 up to 256, compute
  capability 8.0 and up) — causal and unmasked blocks, the most of a causal ring;
- ``materialized``: the block's scores in fp32, exact, a tile of query rows at a time (bounded
  memory), for what no fused kernel takes (blocks a document cuts and fp32 on CUDA, other devices,
  odd head dims).

Memory-efficient attention (which takes a mask and fp32) is not among them: as a ring block on an
H200 (torch 2.11) its backward gave NaN query gradients in bf16 with a document mask, and a sequence
of 8192 ended in an illegal memory access; ``benchmarks/virtual_ring.py`` is the check to run before
a kernel joins this list.

A masked pair scores ``finfo.min / 2`` (finite): a query row that a block masks entirely gets a
log-sum-exp far below any real one, so its weight in the merge is exactly 0 instead of NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten

KERNELS = ("cpu_flash", "cuda_flash", "materialized")
SCORE_TILE_BYTES = 1 << 28  # materialized: the fp32 scores of one tile of query rows (256 MiB)
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Block:
    """One pair of (query chunk, key chunk) that attends: rows of the local queries, rows of the
    source's keys."""

    queries: slice
    keys: slice
    causal: bool  # the same chunk: causal within it
    # (batch, 1, queries, keys) bool where documents cut the pair; None: all allowed
    mask: torch.Tensor | None


def kernel_for(q: torch.Tensor, block: Block) -> str:
    """The kernel that computes ``block`` of queries ``q`` (batch, heads, tokens, head_dim) on its
    device."""
    device, dim = q.device.type, q.shape[-1]
    if device == "cpu":
        return "cpu_flash"
    if (
        device == "cuda"
        and q.dtype in _HALF
        and block.mask is None
        and dim % 8 == 0
        and dim <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    ):
        return "cuda_flash"
    return "materialized"


def block_forward(q, k, v, block: Block, scale: float, kernel: str | None = None):
    """The block's normalized output (its queries' rows) and fp32 log-sum-exp; ``k``/``v`` already
    carry the query heads (grouped-query attention repeated by the caller)."""
    q_block, k_block, v_block = (
        q[..., block.queries, :],
        k[..., block.keys, :],
        v[..., block.keys, :],
    )
    kernel = kernel or kernel_for(q, block)
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q_block,
            k_block,
            v_block,
            0.0,
            block.causal,
            attn_mask=_bias(block, q.dtype),
            scale=scale,
        )
        return out, lse
    if kernel == "cuda_flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(
            q_block, k_block, v_block, 0.0, block.causal, False, scale=scale
        )
        return out, lse
    outs, lses = [], []
    for rows in _row_tiles(q_block, k_block.shape[-2]):
        scores = _scores(q_block[..., rows, :], k_block, block, scale, rows)
        lse = scores.logsumexp(-1)
        outs.append(torch.exp(scores - lse.unsqueeze(-1)) @ v_block.float())
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def block_backward(
    grad_out, q, k, v, out, lse, block: Block, scale: float, kernel: str | None = None
):
    """The block's share of the gradients of q, k and v (the query heads), given the merged output
    and log-sum-exp of all blocks (``grad_out``, ``out``, ``lse`` over all local queries)."""
    q_block, k_block, v_block = (
        q[..., block.queries, :],
        k[..., block.keys, :],
        v[..., block.keys, :],
    )
    rows = block.queries
    grad_rows, out_rows, lse_rows = grad_out[..., rows, :], out[..., rows, :], lse[..., rows]
    kernel = kernel or kernel_for(q, block)
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_rows,
            q_block,
            k_block,
            v_block,
            out_rows,
            lse_rows,
            0.0,
            block.causal,
            attn_mask=_bias(block, q.dtype),
            scale=scale,
        )
    if kernel == "cuda_flash":
        # None for the cumulative lengths (a defined tensor selects the variable-length kernel) and
        # the RNG state (no dropout)
        return aten._scaled_dot_product_flash_attention_backward(
            grad_rows.contiguous(),
            q_block,
            k_block,
            v_block,
            out_rows.contiguous(),
            lse_rows.contiguous(),
            None,
            None,
            q_block.shape[-2],
            k_block.shape[-2],
            0.0,
            block.causal,
            None,
            None,
            scale=scale,
        )
    k_float, v_float = k_block.float(), v_block.float()
    dq, dk, dv = [], torch.zeros_like(k_float), torch.zeros_like(v_float)
    for rows in _row_tiles(q_block, k_block.shape[-2]):
        q_rows, grad, out_tile = (
            q_block[..., rows, :],
            grad_rows[..., rows, :].float(),
            out_rows[..., rows, :].float(),
        )
        probs = torch.exp(
            _scores(q_rows, k_block, block, scale, rows) - lse_rows[..., rows].unsqueeze(-1)
        )
        dv += probs.transpose(-1, -2) @ grad
        d_probs = grad @ v_float.transpose(-1, -2)
        d_scores = probs * (d_probs - (grad * out_tile).sum(-1, keepdim=True))
        dq.append(d_scores @ k_float * scale)
        dk += d_scores.transpose(-1, -2) @ q_rows.float() * scale
    return torch.cat(dq, -2), dk, dv


def masked_score(dtype: torch.dtype) -> float:
    """The score of a masked pair: finite, so an all-masked row merges with weight 0, never NaN."""
    return torch.finfo(dtype).min / 2


def _bias(block: Block, dtype: torch.dtype) -> torch.Tensor | None:
    if block.mask is None:
        return None
    return torch.zeros(block.mask.shape, dtype=dtype, device=block.mask.device).masked_fill(
        ~block.mask, masked_score(dtype)
    )


def _row_tiles(q_block: torch.Tensor, keys: int) -> list[slice]:
    """The block's query rows in tiles whose fp32 scores fit SCORE_TILE_BYTES (a 32k × 32k block of
    32 heads would be 128 GiB at once)."""
    batch, heads, rows, _ = q_block.shape
    step = max(1, SCORE_TILE_BYTES // (batch * heads * keys * 4))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _scores(q_rows, k_block, block: Block, scale: float, rows: slice) -> torch.Tensor:
    """fp32 scores of the block's query ``rows`` (``q_rows``) over all its keys, masked pairs at
    ``masked_score``."""
    scores = (q_rows.float() @ k_block.float().transpose(-1, -2)) * scale
    if block.causal:
        query = torch.arange(rows.start, rows.start + scores.shape[-2], device=scores.device)
        later = torch.arange(scores.shape[-1], device=scores.device)[None, :] > query[:, None]
        scores = scores.masked_fill(later, masked_score(torch.float32))
    if block.mask is not None:
        scores = scores.masked_fill(~block.mask[..., rows, :], masked_score(torch.float32))
    return scores
