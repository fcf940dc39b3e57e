"""The model's parameters as the planner needs them: each one's shape on a tensor-parallel rank, grouped by block,
and the pipeline split composer3d itself makes (``parallel.pipeline.split_layers``, the same cost function).

Llama-shaped decoders (the native model and Hugging Face models laid out like Llama): q/k/v and gate/up projections
split by output rows over tp (column-parallel), o and down projections by input columns (row-parallel), a
vocab-parallel embedding and head, norms replicated. Biases are left out (a few thousandths of the parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property

from composer3d.models.llama import ffn_hidden_dim
from composer3d.parallel.pipeline import split_layers, stage_ids_of_rank


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, m) -> "ModelShape":
        heads = m.n_heads
        return cls(dim=m.dim, n_layers=m.n_layers, n_heads=heads, n_kv_heads=m.n_kv_heads or heads,
                   head_dim=m.head_dim or m.dim // heads,
                   ffn=ffn_hidden_dim(m.dim, m.multiple_of, m.ffn_dim_multiplier, m.ffn_hidden_dim),
                   vocab=m.vocab_size, tied=bool(m.tie_embeddings))

    @cache  # noqa: B019 (a few shapes per run; frozen, hashable)
    def block_params(self, tp: int) -> list[tuple[int, ...]]:
        """Shapes of one block's parameters on one tensor-parallel rank."""
        h, q, kv, f = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.ffn
        return [(q // tp, h), (kv // tp, h), (kv // tp, h), (h, q // tp),  # wq wk wv (column), wo (row)
                (f // tp, h), (f // tp, h), (h, f // tp), (h,), (h,)]  # w1 w3 (column), w2 (row), two norms

    def embedding_params(self, tp: int) -> list[tuple[int, ...]]:
        return [(math.ceil(self.vocab / tp), self.dim)]

    def head_params(self, tp: int) -> list[tuple[int, ...]]:
        """Final norm and output head (the head is the embedding's own matrix when tied)."""
        return [(self.dim,)] + ([] if self.tied else [(math.ceil(self.vocab / tp), self.dim)])

    @cached_property
    def block_numel(self) -> int:
        return sum(math.prod(s) for s in self.block_params(1))

    @cached_property
    def num_params(self) -> int:
        return self.n_layers * self.block_numel + sum(
            math.prod(s) for s in self.embedding_params(1) + self.head_params(1))

    @cached_property
    def embedding_numel(self) -> int:
        return self.vocab * self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """6·N + 12·L·H·Q·T (composer3d.flops' convention, N without the embedding table)."""
        from composer3d.flops import flops_per_token

        return flops_per_token(self.num_params, self.embedding_numel, self.n_layers, self.n_heads * self.head_dim,
                               seq_len)


@dataclass(frozen=True)
class StageSet:
    """What one pipeline rank holds: its stages' layer counts, and whether it runs the first/last stage."""
    rank: int  # pipeline rank
    layers: tuple[int, ...]
    first: bool
    last: bool

    @property
    def n_layers(self) -> int:
        return sum(self.layers)


@cache
def stage_sets(shape: ModelShape, pp: int, stages_per_rank: int, schedule: str) -> list[StageSet]:
    """Per pipeline rank, its stages (the split composer3d makes: cost = parameters, embedding on the first stage,
    norm and head on the last)."""
    if pp == 1:
        return [StageSet(0, (shape.n_layers,), True, True)]
    costs = [float(shape.block_numel)] * shape.n_layers
    costs[0] += shape.embedding_numel
    costs[-1] += shape.dim + (0 if shape.tied else shape.embedding_numel)
    ranges = split_layers(costs, pp * stages_per_rank)
    sets = []
    for rank in range(pp):
        ids = stage_ids_of_rank(rank, pp, stages_per_rank, schedule)
        sets.append(StageSet(rank, tuple(len(ranges[s]) for s in ids), 0 in ids, len(ranges) - 1 in ids))
    return sets
