"""Pipeline parallel in numbers, without torch's pipelining: the schedules by name and what each
refuses, which stages a rank runs, the cost-balanced split of layers into stages (``stages`` builds
them).

The config checks and the planner read these before any worker starts: torch's pipelining imports
dynamo, which only a pipeline's schedule (``is_multi_stage``) and the workers need.
"""

from __future__ import annotations

import functools
import math

# composer3d name → torch's schedule name
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
V_SHAPED = (
    "zbv",
    "dualpipev",
)  # rank r runs stages r and 2·pp−1−r, so the first and last stage share rank 0


@functools.cache  # the planner asks for each of tens of thousands of candidates
def forward_only_problem(schedule: str, runner: str) -> str | None:
    """Why ``runner`` (what runs the schedule's micro-batches through the forward alone: evaluation,
    a DPO reference's pass) cannot under ``schedule``, or None where torch (2.13) can: a V-shaped
    schedule's plan hands each stage's input gradient to the stage before on the same rank,
    backward or not, and fails without one."""
    if schedule not in V_SHAPED:
        return None
    return (
        f"{runner} runs the pipeline forward only, which torch's {schedule} cannot: its plan "
        "passes each micro-batch's input gradient between the two stages of a rank, backward or not"
    )


def is_multi_stage(schedule: str) -> bool:
    # here, not at the top: torch.distributed.pipelining imports dynamo (a second), which the
    # launcher's config checks need only for a pipeline (parallel.pp > 1)
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    return not issubclass(get_schedule_class(SCHEDULES[schedule]), PipelineScheduleSingle)


def default_stages_per_rank(schedule: str) -> int:
    return 2 if is_multi_stage(schedule) else 1


def schedule_problem(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why torch's schedule would refuse this combination (checked before any process group
    exists)."""
    stages = pp * stages_per_rank
    if not is_multi_stage(schedule) and stages_per_rank != 1:
        return f"{schedule} runs one stage per rank, got pp_stages_per_rank={stages_per_rank}"
    if schedule in V_SHAPED and stages_per_rank != 2:
        return (
            f"{schedule} places exactly 2 stages per rank (V shape), got "
            f"pp_stages_per_rank={stages_per_rank}"
        )
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        return (
            f"{schedule} needs at least as many microbatches as stages ({stages}), got "
            f"{microbatches}"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (
                f"{schedule} needs microbatches ({microbatches}) to be a multiple of their rounds "
                f"({rounds})"
            )
    return None


def stage_ids_of_rank(rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank)]  # looped: stage s on rank s mod pp


def split_layers(costs: list[float], num_stages: int) -> list[range]:
    """Contiguous, non-empty layer ranges, one per stage: the most expensive stage as cheap as
    possible (exact), ties broken toward even stages (smaller sum of squared stage costs)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: (max stage cost, sum of squares) splitting the first i layers into s stages; cut:
    # last start
    worst = (math.inf, math.inf)
    best = [[worst] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                segment = prefix[i] - prefix[j]
                value = (max(best[s - 1][j][0], segment), best[s - 1][j][1] + segment**2)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, end = [], n
    for s in range(num_stages, 0, -1):
        ranges.append(range(cut[s][end], end))
        end = cut[s][end]
    return ranges[::-1]
