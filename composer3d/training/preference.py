"""Preference tuning (``train.objective=dpo``): DPO and its kin on packed chosen/rejected pairs, as
TRL computes them.

Each row of a batch holds whole pairs (``data.preference``); ``segment`` marks each target with its
pair slot and side. A micro-batch's loss is computed from per-token log-probabilities of the targets
(``loss.target_log_probs``: the chunked, vocabulary-sharded cross-entropy kernel, per token, no
full-vocabulary fp32 log-softmax), summed per pair and side, for the policy with gradients and for
the reference without. The losses are TRL's (``DPOTrainer``: sigmoid, ipo, hinge; ``CPOTrainer``:
label smoothing, simpo). Like the token loss, the pairs' summed loss is divided by the pairs of the
whole global batch (the loader's count), so the gradient does not depend on the layout. The metrics
(TRL's names, ``METRICS``) are per-step sums on the device, reduced with the loss once per logging
window (``readback``) and divided by the pairs there.

The reference: a frozen copy of the initial policy, built and parallelized as the policy is (no
gradients, no optimizer state; a resumed run rebuilds it from the initial weights, never from the
checkpoint), or under LoRA the policy with its adapters switched off (``peft.lora.adapters_off``),
or (``precomputed``, TRL's precompute_ref_log_probs) every pair's sums taken in one pass over the
data before the first step and carried by the batches (the data's ``reference``): the policy itself
runs the pass while untrained, a resumed run a frozen copy it then lets go. SimPO has none.

Under pipeline parallel a micro-batch's loss is computed on the last stage, from what the schedule
hands it: its logits and its share of the schedule's target. The target is the batch's row numbers,
so the loss looks up its rows' targets, segments and reference log-probabilities (rows hold whole
pairs: a pair's chosen and rejected meet there). The reference runs first, forward only, through a
schedule of its own stages (the copy's; under adapters_off the policy's), its log-probabilities kept
on the last stage for the policy's step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_reduce as differentiable_all_reduce

from composer3d.config.schema import PreferenceConfig, TrainConfig
from composer3d.data import max_pairs_per_row
from composer3d.data.preference import CHOSEN, REJECTED
from composer3d.parallel.mesh import ParallelMesh
from composer3d.peft.lora import adapters_off
from composer3d.training.assemble import ParallelModel, build_parallel_model
from composer3d.training.console import human_bytes
from composer3d.training.loss import target_log_probs
from composer3d.training.metrics import local_bytes

log = logging.getLogger("composer3d")

# TRL's metric names, in the order of ``preference_loss``'s sums
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_sums(values: torch.Tensor, segment: torch.Tensor, cp: int = 1) -> torch.Tensor:
    """``values`` (rows, seq) summed per pair and side by ``segment``: (rows, slots, 2), a slot that
    holds no pair 0. Its size is fixed by the whole row's length alone (``max_pairs_per_row``; a cp
    rank holds 1/``cp`` of it), not read from the batch, which would cost a host sync."""
    rows, seq = segment.shape
    slots = max_pairs_per_row(seq * cp)
    index = torch.where(segment >= 0, segment, 2 * slots)  # elsewhere: a column dropped after
    sums = values.new_zeros(rows, 2 * slots + 1).scatter_add(1, index, values)
    return sums[:, :-1].view(rows, slots, 2)


def preference_loss(
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    segment: torch.Tensor,
    pref: PreferenceConfig,
    cp_group: dist.ProcessGroup | None = None,
    reference_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss summed over the pairs of these rows, and the metrics' sums over them (METRICS's
    order, detached). ``policy``, ``reference``: per-token log-probabilities of the targets (rows,
    seq), 0 where no loss is taken; ``reference`` None for simpo, or where ``reference_sums``
    (rows, slots, 2) holds the reference's sums per pair already (preference.reference=
    precomputed). Under context parallel (``cp_group``) each rank holds a share of every row's
    tokens: the pairs' sums are completed over the cp ranks (the policy's through autograd), every
    rank then has the whole pairs' losses, and each returns 1/cp of the loss and the metrics, which
    the data-parallel reductions add up."""
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1

    def sums(values: torch.Tensor, grad: bool = False) -> torch.Tensor:
        local = pair_sums(values, segment, cp)
        if cp == 1:
            return local
        if grad:  # its backward sums the ranks' gradients: each rank's share is then 1/cp
            return differentiable_all_reduce(local, "sum", cp_group)
        dist.all_reduce(local, group=cp_group)
        return local

    counts = sums((segment >= 0).to(policy.dtype))
    held = counts[..., CHOSEN] > 0  # a pair's completions have a token each at least
    logps = sums(policy, grad=True)
    if pref.loss_type == "simpo":  # length-averaged, against no reference (CPOTrainer's)
        scores = logps / counts.clamp(min=1)
    else:  # the log-ratios to the reference
        scores = logps - (sums(reference) if reference_sums is None else reference_sums)
    chosen, rejected = scores[..., CHOSEN], scores[..., REJECTED]
    loss = torch.where(held, _pair_losses(chosen, rejected, counts, pref), 0.0).sum() / cp
    with torch.no_grad():
        rewards = pref.beta * scores
        # logps/*: what the loss compares, as TRL logs it (simpo: CPOTrainer's averages)
        shown = scores if pref.loss_type == "simpo" else logps
        per_pair = torch.stack(
            [
                rewards[..., CHOSEN],
                rewards[..., REJECTED],
                (rewards[..., CHOSEN] > rewards[..., REJECTED]).to(policy.dtype),
                rewards[..., CHOSEN] - rewards[..., REJECTED],
                shown[..., CHOSEN],
                shown[..., REJECTED],
            ]
        )
        metrics = torch.where(held, per_pair, 0.0).sum(dim=(1, 2)) / cp
    return loss, metrics


