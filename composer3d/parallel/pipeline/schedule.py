"""torch's pipeline schedule over this rank's stages (``stages``): ``torch.distributed.pipelining``,
which imports dynamo (a second of a worker's start), imported only by a run with parallel.pp > 1.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from composer3d.models.moe import routing_unrecorded
from composer3d.parallel.pipeline.schedules import SCHEDULES
from composer3d.parallel.pipeline.stages import StageBoundary, StageModule


class _Stage(PipelineStage):
    """A PipelineStage whose shape inference leaves no trace in the model's routing statistics.

    torch (2.13) infers the shapes a stage sends by running it once on the first microbatch or on
    placeholder tensors, with gradients enabled, before the schedule's first step and again after
    switching between training and evaluation; mixture-of-experts layers would count that routing as
    training (``models.moe``).
    """

    def _forward_metadata_inference(self, *args, **kwargs):
        with routing_unrecorded(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)


class _StaticStage(_Stage):
    """A stage built with its boundary's shapes (``StageBoundary``), as every stage of the run is.

    torch (2.13) first runs a vote down the pipeline and back, a message per stage, on whether any
    stage must have its shapes exchanged at the first step; with every stage's given, the answer is
    known to be no and the vote is not run. Under a fake process group (plan.measure) it could not
    be: each receive reads zeros, a vote for the exchange, which then has no other stage to answer.
    (A torch without the vote builds these stages static as given.)
    """

    def _warmup_forward_vote(self, has_backward: bool, received_acc=None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result=None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32, device=self.device)


def _check_sent(stage: StageModule, args, output: torch.Tensor, expected: torch.Tensor) -> None:
    """What a stage built with its boundary's shapes sends is what it said it would (the next stage
    receives into buffers of that shape): a wrong boundary fails the step instead of skewing the
    receiving stage's memory."""
    if (output.shape, output.dtype) != (expected.shape, expected.dtype):
        raise RuntimeError(
            f"pipeline stage {stage.plan.index} sends {tuple(output.shape)} {output.dtype}, but "
            f"its boundary says {tuple(expected.shape)} {expected.dtype} (pipeline.stage_boundary)"
        )


def build_schedule(
    stages: list[StageModule],
    schedule: str,
    microbatches: int,
    pp_group,
    device: torch.device,
    loss_fn,
    boundary: StageBoundary | None = None,
):
    """torch's ``schedule`` over this rank's ``stages``; with ``boundary``, the stages know what
    they send and receive from the start (no exchange of shapes at the first step)."""
    if boundary is not None:
        pipeline_stages = []
        for stage in stages:
            inputs, outputs = boundary.stage_args(stage.plan)
            if not stage.plan.is_last:
                stage.register_forward_hook(partial(_check_sent, expected=outputs))
            pipeline_stages.append(
                _StaticStage(
                    stage,
                    stage.plan.index,
                    stage.plan.num_stages,
                    device,
                    inputs,
                    outputs,
                    group=pp_group,
                )
            )
    else:
        stage_class = (
            _Stage if hasattr(PipelineStage, "_forward_metadata_inference") else PipelineStage
        )
        pipeline_stages = [
            stage_class(stage, stage.plan.index, stage.plan.num_stages, device, group=pp_group)
            for stage in stages
        ]
    schedule_class = get_schedule_class(SCHEDULES[schedule])
    # The loss is already divided by the global token count: gradients are summed over microbatches,
    # not averaged.
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(
            pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False
        )
    return schedule_class(
        pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False
    )


def forward_only(schedule, *args, target=None, losses: list | None = None, **kwargs) -> None:
    """The schedule's micro-batches through the forward alone, as torch's ``eval`` runs them, but
    without the last stage keeping every micro-batch's output to merge and return (its logits: a
    caller reads what it needs in the loss function)."""
    has_backward = schedule._has_backward  # what torch's eval switches, for the same reason
    schedule._has_backward = False
    try:
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    finally:
        schedule._has_backward = has_backward
