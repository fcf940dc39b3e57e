"""Which tokens of every sequence each context-parallel rank holds (``parallel.cp_balance``), so
that the ranks' attention work is even.

- ``head_tail``: the sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp−1−r
  (Megatron's and torchtitan's balance): under one causal mask the early chunks attend to few keys
  and the late ones to many, so each rank gets one of each and the same work. Packed documents break
  this: a block-diagonal causal mask leaves most of a late chunk's keys out, and the busiest rank's
  work reaches 1.5–2.5× the mean.
- ``documents``: each batch's own document mask is balanced. The sequence is cut into 2·cp·m chunks
  (m up to ``FINEST_ROUNDS``, the most that divides it); each query chunk's work is the scores the
  ring's kernels compute for it — the key chunks at or before it that share a document with it in
  some row (the blocks the ring does not skip), a whole chunk² each, the diagonal's half when no
  document starts inside it — and the chunks are dealt greedily, the heaviest first, to the least
  loaded rank that still has room (2·m chunks a rank: equal tokens, static shapes). Head-tail is
  kept where it is no worse (always for plain causal attention).

Sliding windows (each layer's, ``windows``) weigh in both: a key chunk wholly outside every query's
window of a chunk is a block the ring skips, and a diagonal block the window cuts is masked (a whole
chunk²); the work is summed over the model's layers, so a model mixing full and windowed layers is
balanced for the mix.

A placement is a pure function of the batch's document ids, which every cp rank has, so all of them
compute the same one; everything that depends on which global positions a rank holds (the
input/target/position shards, the gather back, the ring's blocks and masks, the other styles' masks)
reads it from the one ``ContextParallel``. Nothing of it is saved: a checkpoint holds no placement
and resumes under any balance.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BALANCES = ("head_tail", "documents")
# documents: a sequence cut into up to 2·cp·4 chunks (more chunks, more and smaller ring blocks)
FINEST_ROUNDS = 4


@dataclass(frozen=True)
class Placement:
    """The chunks each cp rank holds: ``held[r]`` the global chunk ids of rank r, in the order it
    holds them."""

    chunk: int  # tokens a chunk
    held: tuple[tuple[int, ...], ...]

    @property
    def seq_len(self) -> int:
        return self.chunk * sum(len(chunks) for chunks in self.held)

    def token_index(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """Global indices (0..seq_len-1) of the tokens rank ``rank`` holds, in the order it holds
        them."""
        return torch.cat(
            [
                torch.arange(c * self.chunk, (c + 1) * self.chunk, device=device)
                for c in self.held[rank]
            ]
        )

    def grouped(self, size: int) -> "Placement":
        """The placement of groups of ``size`` consecutive ranks, each holding its members' chunks
        in rank order (what an all-to-all over the group gathers: hierarchical cp's ring)."""
        return Placement(
            self.chunk,
            tuple(
                tuple(c for rank in range(start, start + size) for c in self.held[rank])
                for start in range(0, len(self.held), size)
            ),
        )

    def gathered_index(self, device: torch.device | None = None) -> torch.Tensor:
        """Global indices of every rank's tokens, in rank order (what an all-gather over the cp
        group returns)."""
        return torch.cat([self.token_index(rank, device) for rank in range(len(self.held))])


def head_tail(size: int, seq_len: int) -> Placement:
    """Rank r of ``size`` holds chunks r and 2·size−1−r of 2·size."""
    return Placement(seq_len // (2 * size), tuple((r, 2 * size - 1 - r) for r in range(size)))


def plan_placement(
    size: int,
    seq_len: int,
    balance: str,
    documents: torch.Tensor | None,
    windows: Sequence[int] = (),
) -> Placement:
    """The placement under ``balance`` of a batch whose rows have ``documents`` (batch, seq_len)
    document ids, rising along each row (``document_ids``; None: one causal sequence a row), for a
    model whose layers have sliding ``windows`` (0 or none: causal over the whole prefix)."""
    coarse = head_tail(size, seq_len)
    if balance == "head_tail" or documents is None:
        return coarse
    rounds = max(m for m in range(1, FINEST_ROUNDS + 1) if seq_len % (2 * size * m) == 0)
    chunks, per_rank = 2 * size * rounds, 2 * rounds
    work = chunk_work(documents, seq_len // chunks, windows).tolist()
    loads, held = [0] * size, [[] for _ in range(size)]
    for chunk in sorted(range(chunks), key=lambda c: (-work[c], c)):
        rank = min((r for r in range(size) if len(held[r]) < per_rank), key=lambda r: (loads[r], r))
        held[rank].append(chunk)
        loads[rank] += work[chunk]
    balanced = Placement(seq_len // chunks, tuple(tuple(sorted(chunks_of)) for chunks_of in held))
    better = busiest(balanced, documents, windows) < busiest(coarse, documents, windows)
    return balanced if better else coarse


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document in its row, rising along it (the count of document starts before it): a
    document starts where the position does not go on +1 (transformers' rule for packed sequences,
    the models' too)."""
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return torch.nn.functional.pad(starts.cumsum(-1), (1, 0))


def sees(behind: torch.Tensor, window: int) -> torch.Tensor:
    """Whether a query sees a key ``behind`` tokens before it (negative: after it): causally and,
    under a sliding ``window`` (keys a query sees, itself included; 0: every earlier key), within
    it — transformers' ``sliding_window_overlay``."""
    return (behind >= 0) & (behind < window) if window else behind >= 0


def window_reaches(window: int, chunk: int, apart: int) -> bool:
    """Whether some query of a chunk sees some key of the chunk ``apart`` chunks before it under a
    sliding ``window`` (keys a query sees, itself included; 0: every earlier key): the nearest pair
    is (apart − 1)·chunk + 1 tokens apart (``apart`` an int, or a tensor of them)."""
    return (apart - 1) * chunk + 1 < window if window else True


def window_cuts(window: int, chunk: int, apart: int) -> bool:
    """Whether the window leaves out some pair of a block ``apart`` chunks apart that causality
    keeps (the farthest pair is (apart + 1)·chunk − 1 tokens apart)."""
    return bool(window) and (apart + 1) * chunk - 1 >= window


def chunk_work(documents: torch.Tensor, chunk: int, windows: Sequence[int] = ()) -> torch.Tensor:
    """The scores the ring computes for each query chunk of ``chunk`` tokens (over every row of
    ``documents``, (batch, seq_len) rising ids), summed over the layers' ``windows`` (none: one
    causal layer): a chunk² for each earlier key chunk some row's query chunk shares a document with
    and the layer's window reaches (its blocks run for the whole batch), plus its own diagonal
    block — causal, chunk·(chunk+1)/2, unless a document starts inside it or the window cuts it
    (then masked, chunk²)."""
    batch, seq_len = documents.shape
    blocks = documents.view(batch, seq_len // chunk, chunk)
    first, last = blocks[..., 0], blocks[..., -1]  # (batch, chunks)
    # query chunk i and an earlier key chunk j share a document iff i's first document is j's last
    # (ids rise)
    shared = (first[:, :, None] == last[:, None, :]).any(0).tril(-1)
    cut = (first != last).any(0)
    chunks = seq_len // chunk
    apart = torch.arange(chunks)[:, None] - torch.arange(chunks)[None, :]  # query − key chunk
    work = torch.zeros(chunks, dtype=torch.long)
    for window, layers in Counter(windows or [0]).items():
        reached = shared & window_reaches(window, chunk, apart)
        masked = cut | window_cuts(window, chunk, 0)
        diagonal = torch.where(masked, chunk * chunk, chunk * (chunk + 1) // 2)
        work += layers * (reached.sum(1) * chunk * chunk + diagonal)
    return work


def rank_work(
    placement: Placement, documents: torch.Tensor | None, windows: Sequence[int] = ()
) -> list[int]:
    """Each rank's attention work under ``placement`` (``chunk_work``; one causal sequence a row
    without documents)."""
    if documents is None:
        documents = torch.zeros(1, placement.seq_len, dtype=torch.long)
    work = chunk_work(documents, placement.chunk, windows).tolist()
    return [sum(work[c] for c in chunks) for chunks in placement.held]


def busiest(
    placement: Placement, documents: torch.Tensor | None, windows: Sequence[int] = ()
) -> int:
    return max(rank_work(placement, documents, windows))