def _pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, counts: torch.Tensor, pref: PreferenceConfig
) -> torch.Tensor:
    """Each pair's loss from its chosen and rejected scores (log-ratios; simpo: averaged
    log-probabilities)."""
    beta, smoothing = pref.beta, pref.label_smoothing
    delta = chosen - rejected
    if pref.loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if pref.loss_type == "ipo":  # per completion token, as TRL normalizes it
        tokens = counts.clamp(min=1)
        per_token = chosen / tokens[..., CHOSEN] - rejected / tokens[..., REJECTED]
        return (per_token - 1 / (2 * beta)) ** 2
    if pref.loss_type == "simpo":
        delta = delta - pref.simpo_gamma / beta
    # sigmoid (and simpo): conservative DPO, the labels flipped with probability label_smoothing
    return -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(-beta * delta)


class PreferenceObjective:
    """A DPO run's loss per micro-batch, its reference model, and the step's metric sums."""

    def __init__(
        self,
        cfg: TrainConfig,
        mesh: ParallelMesh,
        device: torch.device,
        policy: torch.nn.Module,
        compiled: bool,
        context=None,
        pipeline=None,
        make_schedule: Callable | None = None,
    ):
        """``context``: the policy's ContextParallel under cp (the frozen copy attends by its
        placement of the batch too). Under PP: ``pipeline``, the policy's schedule, and
        ``make_schedule(stages, loss_fn)``, another over the copy's stages."""
        self.pref, self.compiled = cfg.preference, compiled
        self.cp_group = mesh["cp"].get_group() if mesh.layout.cp > 1 else None
        self.sums = torch.zeros(len(METRICS), device=device)
        # the model giving the reference log-probabilities, and how to run it
        self.reference: torch.nn.Module | None = None
        self.reference_mode = contextlib.nullcontext
        # Under PP: the schedule that runs the reference, and the step's rows the loss looks up
        self.reference_schedule = None
        self._step_rows: _StepRows | None = None
        # precomputed: the pass over the data still to run before the first step (the trainer's
        # ``_precompute_reference``)
        self.pending_pass: _ReferencePass | None = None
        if self.pref.loss_type == "simpo":  # reference-free
            return
        if self.pref.reference == "precomputed":
            self.pending_pass = _ReferencePass(
                policy, pipeline, partial(_frozen_copy, cfg, mesh, device, context), make_schedule
            )
        elif self.pref.reference == "adapters_off":
            self.reference, self.reference_mode = policy, partial(adapters_off, policy)
            self.reference_schedule = pipeline
        else:
            copy = _frozen_copy(cfg, mesh, device, context)
            self.reference = copy.model
            if copy.stages:
                self.reference_schedule = make_schedule(copy.stages, loss_fn=self.pipeline_loss)

    def loss(
        self,
        model: torch.nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor,
        segment: torch.Tensor,
        reference_sums: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The micro-batch's loss summed over its pairs (not yet normalized); its metric sums are
        added to the step's. ``reference_sums``: the batch's precomputed reference sums."""
        reference = self._reference_log_probs(inputs, targets, positions)
        logits = model(inputs, position_ids=positions)
        # the logits' gradient written over them: nothing else holds them
        policy = target_log_probs(logits, targets, compiled=self.compiled, in_place=True)
        loss, sums = preference_loss(
            policy, reference, segment, self.pref, self.cp_group, reference_sums
        )
        self.sums += sums
        return loss

    @torch.no_grad()
    def _reference_log_probs(
        self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with self.reference_mode():
            logits = self.reference(inputs, position_ids=positions)
        return target_log_probs(logits, targets, compiled=self.compiled)

    def pipeline_target(
        self,
        targets: torch.Tensor,
        segment: torch.Tensor,
        args: tuple,
        kwargs: dict,
        reference_sums: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Under PP, before the policy's step: the schedule's target, each row's number, for
        ``pipeline_loss`` to look its rows up by; the reference run forward only over every
        micro-batch first (``args``, ``kwargs``: the schedule's inputs), its log-probabilities kept
        on the last stage (precomputed: ``reference_sums``, the batch's)."""
        # here: torch's pipelining imports dynamo, which a run without a pipeline never needs
        from composer3d.parallel.pipeline.schedule import forward_only

        rows = torch.arange(targets.shape[0], device=targets.device)
        self._step_rows = _StepRows(
            targets,
            segment,
            targets.new_zeros(targets.shape[0], len(METRICS), dtype=torch.float32),
            reference_sums=reference_sums,
        )
        if self.reference is None:
            return rows
        self._step_rows.reference = torch.zeros(targets.shape, device=targets.device)
        self._step_rows.collecting = True
        try:
            with torch.no_grad(), self.reference_mode():
                forward_only(self.reference_schedule, *args, target=rows, **kwargs)
        finally:
            self._step_rows.collecting = False
        return rows

    def pipeline_loss(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The loss of the micro-batch of ``rows`` from its last stage's ``logits`` (as ``loss``);
        while the reference runs, its log-probabilities kept instead (and 0 returned)."""
        step = self._step_rows
        targets, segment = step.targets[rows], step.segment[rows]
        if step.collecting:
            step.reference[rows] = target_log_probs(logits, targets, compiled=self.compiled)
            return logits.new_zeros((), dtype=torch.float32)
        policy = target_log_probs(logits, targets, compiled=self.compiled, in_place=True)
        reference = None if step.reference is None else step.reference[rows]
        reference_sums = None if step.reference_sums is None else step.reference_sums[rows]
        loss, sums = preference_loss(
            policy, reference, segment, self.pref, self.cp_group, reference_sums
        )
        # Written to the micro-batch's slot (its first row), not added: at its first step torch
        # also runs the last stage's loss on placeholder activations, to learn the gradients' shapes
        step.sums[rows[:1]] = sums
        return loss

    @contextlib.contextmanager
    def reference_for_the_pass(self, untrained: bool):
        """preference.reference=precomputed: the model whose log-probabilities the pass over the
        data takes, run as the other references run: the policy itself while it is untrained (the
        initial policy then; in eval mode), else (a resumed run) a frozen copy of the initial
        policy, built for the pass and let go after it."""
        run = self.pending_pass
        if untrained:
            model, schedule = run.policy, run.policy_schedule
        else:
            copy = run.build_copy()
            model, schedule = copy.model, None
            if copy.stages:
                schedule = run.make_schedule(copy.stages, loss_fn=self.pipeline_loss)
        was_training = model.training
        model.eval()
        self.reference, self.reference_schedule = model, schedule
        try:
            yield
        finally:
            self.reference = self.reference_schedule = None
            model.train(was_training)

    @torch.no_grad()
    def pass_sums(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor,
        segment: torch.Tensor,
        microbatches: int,
        pipeline_inputs: tuple[tuple, dict] | None = None,
    ) -> torch.Tensor:
        """Inside ``reference_for_the_pass``: the reference's sums of these rows' pairs (rows,
        slots, 2), whole under cp; run as a step runs its forwards (``microbatches``; under PP the
        schedule's ``pipeline_inputs``, and only the last stage's sums are not 0)."""
        if self.reference_schedule is not None:
            self.pipeline_target(targets, segment, *pipeline_inputs)
            per_token, self._step_rows = self._step_rows.reference, None
        else:
            per_token = torch.cat(
                [
                    self._reference_log_probs(*chunk)
                    for chunk in zip(
                        inputs.chunk(microbatches),
                        targets.chunk(microbatches),
                        positions.chunk(microbatches),
                    )
                ]
            )
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        sums = pair_sums(per_token, segment, cp)
        if self.cp_group is not None:
            dist.all_reduce(sums, group=self.cp_group)
        return sums

    def step_sums(self) -> torch.Tensor:
        """The metric sums of the step that ends (this rank's pairs), and a fresh start."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        if self._step_rows is not None:
            sums, self._step_rows = sums + self._step_rows.sums.sum(0), None
        return sums


@dataclass
class _ReferencePass:
    """What preference.reference=precomputed's pass over the data may run: the policy (and under
    PP its schedule), or a frozen copy built on demand (``make_schedule``: its schedule under
    PP)."""

    policy: torch.nn.Module
    policy_schedule: object | None
    build_copy: Callable[[], ParallelModel]
    make_schedule: Callable | None


@dataclass
class _StepRows:
    """Under PP, the step's rows as the loss looks them up (cp: this rank's share of each)."""

    targets: torch.Tensor
    segment: torch.Tensor
    sums: torch.Tensor  # the metrics' sums, a row per micro-batch (at its first row)
    # the reference's log-probabilities (last stage; None: simpo), and whether it is running
    reference: torch.Tensor | None = None
    collecting: bool = False
    reference_sums: torch.Tensor | None = None  # precomputed: the batch's, per pair


def _frozen_copy(
    cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, context=None
) -> ParallelModel:
    """The initial policy again, through the same assembly (the same sharding), frozen: from its
    initial weights whether or not the policy resumes from a checkpoint. Under cp it attends by the
    policy's ``context``, whose placement of each batch the trainer sets."""
    copy = build_parallel_model(cfg, mesh, device)
    if context is not None:
        copy.model.use_context_parallel(context)
    copy.model.requires_grad_(False)
    copy.model.eval()
    log.info(
        "preference.reference=%s: a frozen copy of the initial policy, %s on this rank",
        cfg.preference.reference,
        human_bytes(sum(local_bytes(p) for p in copy.model.parameters())),
    )
    return copy
