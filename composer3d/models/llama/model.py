"""Native Llama-3 style decoder: RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU,
optional tied head.

Built on the meta device; weights are filled later by ``composer3d.models.init`` from per-parameter
rules this module declares (``init_rule``), so the values do not depend on how the parameters get
sharded. A layer is a dense SwiGLU block or, under a ``moe`` config, a mixture of experts
(``composer3d.models.moe``). Attention and the masks of packed documents: ``llama.attention``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import composer3d.models.llama.attention as attention_module
from composer3d.config.schema import ModelConfig
from composer3d.models.init import InitRule, normal, ones
from composer3d.models.interface import Routing
from composer3d.models.llama.attention import Attention, document_ids, document_mask, rope_tables
from composer3d.models.llama.kv_cache import LlamaDecoder
from composer3d.models.moe import MoE, inactive_expert_params, moe_layers


def ffn_hidden_dim(
    dim: int, multiple_of: int, ffn_dim_multiplier: float | None, explicit: int | None
) -> int:
    """Llama-3's SwiGLU width: 2/3 of 4·dim, scaled, rounded up to a multiple of ``multiple_of``."""
    if explicit:
        return explicit
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Attention, then a dense SwiGLU (``feed_forward``) or, given ``moe_cfg``, a mixture of experts
    (``moe``)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        hidden_dim: int,
        norm_eps: float,
        moe_cfg=None,
        expert_hidden_dim: int | None = None,
    ):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        if moe_cfg is None:
            self.feed_forward = FeedForward(dim, hidden_dim)
        else:
            self.moe = MoE(dim, expert_hidden_dim or hidden_dim, moe_cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        mask: BlockMask | torch.Tensor | None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, mask)
        return h + (self.moe if hasattr(self, "moe") else self.feed_forward)(self.ffn_norm(h))


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` of model config ``cfg`` is a mixture of experts (after
    moe.dense_layers dense ones)."""
    moe = getattr(cfg, "moe", None)
    return moe is not None and moe.experts > 0 and layer >= moe.dense_layers


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        hidden = ffn_hidden_dim(
            cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim
        )
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A dict keyed by layer index keeps parameter names stable when a pipeline stage drops
        # layers.
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    cfg.dim,
                    cfg.n_heads,
                    n_kv_heads,
                    hidden,
                    cfg.norm_eps,
                    *((cfg.moe, cfg.moe.expert_hidden_dim) if is_moe_layer(cfg, i) else ()),
                )
                for i in range(cfg.n_layers)
            }
        )
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(
            cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device="meta"
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # this rank's share of each sequence under context parallel (parallel.context)
        self.context_parallel = None
        # the residual stream is split over this many ranks (set by sequence parallel)
        self.sequence_shards = 1

    def tie_weights(self) -> None:
        """Share the head with the embedding; re-run after tensor parallel replaced them (both shard
        the vocab dim)."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self, device: torch.device) -> None:
        cos, sin = rope_tables(
            self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta, device
        )
        self.rope_cos, self.rope_sin = cos, sin
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()

    def init_rule(self, name: str) -> InitRule:
        """How to initialize parameter ``name``; residual projections are scaled down with depth
        (GPT-2 style)."""
        std = self.cfg.init_std
        if name.endswith("norm.weight"):
            return ones()
        if name.endswith(
            (
                "attention.wo.weight",
                "feed_forward.w2.weight",
                "moe.experts.w2",
                "moe.shared_w2.weight",
            )
        ):
            return normal(std / math.sqrt(2 * self.cfg.n_layers))
        return normal(std)

    def attention_logits(self) -> list[nn.Module]:
        return [block.attention for block in self.layers.values()]

    # Mixture of experts (``models.interface.ComposerModel``): composer3d's MoE layers, split by
    # expert and width.
    def routed_experts(self) -> list[nn.Module]:
        return [moe.experts for moe in moe_layers(self)]

    def use_expert_parallel(self, ep_group) -> None:
        for moe in moe_layers(self):
            moe.ep_group = ep_group

    def inactive_params(self) -> int:
        return inactive_expert_params(self)

    def track_routing(self, device: torch.device) -> Routing | None:
        """The MoE layers count their routing themselves; they also carry the auxiliary loss and the
        balancing bias, which are set by all the model's MoE layers (also those another pipeline
        stage holds)."""
        moe = getattr(self.cfg, "moe", None)
        if moe is None or moe.experts == 0:
            return None
        return Routing(
            moe.experts,
            balancing=(moe, sum(is_moe_layer(self.cfg, i) for i in range(self.cfg.n_layers))),
        )

    def use_context_parallel(self, context) -> None:
        """Attend over the whole sequence while holding ``context``'s share of it
        (``parallel.context``)."""
        self.context_parallel = context
        for block in self.layers.values():
            block.attention.context_parallel = context
        # its sequence-wise auxiliary loss counts the choices of the whole sequence
        for moe in moe_layers(self):
            moe.cp_group = context.group

    def feed_forwards(self) -> list[nn.Module]:
        return [
            block.feed_forward for block in self.layers.values() if hasattr(block, "feed_forward")
        ]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))

    def decoder(self, max_len: int, cache: str, compiled: bool = False) -> LlamaDecoder:
        """Generation's cached forward over at most ``max_len`` tokens a row: a static KV cache (the
        only ``cache`` kind the native model has; the config checks refuse others); ``compiled``:
        generate.compile."""
        return LlamaDecoder(self, max_len, compiled)

    def linear_head(self) -> tuple[nn.Module, torch.Tensor]:
        return self.norm, self.output.weight

    def forward(
        self,
        x: torch.Tensor,
        layer_ids: list[str] | None = None,
        embed: bool = True,
        head: bool = True,
        position_ids: torch.Tensor | None = None,
        head_loss=None,
    ) -> torch.Tensor:
        """Tokens → logits; a pipeline stage runs a slice: its ``layer_ids``, with or without
        embedding and head. ``head_loss(h, self.logits)``, where given, takes the head's place
        (``models.interface``).

        ``position_ids`` (batch, seq) that restart mark packed documents: each attends only within
        itself, with RoPE at its positions. Without a restart (or without position_ids) attention is
        causal over the whole row.
        """
        h = self.tok_embeddings(x) if embed else x
        rope, mask = (self.rope_cos, self.rope_sin), None
        if self.context_parallel is not None:
            # a later pipeline stage gets the residual stream, of which sequence parallel left it
            # 1/tp
            tokens = x.shape[1] if embed else x.shape[1] * self.sequence_shards
            rope, mask = self._context_parallel_rope_and_mask(
                x.shape[0], tokens, h.device, position_ids
            )
        elif position_ids is not None:
            documents = document_ids(position_ids)
            # Flex attention takes the mask whatever it holds: no read of the device (a host sync
            # would stall the step). The exact fallback runs where the device is the host or
            # synchronous anyway; a batch without a restart keeps the causal kernel and the tables
            # from 0 there (RoPE sees only relative positions). _flex_fits is read through its
            # module, as document_mask reads it: patched there (tests), it decides both.
            head_dim = 2 * self.rope_cos.shape[-1]
            if (
                attention_module._flex_fits(documents.device.type, head_dim)
                or documents[:, -1].any()
            ):
                rope = self.rope_cos[position_ids], self.rope_sin[position_ids]
                mask = document_mask(documents, head_dim)
        for layer_id in self.layers.keys() if layer_ids is None else layer_ids:
            h = self.layers[layer_id](h, *rope, mask)
        if not head:
            return h
        return self.logits(h) if head_loss is None else head_loss(h, self.logits)

    def _context_parallel_rope_and_mask(
        self, batch: int, tokens: int, device: torch.device, position_ids: torch.Tensor | None
    ):
        """This rank's ``tokens`` under context parallel: RoPE at their global positions, and the
        plan of their attention over the whole sequence (causal by global index; within documents,
        from the whole sequence's positions), made once for every layer. Under sequence parallel the
        residual stream holds 1/tp of them, but attention (where RoPE and the plan are used) sees
        them all. The tables have a row per sequence with documents or without, so that compiled
        blocks see the same shapes in training and evaluation."""
        context = self.context_parallel
        seq_len = tokens * context.size
        documents = None
        if position_ids is None:
            position_ids = context.token_index(seq_len, device).expand(batch, -1)
        else:
            documents = document_ids(context.whole(position_ids))
        rope = self.rope_cos[position_ids], self.rope_sin[position_ids]
        return rope, context.attention_plan(seq_len, documents, device)
