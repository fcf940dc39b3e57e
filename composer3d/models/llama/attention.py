"""The native Llama's attention: RoPE, grouped-query attention through SDPA, and the masks of packed
documents.

Attention reads its head count from the tensor it receives, so the same code runs whole or
tensor-parallel (where each rank holds n_heads / tp heads). Packed documents (``position_ids`` that
restart, as ``data.document_masking`` makes them) attend only within themselves, as in Hugging Face
models: RoPE at the given positions and block-causal attention (``document_mask``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._triton import has_triton


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
):
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of the head dim: x is (batch, seq, heads,
    head_dim).

    ``cos``/``sin``: the whole tables (positions 0..seq-1 are used) or, gathered at each row's
    position_ids, (batch, seq, head_dim / 2)."""
    if cos.dim() == 2:
        cos, sin = cos[: x.shape[1]], sin[: x.shape[1]]
    # Inductor fuses the products into one kernel (complex ops it leaves unfused)
    if torch.compiler.is_compiling():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
        return (
            torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
            .flatten(-2)
            .type_as(x)
        )
    # Eager: each pair a complex number turned by e^{iθ}, in fp32, the same numbers as the products
    # written out in a third of the kernels (each a pass over q or k, which selective AC runs again
    # in backward)
    # tables cast with a bf16 model too
    turn = torch.complex(cos.float(), sin.float()).unsqueeze(-2)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).type_as(x)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document index in its row, (batch, seq): a document starts wherever the position
    does not go on +1 from the previous token's, transformers' rule for packed sequences
    (``find_packed_sequence_indices``)."""
    return F.pad((position_ids[:, 1:] != position_ids[:, :-1] + 1).cumsum(-1), (1, 0))


# inductor's flex-attention kernels refuse smaller heads ("NYI: embedding dimension ...")
FLEX_MIN_HEAD_DIM = 16


@functools.cache
def _flex_fits(device_type: str, head_dim: int) -> bool:
    """Whether attention on this device type takes flex attention: where inductor compiles it to
    Triton kernels (the accelerator, when Triton supports it, for heads of at least 16 dims).
    Elsewhere its kernels are slow or missing (torch 2.13's flex attention has no backward on the
    CPU), and the exact SDPA mask is used."""
    accelerator = torch.accelerator.current_accelerator()
    return (
        accelerator is not None
        and device_type == accelerator.type
        and has_triton()
        and head_dim >= FLEX_MIN_HEAD_DIM
    )


# flex_attention and create_block_mask compiled, made on first use (torch.compile costs seconds to
# import): eager, the one materializes every score and the other a (batch, seq, seq) mask.
_compiled_flex: tuple | None = None


def document_mask(documents: torch.Tensor, head_dim: int) -> BlockMask | torch.Tensor:
    """Block-causal attention over ``document_ids``: token i attends to token j iff j <= i in the
    same document.

    A flex-attention BlockMask where flex fits the device and the heads (``_flex_fits``), else a
    boolean mask for SDPA, (batch, 1, seq, seq): exact, with memory quadratic in the sequence.
    """
    global _compiled_flex
    batch, seq = documents.shape
    if _flex_fits(documents.device.type, head_dim):
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention), torch.compile(create_block_mask)

        def same_document_causal(b, h, q, kv):
            return (kv <= q) & (documents[b, q] == documents[b, kv])

        return _compiled_flex[1](
            same_document_causal, batch, None, seq, seq, device=documents.device
        )
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)


def head_max_logits(
    q: torch.Tensor, k: torch.Tensor, mask: BlockMask | torch.Tensor | None
) -> torch.Tensor:
    """Each of ``q``'s heads' largest logit q·k/√d over the batch, where the mask lets a query
    attend (causal where None; ``document_mask``'s boolean mask or BlockMask), in fp32: what
    MuonClip compares with its threshold. Computed apart from the attention kernels (which do not
    report it), a chunk of queries at a time."""
    with torch.no_grad():
        batch, heads, seq, head_dim = q.shape
        if k.shape[1] != heads:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
        keys = k.float().transpose(-2, -1)
        best = torch.full((heads,), float("-inf"), device=q.device)
        kv = torch.arange(seq, device=q.device)
        rows = max(1, 2**24 // (batch * heads * seq))
        for start in range(0, seq, rows):
            end = min(seq, start + rows)
            scores = (q[:, :, start:end].float() @ keys) * head_dim**-0.5
            queries = kv[start:end]
            if mask is None:
                allowed = kv[None, None, None, :] <= queries[None, None, :, None]
            elif isinstance(mask, BlockMask):
                b = torch.arange(batch, device=q.device)[:, None, None, None]
                allowed = mask.mask_mod(b, 0, queries[None, None, :, None], kv[None, None, None, :])
            else:
                allowed = mask[:, :, start:end]
            scores = scores.masked_fill(~allowed, float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
        return best


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        # Under context parallel (``parallel.context``): attention over the keys and values of the
        # whole sequence.
        self.context_parallel = None
        # optim.muon_clip_threshold: this rank's heads' largest logit since the last step (set to
        # a tensor by the optimizer's QK-Clip, which reads and resets it), else None
        self.max_logits: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        mask: BlockMask | torch.Tensor | None,
    ) -> torch.Tensor:
        """``mask``: None for causal attention, else ``document_mask``'s; under context parallel,
        its ``attention_plan``."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads (the mask has
        # no head dim).
        q = apply_rope(self.wq(x).view(bsz, seq, -1, self.head_dim), rope_cos, rope_sin).transpose(
            1, 2
        )
        k = apply_rope(self.wk(x).view(bsz, seq, -1, self.head_dim), rope_cos, rope_sin).transpose(
            1, 2
        )
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        if self.max_logits is not None:
            self.max_logits.copy_(torch.maximum(self.max_logits, head_max_logits(q, k, mask)))
        if self.context_parallel is not None:
            out = self.context_parallel.attend(q, k, v, mask)
            return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, BlockMask):
            out = _compiled_flex[0](q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
            )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
