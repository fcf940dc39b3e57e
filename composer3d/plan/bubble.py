"""Pipeline bubble per schedule: idle time relative to the compute of one step.

(P−1)/(v·M) for P ranks, v stages per rank and M micro-batches (GPipe, 1F1B: v=1; interleaved and
looped schedules: v chunks per rank shorten each ramp v times). Zero-bubble schedules split backward
into input- and weight-gradient halves and fill the ramps with weight-gradient work: the ZB-H1
schedule leaves about a third of 1F1B's bubble (Qi et al., "Zero Bubble Pipeline Parallelism",
2023); that value is used for all three (torch's InterleavedZeroBubble, ZBVZeroBubble and
DualPipeV). Measured with equal forward, input- and weight-gradient chunks at P=2, M=8
(tests/plan_measure.py's timing), torch's schedules leave 1.0–2.6× that (interleaved zero bubble
1.4–1.9×, ZBV 1.0–1.5×, DualPipeV 2.2–2.6×): for them the bubble predicted is optimistic, and the
report says so.

The DPO reference's forward-only pass (train.objective=dpo under PP) runs every micro-batch's
forward before the policy's step: its ramps hold no backward work to fill them, so its share of the
compute idles the full (P−1)/(v·M) under every schedule.
"""

from __future__ import annotations

from composer3d.plan.layouts import ZERO_BUBBLE, Candidate


def bubble_ratio(c: Candidate) -> float:
    """Idle time over compute time on a pipeline rank (0 without PP)."""
    if c.pp == 1:
        return 0.0
    ratio = (c.pp - 1) / (c.stages_per_rank * c.microbatches)
    return ratio / 3 if c.pp_schedule in ZERO_BUBBLE else ratio


def bubble_seconds(c: Candidate, compute_s: float, forward_only_s: float = 0.0) -> float:
    """The idle time of a pipeline rank computing ``compute_s`` a step, ``forward_only_s`` of it in
    a forward-only pass (the DPO reference's)."""
    if c.pp == 1:
        return 0.0
    ramp = (c.pp - 1) / (c.stages_per_rank * c.microbatches)
    return (compute_s - forward_only_s) * bubble_ratio(c) + forward_only_s * ramp


def microbatches_in_flight(c: Candidate, pp_rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at once, in units of its
    whole share of layers: GPipe and looped BFS run every forward first (M); 1F1B and the
    zero-bubble schedules start a rank's first backward after P − rank forwards; interleaved 1F1B
    holds (1 + (P−1)/(P·v))·P on the first rank (Narayanan et al. 2021), one fewer per rank after
    it."""
    if c.pp == 1:
        return 1.0
    m, p, v = c.microbatches, c.pp, c.stages_per_rank
    if c.pp_schedule in ("gpipe", "looped_bfs"):
        return float(m)
    if c.pp_schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        return min(float(m), p * (1 + (p - 1) / (p * v)) - pp_rank)
    return float(min(m, p - pp_rank))
