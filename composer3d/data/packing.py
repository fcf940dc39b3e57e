"""Packing with document boundaries: a token stream cut into windows, and windows into
:class:`Batch` rows.

The stream is cut into windows of seq_len + 1 tokens, its per-token flags alongside. A window
becomes a :class:`Batch` row: inputs, targets (-100 where no loss is taken) and position_ids. With
``data.document_masking`` the positions restart at 0 at each document's first token and no loss is
taken on predicting a document's first token from the previous document. The model sees the restarts
in ``position_ids`` (a position other than the previous one + 1 starts a new packed document) and
attends only within each document: Hugging Face models through transformers' mask utilities, the
native Llama through its own block-causal mask (``composer3d.models.llama.document_mask``) built by
the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from composer3d.data.streams import TokenStream
from composer3d.errors import ConfigError

IGNORE_INDEX = -100  # target value that takes no loss (F.cross_entropy's default ignore_index)


def _windows(values: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    return values[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def packed_sequences(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets), as rows."""
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ConfigError(
            f"train.seq_len: the corpus has {tokens.numel()} tokens, too few for one sequence of "
            f"{seq_len}. Lower train.seq_len or give more data"
        )
    return _windows(tokens, n, seq_len)


@dataclass
class Batch:
    """Model inputs and loss targets for a batch of packed windows, all (batch, seq_len) int64.

    ``targets`` holds the next token, or IGNORE_INDEX (-100) where no loss is taken.
    ``position_ids`` restart at 0 at each document start when document masking is on (the model then
    attends within documents only, native Llama and HF models alike), else they count 0..seq_len-1
    along each row. ``global_targets``: targets that take a loss in the whole global batch (every
    data-parallel rank's rows), when the loader filled it in (preference data: pairs). ``segment``
    (preference data, ``data.preference``): per target, which side of which pair of its row it
    belongs to (pair slot × 2 + 0 chosen / 1 rejected), -1 where no loss is taken; ``reference``
    (preference.reference=precomputed): the reference's summed log-probabilities of each pair slot
    and side (batch, slots, 2), 0 where a row holds no pair.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    global_targets: int | None = None
    segment: torch.Tensor | None = None
    reference: torch.Tensor | None = None

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.inputs, self.targets, self.position_ids, self.segment, self.reference

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        inputs, targets, positions, segment, reference = (
            None if t is None else t.to(device, non_blocking=non_blocking) for t in self._tensors()
        )
        return Batch(inputs, targets, positions, self.global_targets, segment, reference)

    def pin_memory(self) -> Batch:
        inputs, targets, positions, segment, reference = (
            None if t is None else t.pin_memory() for t in self._tensors()
        )
        return Batch(inputs, targets, positions, self.global_targets, segment, reference)


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Positions that count from 0 at the row start and at every True of ``starts`` (batch,
    seq_len)."""
    index = torch.arange(starts.shape[1]).expand(starts.shape)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values
    return index - last_start


@dataclass
class PackedSequences:
    """All packed training windows, identical on every rank: ``tokens`` is (num_sequences, seq_len +
    1).

    ``starts`` / ``trainable`` are the stream's flags cut into the same windows (None: no document
    boundaries known, e.g. synthetic data / every token is a target).
    """

    tokens: torch.Tensor
    starts: torch.Tensor | None = None
    trainable: torch.Tensor | None = None
    document_masking: bool = True

    @classmethod
    def from_stream(
        cls, stream: TokenStream, seq_len: int, document_masking: bool
    ) -> PackedSequences:
        tokens = packed_sequences(stream.tokens, seq_len)
        n = tokens.shape[0]
        trainable = None if stream.trainable is None else _windows(stream.trainable, n, seq_len)
        return cls(tokens, _windows(stream.starts, n, seq_len), trainable, document_masking)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def target_count(self, rows: list[int]) -> int:
        """How many targets of :meth:`batch` (rows) take a loss, from the masks alone (no Batch
        built)."""
        return rows_target_count(
            *self._flags(rows), len(rows), self.tokens.shape[1] - 1, self.document_masking
        )

    def batch(self, rows: list[int]) -> Batch:
        """The rows as a Batch: inputs are tokens[:-1], targets tokens[1:] with IGNORE_INDEX where
        masked."""
        return rows_batch(self.tokens[rows], *self._flags(rows), self.document_masking)

    def _flags(self, rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (
            None if self.starts is None else self.starts[rows],
            None if self.trainable is None else self.trainable[rows],
        )


# The rows' windows to a Batch, shared by the in-memory corpus and the prepared one
# (data/prepared.py), so that both turn the same windows into the same batches.


def _trained(
    starts: torch.Tensor | None, trainable: torch.Tensor | None, document_masking: bool
) -> torch.Tensor | None:
    """Which targets (tokens[1:]) of the windows take a loss, (rows, seq_len) bool; None: all of
    them."""
    trained = None
    if trainable is not None:  # chat: only the assistant replies' tokens are targets
        trained = trainable[:, 1:]
    if document_masking and starts is not None:
        # the previous document's last token (its eos) predicts nothing
        not_first = ~starts[:, 1:]
        trained = not_first if trained is None else trained & not_first
    return trained


def rows_target_count(
    starts: torch.Tensor | None,
    trainable: torch.Tensor | None,
    rows: int,
    seq_len: int,
    document_masking: bool,
) -> int:
    """How many targets of ``rows`` windows with these flags (rows, seq_len + 1) take a loss."""
    trained = _trained(starts, trainable, document_masking)
    return rows * seq_len if trained is None else int(trained.sum())


def rows_batch(
    tokens: torch.Tensor,
    starts: torch.Tensor | None,
    trainable: torch.Tensor | None,
    document_masking: bool,
) -> Batch:
    """Windows (rows, seq_len + 1) and their flags as a Batch: inputs tokens[:-1], targets
    tokens[1:] with IGNORE_INDEX where masked, positions restarting per document under document
    masking."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    trained = _trained(starts, trainable, document_masking)
    if trained is not None:
        targets[~trained] = IGNORE_INDEX
    if document_masking and starts is not None:
        positions = document_positions(starts[:, :-1])
    else:
        positions = torch.arange(inputs.shape[1]).expand(inputs.shape).clone()
    return Batch(inputs, targets, positions)
