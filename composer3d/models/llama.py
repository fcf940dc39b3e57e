"""Native Llama-3 style decoder: RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU, optional tied head.

Built on the meta device; weights are filled later by ``composer3d.models.init`` from per-parameter rules
this module declares (``init_rule``), so the values do not depend on how the parameters get sharded.
Attention reads its head count from the tensor it receives, so the same code runs whole or
tensor-parallel (where each rank holds n_heads / tp heads).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from composer3d.models.init import InitRule, normal, ones


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None, explicit: int | None) -> int:
    """Llama-3's SwiGLU width: 2/3 of 4·dim, scaled, rounded up to a multiple of ``multiple_of``."""
    if explicit:
        return explicit
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of the head dim: x is (batch, seq, heads, head_dim)."""
    seq = x.shape[1]
    cos, sin = cos[:seq, None, :], sin[:seq, None, :]
    x_even, x_odd = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q = apply_rope(self.wq(x).view(bsz, seq, -1, self.head_dim), rope_cos, rope_sin)
        k = apply_rope(self.wk(x).view(bsz, seq, -1, self.head_dim), rope_cos, rope_sin)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden_dim: int, norm_eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        hidden = ffn_hidden_dim(cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A dict keyed by layer index keeps parameter names stable when a pipeline stage drops layers.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(cfg.dim, cfg.n_heads, n_kv_heads, hidden, cfg.norm_eps) for i in range(cfg.n_layers)}
        )
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device="meta")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the head with the embedding; re-run after tensor parallel replaced them (both shard the vocab dim)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self, device: torch.device) -> None:
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin

    def init_rule(self, name: str) -> InitRule:
        """How to initialize parameter ``name``; residual projections are scaled down with depth (GPT-2 style)."""
        std = self.cfg.init_std
        if name.endswith("norm.weight"):
            return ones()
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return normal(std / math.sqrt(2 * self.cfg.n_layers))
        return normal(std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def tensor_parallel_plan(model: Llama, sequence_parallel: bool) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """Megatron splits: (plan for the root modules, plan applied to every block).

    Column-parallel q/k/v and w1/w3, row-parallel wo and w2; a vocab-parallel embedding; a column-parallel head
    whose output stays sharded on the vocab dim (a DTensor) so the loss runs under ``loss_parallel`` without
    gathering full-vocabulary logits. With sequence parallel the residual stream and the norms hold a slice of
    the sequence; attention and MLP inputs are all-gathered on entry and reduce-scattered on exit.
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return root, block
