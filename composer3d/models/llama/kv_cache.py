"""The native Llama's cached decoding for ``composer3d-generate``: a static KV cache per layer, and
the forward that fills it (the prompt at once, then one token a step).

Only generation runs this: it calls the model's own modules (projections, norms, feed-forwards,
head) in the block's order, so the training forward (``model.Llama.forward``) stays as it is. Each
layer's keys and values are preallocated once, (batch, kv heads, max_len, head dim), allocated on
the first write with that write's heads, dtype and device (under tensor parallel a rank holds its
share of the kv heads), and written in place at the slots of the new tokens; attention reads them
grouped-query, as in training.

A batch of prompts of different lengths is left-padded (``attention_mask`` 0 on padding): each
token's RoPE position is its index among its row's real tokens, and it attends to its row's real
tokens up to itself, so a row gets the tokens it would get alone.

Attention always reads the whole cache (slots not yet written are masked), so every decode step has
the same shapes: an accelerator's attention kernels are planned once (cuDNN built a new plan for
each new length, ~40 ms a token on an H200), and ``compiled`` decode steps are one graph, replayed
as CUDA graphs where the device has them (``torch.compile(mode="reduce-overhead")``: a step of a
small model is otherwise hundreds of kernel launches). A graph replays on the tensors it was
captured with, so a compiled decoder keeps its cache for the model's next generation of the same
shape (batch, heads, max_len, dtype), which then reuses the graph instead of compiling again.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from composer3d.models.llama.attention import apply_rope


class LlamaDecoder:
    """``decoder(tokens, attention_mask)`` → the logits after each row's last new token, (batch,
    vocab).

    ``tokens`` (batch, new): the tokens after those already cached; ``attention_mask`` (batch,
    cached + new): 1 on real tokens, 0 on left padding, over every token so far. ``max_len`` bounds
    cached + new. ``compiled``: the one-token steps after the prompt run compiled (the prompt's own
    step, one of a kind, stays eager).
    """

    def __init__(self, model: nn.Module, max_len: int, compiled: bool = False):
        self.model, self.max_len, self.length, self.compiled = model, max_len, 0, compiled
        # A compiled decoder takes over the cache (and so the graphs) of the model's last compiled
        # one
        self.keys, self.values = _kept.setdefault(model, ({}, {})) if compiled else ({}, {})

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        start, end = self.length, self.length + tokens.shape[1]
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens, {end} asked")
        # A fresh tensor: a slice keeps the row stride of the growing mask, which a compiled step
        # guards on (so a batch of one, whose slice already counts as contiguous, recompiled at
        # every token)
        positions = (
            (attention_mask.cumsum(-1) - 1)
            .clamp(min=0)[:, start:end]
            .clone(memory_format=torch.contiguous_format)
        )
        real = attention_mask.new_zeros(attention_mask.shape[0], self.max_len, dtype=torch.bool)
        real[:, :end] = attention_mask.bool()
        slots = torch.arange(start, end, device=tokens.device)
        step = decode_step
        if self.compiled and start > 0 and tokens.shape[1] == 1:
            # the last step's outputs are read: its buffers may go
            torch.compiler.cudagraph_mark_step_begin()
            step = _compiled_decode_step()
        logits = step(
            self.model, self.keys, self.values, tokens, positions, real, slots, self.compiled
        )
        self.length = end
        return logits


def decode_step(
    model: nn.Module,
    keys: dict,
    values: dict,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    real: torch.Tensor,
    slots: torch.Tensor,
    static: bool,
) -> torch.Tensor:
    """``tokens`` through the model, their keys and values written at ``slots`` of the per-layer
    caches ``keys`` and ``values``; the logits after each row's last token."""
    rope = model.rope_cos[positions], model.rope_sin[positions]
    mask = _visible(real, slots)
    h = model.tok_embeddings(tokens)
    for layer_id, block in model.layers.items():
        attention, x = block.attention, block.attention_norm(h)
        bsz, seq, _ = x.shape
        head_dim = attention.head_dim
        q = apply_rope(attention.wq(x).view(bsz, seq, -1, head_dim), *rope).transpose(1, 2)
        k = apply_rope(attention.wk(x).view(bsz, seq, -1, head_dim), *rope).transpose(1, 2)
        v = attention.wv(x).view(bsz, seq, -1, head_dim).transpose(1, 2)
        cached_k, cached_v = _write(keys, values, layer_id, k, v, slots, real.shape[1], static)
        out = F.scaled_dot_product_attention(
            q, cached_k, cached_v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
        )
        h = h + attention.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        h = h + (block.moe if hasattr(block, "moe") else block.feed_forward)(block.ffn_norm(h))
    return model.logits(h[:, -1:])[:, -1]


def _write(
    keys: dict,
    values: dict,
    layer_id: str,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    max_len: int,
    static: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the new keys and values at their slots; the whole cache back (unwritten slots are
    masked)."""
    shape = (k.shape[0], k.shape[1], max_len, k.shape[3])
    cache = keys.get(layer_id)
    if cache is None or cache.shape != shape or cache.dtype != k.dtype or cache.device != k.device:
        # the prompt's step, eager: the compiled steps find the cache made
        keys[layer_id], values[layer_id] = k.new_zeros(shape), v.new_zeros(shape)
        if static:  # a fixed address: CUDA graphs write it in place, replay after replay
            torch._dynamo.mark_static_address(keys[layer_id])
            torch._dynamo.mark_static_address(values[layer_id])
    keys[layer_id].index_copy_(2, slots, k)
    values[layer_id].index_copy_(2, slots, v)
    return keys[layer_id], values[layer_id]


# Each model's compiled cache, kept for its next compiled decoder (weakly: it goes with the model)
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _compiled_decode_step():
    """``decode_step`` compiled once per process (its graphs are guarded by the tensors and shapes
    they take)."""
    return torch.compile(decode_step, mode="reduce-overhead", dynamic=False)


def _visible(real: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(batch, 1, new, max_len): new token i (at ``slots[i]``) sees slot j iff j <= its slot and j
    holds a real token (``real``: (batch, max_len), False past the tokens so far). A padding token
    also sees itself, so no row of the softmax is empty (an empty one gives NaN, which would reach
    the real tokens through the zero weights on padding's values)."""
    keys = torch.arange(real.shape[1], device=real.device)
    query = slots[:, None]
    return ((keys <= query) & (real[:, None, :] | (keys == query))).unsqueeze(1)
