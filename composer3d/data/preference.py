"""Preference pairs (``data.format=preference``, ``train.objective=dpo``): tokenized and packed
whole into training rows.

The rows (``sources.preference_rows``) are TRL's preference formats: .jsonl or .parquet rows with
``prompt``, ``chosen`` and ``rejected`` text (standard: ``text_pair``), or lists of messages
(conversational: ``conversation_pair``, through the tokenizer's chat template). The completions'
tokens are the targets, the prompt's are not.

A pair is two documents, prompt + chosen and prompt + rejected, and both go into the same row of
train.seq_len + 1 tokens (inputs and shifted targets), several pairs to a row where they fit
(best fit, in the data's order). So every split of a batch along its rows (data-parallel slices,
micro-batches) keeps each pair whole, and the document mask (positions restarting per document)
keeps its two sides apart. The packing is a function of the data alone, done identically on every
rank before the loader's seeded order deals rows to data-parallel ranks. Per target, ``segment``
says which pair of its row and which side it belongs to; the loader's ``target_count`` counts pairs,
the global normalizer of the preference loss.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from composer3d.data.packing import Batch, rows_batch
from composer3d.errors import ConfigError

CHOSEN, REJECTED = 0, 1  # a target's side: segment = pair slot × 2 + side
NO_SEGMENT = -1
# the fewest tokens a pair takes: each of its documents a prompt token and a completion token
PAIR_MIN_TOKENS = 4


@dataclass(frozen=True)
class Pair:
    """A pair's token ids: the prompt, and each completion with its end-of-sequence token."""

    prompt: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor

    @property
    def tokens(self) -> int:
        """What the pair takes of a row: both documents, prompt + chosen and prompt + rejected."""
        return 2 * self.prompt.numel() + self.chosen.numel() + self.rejected.numel()


def max_pairs_per_row(seq_len: int) -> int:
    """The most pairs a row of seq_len + 1 tokens can hold."""
    return max(1, (seq_len + 1) // PAIR_MIN_TOKENS)


def tokenize_pairs(rows: Iterator[tuple], tokenizer, max_tokens: int) -> list[Pair]:
    """Each row's pair (``text_pair`` or ``conversation_pair``), until the pairs take
    ``max_tokens`` in rows (0: all). A prompt of no tokens is refused: its completion's first token
    would have nothing to be predicted from; so is a completion of none."""
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int64)
    pairs, total = [], 0
    for number, (prompt, chosen, rejected) in enumerate(rows):
        if max_tokens and total >= max_tokens:
            break
        if isinstance(prompt, str):
            pair = text_pair(tokenizer, eos, prompt, chosen, rejected)
        else:
            pair = conversation_pair(tokenizer, prompt, chosen, rejected)
        if pair.prompt.numel() == 0:
            raise ConfigError(
                f"data.paths: the prompt of preference row {number} is empty. Give every row a "
                "prompt (its completions are predicted from it)"
            )
        if min(pair.chosen.numel(), pair.rejected.numel()) == 0:
            raise ConfigError(
                f"data.paths: a completion of preference row {number} is no token past its "
                "prompt. Give every row a chosen and a rejected reply"
            )
        pairs.append(pair)
        total += pair.tokens
    return pairs


def text_pair(tokenizer, eos: torch.Tensor, prompt: str, chosen: str, rejected: str) -> Pair:
    """TRL's standard form: each piece tokenized on its own (no special tokens added), each
    completion ending in the end-of-sequence token, as TRL appends it to text completions."""
    return Pair(
        tokenizer.encode(prompt),
        torch.cat([tokenizer.encode(chosen), eos]),
        torch.cat([tokenizer.encode(rejected), eos]),
    )


def conversation_pair(tokenizer, prompt: list, chosen: list, rejected: list) -> Pair:
    """TRL's conversational form, as its DPOTrainer tokenizes it: the chat template of the prompt
    with the generation prompt, and of the prompt with each reply; each completion starts where
    the prompt's tokens and its conversation's part (usually right after the prompt: a template
    that renders a prompt alone otherwise, or tokens merging across the boundary, start it
    earlier), and ends as the template ends the reply (no token added)."""
    asked = tokenizer.encode(tokenizer.render_chat(prompt, add_generation_prompt=True))
    sides = [
        tokenizer.encode(tokenizer.render_chat(prompt + reply)) for reply in (chosen, rejected)
    ]
    shared = min(_common_prefix(asked, side) for side in sides)
    return Pair(asked[:shared], sides[0][shared:], sides[1][shared:])


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


