"""The native Llama's cached decoding for ``composer3d-generate``: a static KV cache per layer, and the forward that
fills it (the prompt at once, then one token a step).

Only generation runs this: it calls the model's own modules (projections, norms, feed-forwards, head) in the
block's order, so the training forward (``model.Llama.forward``) stays as it is. Each layer's keys and values are
preallocated once, (batch, kv heads, max_len, head dim), allocated on the first write with that write's heads,
dtype and device (under tensor parallel a rank holds its share of the kv heads), and written in place at the slots
of the new tokens; attention reads the slots filled so far, grouped-query as in training.

A batch of prompts of different lengths is left-padded (``attention_mask`` 0 on padding): each token's RoPE
position is its index among its row's real tokens, and it attends to its row's real tokens up to itself, so a row
gets the tokens it would get alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from composer3d.models.llama.attention import Attention, apply_rope


class LlamaDecoder:
    """``decoder(tokens, attention_mask)`` → the logits after each row's last new token, (batch, vocab).

    ``tokens`` (batch, new): the tokens after those already cached; ``attention_mask`` (batch, cached + new): 1 on
    real tokens, 0 on left padding, over every token so far. ``max_len`` bounds cached + new.
    """

    def __init__(self, model: nn.Module, max_len: int):
        self.model, self.max_len, self.length = model, max_len, 0
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        model, start, end = self.model, self.length, self.length + tokens.shape[1]
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens, {end} asked")
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, start:end]
        rope = model.rope_cos[positions], model.rope_sin[positions]
        mask = _visible(attention_mask[:, :end].bool(), start)
        h = model.tok_embeddings(tokens)
        for layer_id, block in model.layers.items():
            h = h + self._attend(layer_id, block.attention, block.attention_norm(h), rope, mask)
            h = h + (block.moe if hasattr(block, "moe") else block.feed_forward)(block.ffn_norm(h))
        self.length = end
        return model.logits(h[:, -1:])[:, -1]

    def _attend(self, layer_id: str, attention: Attention, x: torch.Tensor, rope: tuple, mask: torch.Tensor):
        bsz, seq, _ = x.shape
        head_dim = attention.head_dim
        q = apply_rope(attention.wq(x).view(bsz, seq, -1, head_dim), *rope).transpose(1, 2)
        k = apply_rope(attention.wk(x).view(bsz, seq, -1, head_dim), *rope).transpose(1, 2)
        v = attention.wv(x).view(bsz, seq, -1, head_dim).transpose(1, 2)
        keys, values = self._write(layer_id, k, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return attention.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _write(self, layer_id: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values at their slots; the slots filled so far, as views of the cache."""
        if layer_id not in self.keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[layer_id] = k.new_zeros(shape)
            self.values[layer_id] = v.new_zeros(shape)
        start, end = self.length, self.length + k.shape[2]
        self.keys[layer_id][:, :, start:end] = k
        self.values[layer_id][:, :, start:end] = v
        return self.keys[layer_id][:, :, :end], self.values[layer_id][:, :, :end]


def _visible(real: torch.Tensor, start: int) -> torch.Tensor:
    """(batch, 1, new, cached + new): new token i (slot start + i) sees slot j iff j <= its slot and j holds a real
    token. A padding token also sees itself, so no row of the softmax is empty (an empty one gives NaN, which
    would reach the real tokens through the zero weights on padding's values)."""
    slots = torch.arange(real.shape[1], device=real.device)
    query = slots[start:, None]
    return ((slots <= query) & (real[:, None, :] | (slots == query))).unsqueeze(1)
