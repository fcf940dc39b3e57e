"""The next token of each row from its logits: greedy, or a seeded draw at a temperature, cut to the
top-k and the top-p nucleus."""

from __future__ import annotations

import torch


def next_tokens(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """(batch, vocab) logits → (batch,) token ids on the CPU. The most likely at temperature 0; else
    drawn from softmax(logits / temperature) over the ``top_k`` most likely (0: all), cut to the
    smallest set of most likely tokens whose probabilities reach ``top_p``. Draws run on the CPU in
    float64 with ``generator`` (a CPU generator), so a seed gives the same tokens on every device
    and layout."""
    if temperature == 0:
        return logits.argmax(-1).cpu()
    scaled = logits.double().cpu() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep each token whose more likely predecessors add up to less than top_p (the most likely
    # always stays).
    sorted_probs[sorted_probs.cumsum(-1) - sorted_probs >= top_p] = 0
    return order.gather(-1, torch.multinomial(sorted_probs, 1, generator=generator)).squeeze(-1)
