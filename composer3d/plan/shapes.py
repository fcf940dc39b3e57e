"""The model's parameters as the planner needs them: each one's shape on a tensor-parallel rank,
grouped by block, and the pipeline split composer3d itself makes
(``parallel.pipeline.schedules.split_layers``, the same cost function).

Llama-shaped decoders (the native model and Hugging Face models laid out like Llama): q/k/v and
gate/up projections split by output rows over tp (column-parallel), o and down projections by input
columns (row-parallel), a vocab-parallel embedding and head, norms replicated. Biases are left out
(a few thousandths of the parameters).

Mixture-of-experts layers (the native model's ``model.moe``, models/moe.py, or a Hugging Face
model's config.json read in the same terms, models/hf/config.py ``moe_sizes``): the router [experts,
dim] whole on every rank, shared experts split like a dense MLP, and the routed experts' stacked
weights [experts, hidden, dim] split by expert over ep and by hidden width over tp. The routed
experts are an FSDP unit of their own (parallel/data_parallel/fsdp.py), so a rank's parameters come
as ``Unit``s: what FSDP gathers and reduces together, over which ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property

from composer3d.errors import ConfigError
from composer3d.models import MODEL_REGISTRY
from composer3d.models.llama import ffn_hidden_dim
from composer3d.parallel.pipeline.schedules import split_layers, stage_ids_of_rank


@dataclass(frozen=True)
class ExpertShape:
    """The mixture-of-experts part of a model (``model.moe``)."""

    experts: int
    top_k: int
    shared: int  # shared experts (one SwiGLU of shared × hidden)
    hidden: int  # each expert's SwiGLU width
    dense_layers: int  # the first layers keep a dense MLP

    @classmethod
    def from_config(cls, moe, dense_hidden: int) -> ExpertShape | None:
        if moe is None or not moe.experts:
            return None
        return cls(
            moe.experts,
            moe.top_k,
            moe.shared_experts,
            moe.expert_hidden_dim or dense_hidden,
            moe.dense_layers,
        )

    @classmethod
    def from_hf(cls, path: str) -> ExpertShape | None:
        """A Hugging Face model's experts, from its config.json; a mixture of experts this cannot
        count is refused (every planning path builds the shape before it estimates anything)."""
        from composer3d.models.hf import load_hf_config, moe_sizes

        sizes, problem = moe_sizes(load_hf_config(path))
        if problem:
            raise ConfigError(
                f"model.path: {path} is a mixture of experts composer3d-plan cannot count: "
                f"{problem}. Plan the closest native shape (model=llama with model.moe.* set to "
                "its config's)"
            )
        return (
            None
            if sizes is None
            else cls(
                sizes["experts"],
                sizes["top_k"],
                sizes["shared_experts"],
                sizes["expert_hidden_dim"],
                sizes["dense_layers"],
            )
        )


@dataclass(frozen=True)
class Unit:
    """Parameters FSDP gathers and reduces together, as shapes on one tensor- and expert-parallel
    rank; ``count`` alike on the rank. ``kind``: a block (or its non-expert part), a MoE layer's
    routed experts (sharded over what ep leaves of dp_shard), or the root (embedding, final norm,
    head: gathered once a step)."""

    params: tuple[tuple[int, ...], ...]
    count: int
    kind: str  # block | experts | root
    names: tuple[str, ...] = ()  # the root's: embedding, norm, head (peft/planning.py matches them)
    # a MoE block's router: its index in ``params`` (optim.name=muon leaves it to AdamW by default)
    router: int | None = None

    @cached_property  # the search asks for it of the same units tens of thousands of times
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.params)


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
    moe: ExpertShape | None = None
    # each layer's sliding attention window (0: the whole causal prefix): what FLOPs per token
    # count; the attention's time stays a causal layer's (transformers' sdpa, the default, runs a
    # window as a mask: every tile computed)
    windows: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, m) -> ModelShape:
        heads = m.n_heads
        ffn = ffn_hidden_dim(m.dim, m.multiple_of, m.ffn_dim_multiplier, m.ffn_hidden_dim)
        return cls(
            dim=m.dim,
            n_layers=m.n_layers,
            n_heads=heads,
            n_kv_heads=m.n_kv_heads or heads,
            head_dim=m.head_dim or m.dim // heads,
            ffn=ffn,
            vocab=m.vocab_size,
            tied=bool(m.tie_embeddings),
            moe=ExpertShape.from_hf(m.path)
            if m.name == "hf"
            else ExpertShape.from_config(m.moe, ffn),
            windows=tuple(MODEL_REGISTRY[m.name].attention_windows(m)),
        )

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(map(self.is_moe, range(self.n_layers)))

    def _attention_params(self, tp: int) -> list[tuple[int, ...]]:
        h, q, kv = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return [
            (q // tp, h),
            (kv // tp, h),
            (kv // tp, h),
            (h, q // tp),  # wq wk wv (column), wo (row)
            (h,),
            (h,),
        ]  # two norms

    @cache  # noqa: B019 (a few shapes per run; frozen, hashable)
    def block_params(self, tp: int) -> list[tuple[int, ...]]:
        """Shapes of one dense block's parameters on one tensor-parallel rank."""
        h, f = self.dim, self.ffn
        return self._attention_params(tp) + [
            (f // tp, h),
            (f // tp, h),
            (h, f // tp),
        ]  # w1 w3 (column), w2 (row)

    @cache  # noqa: B019
    def moe_block_params(self, tp: int) -> list[tuple[int, ...]]:
        """A MoE block's parameters but its routed experts: attention, router, shared experts."""
        h, s = self.dim, self.moe.shared * self.moe.hidden
        shared = [(s // tp, h), (s // tp, h), (h, s // tp)] if s else []
        return self._attention_params(tp) + [(self.moe.experts, h)] + shared

    def expert_params(self, tp: int, ep: int) -> list[tuple[int, ...]]:
        """One MoE layer's routed experts on one (ep, tp) rank: w1, w3 [experts, hidden, dim], w2
        [experts, dim, hidden]."""
        e, f, h = self.moe.experts // ep, self.moe.hidden // tp, self.dim
        return [(e, f, h), (e, h, f), (e, f, h)]

    def layer_numel(self, layer: int) -> int:
        """All of a layer's parameters (every expert): the pipeline split's cost."""
        if not self.is_moe(layer):
            return self.block_numel
        return sum(math.prod(s) for s in self.moe_block_params(1) + self.expert_params(1, 1))

    @cached_property
    def moe_active_numel(self) -> int:
        """The parameters a token goes through in a MoE layer (top_k of its routed experts): its
        matmul FLOPs / 6."""
        per_expert = sum(math.prod(s) for s in self.expert_params(1, 1)) // self.moe.experts
        return sum(math.prod(s) for s in self.moe_block_params(1)) + self.moe.top_k * per_expert

    def layer_active_numel(self, layer: int) -> int:
        return self.moe_active_numel if self.is_moe(layer) else self.block_numel

    def embedding_params(self, tp: int) -> list[tuple[int, ...]]:
        return [(math.ceil(self.vocab / tp), self.dim)]

    def head_params(self, tp: int, twin: bool = False) -> list[tuple[int, ...]]:
        """Final norm and output head (the head is the embedding's own matrix when tied, or under PP
        its ``twin`` on the last stage: ``parallel.tied``)."""
        return [(self.dim,)] + (
            [] if self.tied and not twin else [(math.ceil(self.vocab / tp), self.dim)]
        )

    @cached_property
    def block_numel(self) -> int:
        return sum(math.prod(s) for s in self.block_params(1))

    @cached_property
    def num_params(self) -> int:
        return sum(map(self.layer_numel, range(self.n_layers))) + sum(
            math.prod(s) for s in self.embedding_params(1) + self.head_params(1)
        )

    @cached_property
    def num_active_params(self) -> int:
        return self.num_params - sum(
            self.layer_numel(i) - self.layer_active_numel(i) for i in range(self.n_layers)
        )

    @cached_property
    def embedding_numel(self) -> int:
        return self.vocab * self.dim

    def _attention_layers(self, seq_len: int) -> float:
        """Layers' worth of causal attention (training.flops.attention_layers)."""
        from composer3d.training.flops import attention_layers

        if not self.windows:
            return self.n_layers
        # (plan.what_fits grows n_layers: the windows' pattern repeats over the added layers)
        windows = [self.windows[i % len(self.windows)] for i in range(self.n_layers)]
        return attention_layers(windows, seq_len)

    @cache  # noqa: B019 (every estimate asks it)
    def flops_per_token(self, seq_len: int) -> float:
        """6·N + 6·L·H·Q·T (composer3d.training.flops' convention: causal attention, N the active
        parameters without the embedding table, L less what sliding windows leave out)."""
        from composer3d.training.flops import flops_per_token

        return flops_per_token(
            self.num_active_params,
            self.embedding_numel,
            self._attention_layers(seq_len),
            self.n_heads * self.head_dim,
            seq_len,
        )

    @cache  # noqa: B019
    def forward_flops_per_token(self, seq_len: int) -> float:
        """A no-grad forward's, 2·N + 2·L·H·Q·T: what train.objective=dpo's reference model adds per
        token (training.flops.forward_flops_per_token, as the runtime counts it)."""
        from composer3d.training.flops import forward_flops_per_token

        return forward_flops_per_token(
            self.num_active_params - self.embedding_numel,
            self._attention_layers(seq_len),
            self.n_heads * self.head_dim,
            seq_len,
        )


@dataclass(frozen=True)
class StageSet:
    """What one pipeline rank holds: its stages' layer counts (and how many of its layers are MoE),
    and whether it runs the first/last stage."""

    rank: int  # pipeline rank
    layers: tuple[int, ...]
    first: bool
    last: bool
    moe_layers: int = 0

    @property
    def kind(self) -> tuple:
        """What the rank holds, whatever its place: ranks of one kind differ only in the
        micro-batches they hold in flight (plan/bubble.py)."""
        return (self.layers, self.first, self.last, self.moe_layers)

    @property
    def n_layers(self) -> int:
        return sum(self.layers)

    @property
    def dense_layers(self) -> int:
        return self.n_layers - self.moe_layers

    @cache  # noqa: B019 (stage sets are cached themselves; the search asks the same ones again and again)
    def units(self, shape: ModelShape, tp: int, ep: int) -> tuple[Unit, ...]:
        """This rank's parameters as FSDP units (those it has: a count of 0 is left out)."""
        units = [Unit(tuple(shape.block_params(tp)), self.dense_layers, "block")]
        if self.moe_layers:
            router = len(shape._attention_params(tp))  # moe_block_params' order
            units += [
                Unit(tuple(shape.moe_block_params(tp)), self.moe_layers, "block", router=router),
                Unit(tuple(shape.expert_params(tp, ep)), self.moe_layers, "experts"),
            ]
        root = (shape.embedding_params(tp) if self.first else []) + (
            shape.head_params(tp, twin=not self.first) if self.last else []
        )
        names = (("embedding",) if self.first else ()) + (
            ("norm", "head")[: len(root) - self.first] if self.last else ()
        )
        return tuple(
            u for u in units + [Unit(tuple(root), 1, "root", names)] if u.count and u.params
        )


@cache
def stage_sets(shape: ModelShape, pp: int, stages_per_rank: int, schedule: str) -> list[StageSet]:
    """Per pipeline rank, its stages (the split composer3d makes: cost = parameters, embedding on
    the first stage, norm and head on the last)."""
    if pp == 1:
        return [StageSet(0, (shape.n_layers,), True, True, shape.n_moe_layers)]
    costs = [float(shape.layer_numel(i)) for i in range(shape.n_layers)]
    costs[0] += shape.embedding_numel
    # the head's matrix: its own, or a tied embedding's twin
    costs[-1] += shape.dim + shape.embedding_numel
    ranges = split_layers(costs, pp * stages_per_rank)
    sets = []
    for rank in range(pp):
        ids = stage_ids_of_rank(rank, pp, stages_per_rank, schedule)
        moe = sum(shape.is_moe(i) for s in ids for i in ranges[s])
        sets.append(
            StageSet(
                rank, tuple(len(ranges[s]) for s in ids), 0 in ids, len(ranges) - 1 in ids, moe
            )
        )
    return sets