@dataclass
class PreferenceSequences:
    """Pairs packed whole into rows, identical on every rank; the loader's sequences.

    ``tokens``, ``starts`` (a document's first token), ``trainable`` (a completion token): (rows,
    seq_len + 1). ``segment`` (rows, seq_len): per target (tokens[1:]), pair slot × 2 + side, or -1.
    ``pairs``: (rows,) pairs in each row. ``reference`` (preference.reference=precomputed, set
    before training): the reference's summed log-probabilities of every pair (all pairs, row by row
    and slot by slot; chosen, rejected), which each batch then carries.
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    trainable: torch.Tensor
    segment: torch.Tensor
    pairs: torch.Tensor
    reference: torch.Tensor | None = None

    @classmethod
    def pack(cls, pairs: list[Pair], seq_len: int, pad_id: int) -> PreferenceSequences:
        """Best fit in the pairs' order: each pair goes to the open row it fills most tightly (ties:
        the earliest row), else to a new row; the rest of a row is one padding document."""
        width = seq_len + 1
        if not pairs:
            raise ConfigError("data.paths: the files hold no preference pair. Give some rows")
        longest = max(range(len(pairs)), key=lambda i: pairs[i].tokens)
        if pairs[longest].tokens > width:
            raise ConfigError(
                f"train.seq_len: preference row {longest} takes {pairs[longest].tokens} tokens as "
                f"two documents (prompt + chosen, prompt + rejected), more than a row of "
                f"train.seq_len + 1 = {width}. Use train.seq_len>={pairs[longest].tokens - 1}, or "
                "shorten the longest pairs"
            )
        rows: list[list[Pair]] = []
        free: list[tuple[int, int]] = []  # (room left, row), sorted: the tightest fit first
        for pair in pairs:
            at = bisect.bisect_left(free, (pair.tokens, -1))
            if at == len(free):
                rows.append([])
                room, row = width, len(rows) - 1
            else:
                room, row = free.pop(at)
            rows[row].append(pair)
            if room - pair.tokens >= PAIR_MIN_TOKENS:  # room for another pair
                bisect.insort(free, (room - pair.tokens, row))
        return cls._rows(rows, width, pad_id)

    @classmethod
    def _rows(cls, rows: list[list[Pair]], width: int, pad_id: int) -> PreferenceSequences:
        shape = (len(rows), width)
        tokens = torch.full(shape, pad_id, dtype=torch.int64)
        starts = torch.zeros(shape, dtype=torch.bool)
        segment = torch.full(shape, NO_SEGMENT, dtype=torch.int64)
        for r, row in enumerate(rows):
            at = 0
            for slot, pair in enumerate(row):
                for side, completion in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
                    length = pair.prompt.numel() + completion.numel()
                    tokens[r, at : at + length] = torch.cat([pair.prompt, completion])
                    starts[r, at] = True
                    segment[r, at + pair.prompt.numel() : at + length] = 2 * slot + side
                    at += length
            if at < width:  # padding: a document of its own, no target
                starts[r, at] = True
        pairs = torch.tensor([len(row) for row in rows], dtype=torch.int64)
        # a token's segment becomes its target's: the target at i is token i + 1
        return cls(tokens, starts, segment >= 0, segment[:, 1:].contiguous(), pairs)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def target_count(self, rows: list[int]) -> int:
        """The pairs in ``rows``: what the preference loss is averaged over."""
        return int(self.pairs[rows].sum())

    def batch(self, rows: list[int]) -> Batch:
        """The rows as a Batch: inputs, targets (-100 but on the completions), positions restarting
        per document, each target's segment, and the reference's sums where they are known."""
        batch = rows_batch(self.tokens[rows], self.starts[rows], self.trainable[rows], True)
        batch.segment = self.segment[rows]
        if self.reference is not None:
            at, flat = self.pair_index(rows)
            reference = self.reference.new_zeros(len(rows), self.slots, 2)
            reference[at] = self.reference[flat]
            batch.reference = reference
        return batch

    @property
    def slots(self) -> int:
        """Pair slots of a row, as the loss sums them (``training.preference.pair_sums``)."""
        return max_pairs_per_row(self.tokens.shape[1] - 1)

    def pair_index(self, rows: list[int]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Where the pairs of ``rows`` are: ((batch row, slot) of each, its index among all
        pairs)."""
        counts = self.pairs[rows]
        batch_rows = torch.repeat_interleave(torch.arange(len(rows)), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        slot = torch.arange(int(counts.sum())) - first
        return (batch_rows, slot), self._first_pair[rows][batch_rows] + slot

    @functools.cached_property
    def _first_pair(self) -> torch.Tensor:
        """Each row's first pair's index among all pairs (once, not for every batch)."""
        return torch.cumsum(self.pairs, 0) - self.pairs
