"""Pipeline parallel's stages: this rank's, cut from the model at the cost-balanced split (in
numbers: ``schedules``), and what one micro-batch carries between them; torch's schedule over them
is ``schedule``.

The model keeps its own parameter names: each pp rank prunes the full (meta) model down to the
layers of its stages (plus the embedding if it runs the first stage, the final norm and head if it
runs the last), so checkpoints, init and optimizer state stay keyed by the same names as without PP.
A stage is a thin view that calls the rank's model on a slice of layers (``model(x, layer_ids,
embed, head)``). The split only needs the model protocol (``tok_embeddings``, ``layers`` ModuleDict,
``norm``, ``output``), nothing Llama-specific.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from composer3d.config.schema import TrainConfig
from composer3d.dtypes import DTYPES
from composer3d.parallel.data_parallel.fsdp import runs_fsdp
from composer3d.parallel.pipeline.schedules import split_layers, stage_ids_of_rank


def layer_costs(model: nn.Module) -> list[float]:
    """Relative cost of each block, with the embedding charged to the first and the head (+loss) to
    the last.

    Parameter count is the proxy: it is what a matmul costs in FLOPs and what a stage holds in
    memory (parameters, gradients, optimizer state), so a large-vocabulary head counts as several
    layers.
    """
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    costs = [float(count(block)) for block in model.layers.values()]
    costs[0] += count(model.tok_embeddings)
    costs[-1] += count(model.norm) + count(model.output)
    return costs


@dataclass(frozen=True)
class StagePlan:
    index: int
    num_stages: int
    layer_ids: list[str]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def plan_stages(
    model: nn.Module, pp_rank: int, pp: int, stages_per_rank: int, schedule: str
) -> list[StagePlan]:
    names = list(model.layers.keys())
    ranges = split_layers(layer_costs(model), pp * stages_per_rank)
    return [
        StagePlan(s, len(ranges), [names[i] for i in ranges[s]])
        for s in stage_ids_of_rank(pp_rank, pp, stages_per_rank, schedule)
    ]


def prune_to_stages(model: nn.Module, stages: list[StagePlan]) -> None:
    """Drop every module this rank's stages do not run (names of the rest stay as they were)."""
    keep = {layer_id for stage in stages for layer_id in stage.layer_ids}
    for layer_id in list(model.layers.keys()):
        if layer_id not in keep:
            del model.layers[layer_id]
    if not any(stage.is_first for stage in stages):
        model.tok_embeddings = None
    if not any(stage.is_last for stage in stages):
        model.norm = model.output = None


class StageModule(nn.Module):
    """One pipeline stage: the rank's model run on this stage's slice.

    Its children are exactly the stage's modules (shared with the model), so ``parameters()`` is the
    stage's — zero-bubble schedules compute weight gradients from it — while the model itself is
    held without being registered, and does the forward.
    """

    def __init__(self, model: nn.Module, plan: StagePlan):
        super().__init__()
        object.__setattr__(self, "_model", model)
        self.plan = plan
        self.layers = nn.ModuleList(model.layers[i] for i in plan.layer_ids)
        if plan.is_first:
            self.tok_embeddings = model.tok_embeddings
        if plan.is_last:
            self.norm, self.output = model.norm, model.output

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # position_ids: a kwarg of the schedule's step, split into microbatches and given to every
        # stage
        return self._model(
            x,
            self.plan.layer_ids,
            embed=self.plan.is_first,
            head=self.plan.is_last,
            position_ids=position_ids,
        )


@dataclass(frozen=True)
class StageBoundary:
    """What one micro-batch carries between stages, known from the config before any stage runs:
    ``rows`` of ``tokens`` each (this rank's share of the sequence under context parallel; sequence
    parallel leaves a later stage ``1/sequence_shards`` of them), the residual stream ``dim`` wide
    in ``dtype``; the last stage's logits hold ``vocab`` columns (this rank's share under TP) in
    ``logits_dtype``."""

    rows: int
    tokens: int
    sequence_shards: int
    dim: int
    vocab: int
    dtype: torch.dtype
    logits_dtype: torch.dtype

    def stage_args(self, plan: StagePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """A stage's example input and output (meta tensors: shapes, dtypes and whether a gradient
        flows back, which is what torch derives the gradients' buffers from)."""
        hidden = torch.empty(
            self.rows,
            self.tokens // self.sequence_shards,
            self.dim,
            dtype=self.dtype,
            device="meta",
            requires_grad=True,
        )
        tokens = torch.empty(self.rows, self.tokens, dtype=torch.long, device="meta")
        logits = torch.empty(
            self.rows,
            self.tokens,
            self.vocab,
            dtype=self.logits_dtype,
            device="meta",
            requires_grad=True,
        )
        return (tokens if plan.is_first else hidden), (logits if plan.is_last else hidden)


def stage_boundary(cfg: TrainConfig, mesh, microbatches: int) -> StageBoundary:
    """``StageBoundary`` of a TrainConfig's pipeline on ``mesh`` at ``microbatches`` a step."""
    t, p, layout = cfg.train, cfg.parallel, mesh.layout
    compute = DTYPES[cfg.precision.param_dtype]
    # FSDP's mixed precision casts each stage's input to the compute dtype; autocast (no FSDP) keeps
    # the residual stream in the parameters' fp32, casting only inside matmuls (parallelize chooses
    # between them so)
    fsdp = runs_fsdp(mesh, p)
    return StageBoundary(
        rows=t.global_batch_size // (layout.dp * microbatches),
        tokens=t.seq_len // layout.cp,
        sequence_shards=layout.tp if p.sequence_parallel else 1,
        dim=cfg.model.dim,
        vocab=math.ceil(cfg.model.vocab_size / layout.tp),
        dtype=compute if fsdp else torch.float32,
        logits_dtype=compute,
    )
