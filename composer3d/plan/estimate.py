"""A layout's predicted step: memory, communication, bubble, compute, step time and throughput, put together.

Step time = compute of the busiest pipeline rank × (1 + bubble) + exposed communication. Compute is the rank's
model FLOPs (6·N + 6·L·H·Q·T per token, causal attention: composer3d.training.flops) over its tokens (its
data-parallel rank's over tp and cp) plus recomputation (full checkpointing reruns each block's forward: +1/3 of
its FLOPs), at ``cluster.achievable_fraction`` of the device's dense peak —
one number for all layouts and models, not a fit per row. Exposed communication: TP/SP, pipeline sends and
ZeRO-1's gather are on the critical path; FSDP/HSDP/DDP traffic hides behind compute except what exceeds it, plus
the first block's gather, which nothing precedes; context parallel's traffic as plan/context.py says (the ring's
K/V passes hide behind the attention of the block held); the memory options' host step and copies (``host``) as
plan/host.py says. A layout fits when the busiest rank's device memory and its node's host memory hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from composer3d.dtypes import DTYPES
from composer3d.plan import comm, context
from composer3d.plan.bubble import bubble_fraction, bubble_ratio
from composer3d.plan.hardware import Cluster
from composer3d.plan.host import host_fits, host_seconds
from composer3d.plan.layouts import Candidate
from composer3d.plan.memory import Memory, memory
from composer3d.plan.shapes import ModelShape, StageSet, stage_sets


@dataclass(frozen=True)
class Workload:
    """What the planner reads from a training config, read once (config access is slow next to the arithmetic)."""
    shape: ModelShape
    seq_len: int
    global_batch_size: int
    optimizer: str
    reduce_dtype: str
    memory_headroom: float

    @classmethod
    def from_config(cls, cfg) -> Workload:
        return cls(ModelShape.from_config(cfg.model), cfg.train.seq_len, cfg.train.global_batch_size, cfg.optim.name,
                   cfg.precision.reduce_dtype, cfg.plan.memory_headroom)


@dataclass
class Estimate:
    candidate: Candidate
    memory: Memory  # the rank with the most
    memory_per_pp_rank: list[Memory]
    collectives: list[comm.Collective]  # the busiest pipeline rank's
    collectives_per_pp_rank: list[list[comm.Collective]]
    compute_s: float
    bubble_s: float
    exposed_comm_s: dict[str, float]  # per mesh dimension
    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float | None
    bubble_fraction: float
    fits: bool
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        c = self.candidate
        return {
            "layout": {k: v for k, v in c.degrees().items()}, "zero_stage": c.zero_stage,
            "sequence_parallel": c.sequence_parallel, "pp_schedule": c.pp_schedule if c.pp > 1 else None,
            "pp_stages_per_rank": c.stages_per_rank, "microbatches": c.microbatches,
            "micro_batch_size": c.micro_batch_size, "activation_checkpointing": c.activation_checkpointing,
            "offload": c.offload, "overrides": c.overrides(),
            "memory_bytes_per_gpu": round(self.memory.total), "memory_breakdown_bytes": {
                k: round(v) for k, v in self.memory.as_dict().items()},
            "comm_bytes_per_step": {f"{x.dim}:{x.kind}": round(x.bytes) for x in self.collectives},
            "exposed_comm_s": self.exposed_comm_s, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
            "step_time_s": self.step_time_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "bubble_fraction": self.bubble_fraction,
            "fits": self.fits,
        }


def rank_flops_per_token(shape: ModelShape, stages: StageSet, seq_len: int) -> float:
    """Model FLOPs per token of this pipeline rank's layers (and head, if it has it): its part of 6·N + 6·L·H·Q·T,
    N the parameters a token goes through (a MoE layer's top_k experts)."""
    attention = 6 * shape.n_heads * shape.head_dim * seq_len  # causal: half the score matrix
    dense = 6 * shape.block_numel + attention
    moe = 6 * shape.moe_active_numel + attention if stages.moe_layers else 0
    head = 6 * (shape.dim + shape.vocab * shape.dim) if stages.last else 0
    return stages.dense_layers * dense + stages.moe_layers * moe + head


def recompute_factor(c: Candidate) -> float:
    """Hardware FLOPs over model FLOPs for the blocks: full checkpointing reruns each forward (+1/3 of 6·N's 2+4)."""
    if c.activation_checkpointing == "full":
        return 4 / 3
    if c.activation_checkpointing == "selective" and c.ac_every:
        return 1 + 1 / (3 * c.ac_every)
    return 1.0  # op-level selective recomputes only elementwise ops


def estimate(work: Workload, c: Candidate, cluster: Cluster) -> Estimate:
    """Predict ``c`` for the workload's model, batch and optimizer on ``cluster``."""
    shape, seq = work.shape, work.seq_len
    cb = cluster.compute_bytes
    reduce_bytes = 4 if cb == 4 else DTYPES[work.reduce_dtype].itemsize
    sets = stage_sets(shape, c.pp, c.stages_per_rank, c.pp_schedule)
    mems = [memory(shape, c, s, seq, cluster, work.optimizer) for s in sets]
    cols = [comm.collectives(shape, c, s, seq, cb, reduce_bytes) + context.collectives(shape, c, s, seq, cb)
            for s in sets]
    tokens_per_step = work.global_batch_size * seq
    tokens_per_rank = tokens_per_step / c.dp / c.tp / c.cp  # each TP and CP rank: its share of its dp rank's work
    rate = cluster.peak_flops * cluster.achievable_fraction
    compute = [rank_flops_per_token(shape, s, seq) * tokens_per_rank * recompute_factor(c) / rate for s in sets]
    busiest = max(range(len(sets)), key=lambda i: compute[i])
    bubble = compute[busiest] * bubble_ratio(c)
    exposed: dict[str, float] = {}  # per dimension, the most any pipeline rank waits for it
    for i, rank_cols in enumerate(cols):
        mine: dict[str, float] = {}
        hidden_pool = 0.0
        for col in rank_cols:
            if col.dim == "cp":
                continue  # hidden behind attention or not, per style: context.exposed_seconds
            if col.overlapped:
                hidden_pool += comm.seconds(col, c, cluster)
            else:
                mine[col.dim] = mine.get(col.dim, 0.0) + comm.seconds(col, c, cluster)
        if hidden_pool:
            first_gather = hidden_pool / max(1, 2 * sets[i].n_layers)  # about one block's traffic, never hidden
            mine["dp"] = max(0.0, hidden_pool - compute[i]) + first_gather
        if c.cp > 1:
            mine["cp"] = context.exposed_seconds(shape, c, sets[i], seq, cluster)
        host_exposed, host_overlapped = host_seconds(shape, c, sets[i], work.optimizer, cluster, mems[i])
        if host_exposed or host_overlapped:  # the copies over the host link hide behind compute, not the host step
            mine["host"] = host_exposed + max(0.0, host_overlapped - compute[i])
        for dim, t in mine.items():
            exposed[dim] = max(exposed.get(dim, 0.0), t)
    step = compute[busiest] + bubble + sum(exposed.values())
    flops_per_token = shape.flops_per_token(seq)
    world = c.world_size
    tflops = flops_per_token * tokens_per_step / world / step / 1e12
    worst = max(range(len(sets)), key=lambda i: mems[i].total)
    return Estimate(
        candidate=c, memory=mems[worst], memory_per_pp_rank=mems, collectives=cols[busiest],
        collectives_per_pp_rank=cols, compute_s=compute[busiest], bubble_s=bubble, exposed_comm_s=exposed,
        step_time_s=step, tokens_per_s_per_gpu=tokens_per_step / world / step, tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / cluster.peak_flops if cluster.has_mfu else None, bubble_fraction=bubble_fraction(c),
        fits=mems[worst].total <= cluster.memory_bytes * work.memory_headroom
        and host_fits(mems, cluster, work.memory_headroom))
