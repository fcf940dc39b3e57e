"""The generation loop: a batch of prompts, left-padded, prefilled at once and then decoded a token
a step.

The model's ``decoder(max_len, cache)`` is its cached forward (a KV cache filled by the prompt, then
one token a step); ``Recompute`` runs the whole sequence through the model's forward every step
instead (``generate.cache= none``): exact for any attention, and the reference the cached paths are
tested against. Both take the new tokens and the padding mask of every token so far, and give the
logits after each row's last token.

Under tensor parallel every rank runs the loop; rank 0's tokens go to all (the ranks gathered the
same logits, but one that drew differently would feed the group different sequences from then on).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composer3d.generation.sampling import next_tokens


@dataclass
class Generation:
    prompt_ids: list[int]
    completion_ids: list[
        int
    ]  # every generated token (up to and with the eos, or the one that made a stop string)
    completion: str  # the completion's text, cut before the first stop string it holds
    finish_reason: str  # "eos" | "stop" | "length"
    seconds: float  # the whole batch's generation


class Recompute:
    """The uncached path: every step, the whole sequence so far through the model's forward."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.ids = model, None

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.ids = tokens if self.ids is None else torch.cat([self.ids, tokens], dim=1)
        # Left padding: positions that restart make each padding token a document of its own and
        # each row's text one from position 0, which attention keeps apart; without padding, the
        # plain causal forward.
        positions = (
            None if bool(attention_mask.all()) else (attention_mask.cumsum(-1) - 1).clamp(min=0)
        )
        return self.model(self.ids, position_ids=positions)[:, -1]


def stop_index(text: str, stops: list[str]) -> int | None:
    """Where the first of ``stops`` starts in ``text`` (None: none there)."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    settings,
    eos_id: int | None,
    decode: Callable[[list[int]], str],
    device: torch.device,
) -> list[Generation]:
    """Continue each of ``prompts`` (token ids) on every rank of the tensor-parallel group;
    ``settings``: the ``generate`` config; ``decode``: the tokenizer's ids → text (stop strings are
    found in the decoded text)."""
    width, batch = max(map(len, prompts)), len(prompts)
    # padding's id is never read
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    decoder = (
        Recompute(model)
        if settings.cache == "none"
        else model.decoder(width + settings.max_new_tokens, settings.cache, settings.compile)
    )
    generator = torch.Generator().manual_seed(settings.seed)
    completions: list[list[int]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * batch
    started, new = time.perf_counter(), ids
    for _ in range(settings.max_new_tokens):
        logits = decoder(new, mask)
        # tensor parallel: the head's output is sharded over the vocabulary
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        tokens = next_tokens(
            logits.float(), settings.temperature, settings.top_k, settings.top_p, generator
        ).to(device)
        if dist.is_initialized():
            dist.broadcast(tokens, src=0)
        for row, token in enumerate(tokens.tolist()):
            if finish[row] is not None:
                continue
            completions[row].append(token)
            if settings.stop_at_eos and token == eos_id:
                finish[row] = "eos"
            elif settings.stop and stop_index(decode(completions[row]), settings.stop) is not None:
                finish[row] = "stop"
        if all(finish):
            break
        new, mask = tokens[:, None], torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
    seconds = time.perf_counter() - started
    results = []
    for prompt, completion, reason in zip(prompts, completions, finish):
        text = decode(completion)
        if reason == "stop":
            text = text[: stop_index(text, settings.stop)]
        results.append(Generation(list(prompt), completion, text, reason or "length", seconds))
    return results
