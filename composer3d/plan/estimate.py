"""A layout's predicted step: memory, communication, bubble, compute, step time and throughput, put
together.

Step time = compute of the busiest pipeline rank + its bubble + exposed communication. The bubble
is plan/bubble.py's share of all a stage spends on its micro-batches: its kernels and the
collectives it waits for inside each (TP's, EP's, cp's: ``IN_STAGE``), for the ramps wait for
both. Compute is
the rank's kernels' time (plan/kernels.py: GEMMs by shape, attention, elementwise work eager or
compiled, recomputation, the optimizer step), from physical constants shared by every layout and
model, nothing per row, or from the rates a calibration file measured on the device
(plan.calibration: plan/rates.py), which every estimate then notes. Exposed communication: TP/SP,
pipeline sends, ZeRO-1's gather and optim.name=muon's all-to-alls (plan/muon.py) are on the critical
path; FSDP/HSDP/DDP traffic hides behind compute except what exceeds it, plus the first block's
gather, which nothing precedes; gradients reduced once a step (ZeRO-1, FSDP under PP) hide behind
the last micro-batch's backward only; ``plan.published_overlap`` prices the overlaps other stacks
publish; context parallel's traffic as plan/context.py says (the ring's K/V passes hide behind the
attention of the block held); the memory options' host step and copies (``host``) as plan/host.py
says. A layout fits when the busiest rank's device memory and its node's host memory hold it.
train.objective=dpo's reference model is charged where it runs: a frozen copy's parameters in
memory, its forward in compute, its gathers, TP's forward collectives, its experts' all-to-alls,
cp's forward passes and the pipeline's sends in communication, under PP its forward-only pass's own
bubble (plan/bubble.py), its forward's FLOPs in TFLOP/s (as training counts them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from composer3d.config.checks.preference import reference_each_step
from composer3d.config.schema import TrainConfig
from composer3d.dtypes import DTYPES
from composer3d.peft.planning import Peft
from composer3d.plan import comm, context
from composer3d.plan.bubble import bubble_seconds
from composer3d.plan.hardware import Cluster
from composer3d.plan.host import host_fits, host_seconds
from composer3d.plan.kernels import Work, step_compute
from composer3d.plan.layouts import Candidate
from composer3d.plan.memory import OPTIMIZER_STATE_BYTES, Memory, memory
from composer3d.plan.muon import MuonWork
from composer3d.plan.muon import collectives as muon_collectives
from composer3d.plan.muon import optimizer_step as muon_optimizer_step
from composer3d.plan.shapes import ModelShape, StageSet, stage_sets
from composer3d.precision.autocast import auto_cast


@dataclass(frozen=True)
class Workload:
    """What the planner reads from a training config, read once (config access is slow next to the
    arithmetic)."""

    shape: ModelShape
    seq_len: int
    global_batch_size: int
    optimizer: str
    reduce_dtype: str
    memory_headroom: float
    work: Work = Work(compiled=False, float8=False)  # torch.compile, float8 GEMMs
    published_overlap: bool = False  # plan.published_overlap
    published_ep_overlap: bool = False  # plan.published_ep_overlap
    ep_dispatch: str = "all_to_all"  # plan.ep_dispatch
    peft: Peft | None = None  # LoRA / QLoRA: what trains (peft/planning.py)
    cast: str = "auto"  # precision.cast: how one device reaches the compute dtype
    objective: str = "sft"  # train.objective
    # train.objective=dpo's reference model, a no-grad forward every micro-batch
    # (preference.reference): copy | adapters_off; None where none runs each step (sft, simpo,
    # precomputed: its one pass over the data before the first step is no step's)
    reference: str | None = None
    # optim.name=muon's settings (plan/muon.py); None under AdamW
    muon: MuonWork | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> Workload:
        return cls(
            ModelShape.from_config(cfg.model),
            cfg.train.seq_len,
            cfg.train.global_batch_size,
            cfg.optim.name,
            cfg.precision.reduce_dtype,
            cfg.plan.memory_headroom,
            Work(
                cfg.compile.enabled,
                cfg.precision.float8.enabled,
                cfg.plan.attention_kernel,
                cfg.plan.norm_kernel,
                cfg.plan.published_float8_experts,
            ),
            cfg.plan.published_overlap,
            cfg.plan.published_ep_overlap,
            cfg.plan.ep_dispatch,
            Peft.from_config(cfg.peft),
            cfg.precision.cast,
            cfg.train.objective,
            reference_each_step(cfg),
            MuonWork.from_config(cfg.optim, cfg.model),
        )

    def casts_once(self, c: Candidate, cluster: Cluster) -> bool:
        """Whether ``c`` runs on one device with precision.cast=params (``parallel.cast_once``), as
        training would resolve it there."""
        cast = (
            self.cast
            if self.cast != "auto"
            else auto_cast(
                cluster.accelerator,
                c.world_size,
                self.work.compiled,
                c.zero_stage,
                self.peft.method if self.peft else "none",
            )
        )
        # (offload=cpu runs FSDP on one rank whatever the cast, with its own resharding: not this)
        return (
            cast == "params"
            and c.world_size == 1
            and cluster.compute_bytes != 4
            and c.offload != "cpu"
        )


# What no measurement backs yet, said beside the numbers it concerns (recipes/README.md, held-out
# rows)
MOE_UNCALIBRATED = (
    "a mixture of experts' step is not calibrated by any measurement yet: on Megatron-Bridge's "
    "Qwen3-30B-A3B H100 layout (EP 16 over two nodes) the planner predicts 1.28x the published "
    "tokens/s"
)
CP_MASKED_UNMEASURED = (
    "cp_style={style} attends with SDPA under a dense mask of global token indices, not the causal "
    "kernel the ring's blocks run: that rate is not measured yet (benchmarks/attention_rate.py "
    "prints it as masked) and is priced as plan.attention_kernel's"
)

MUON_UNMEASURED = (
    "optim.name=muon's step is priced from its parts (Newton-Schulz's GEMMs at the GEMM rate over "
    "an even share of the matrices, its kernels' bytes counted from the code, its two "
    "all-to-alls), not from a measured step yet"
)


# the dimensions whose collectives a stage waits for inside each micro-batch's forward and backward
# (TP's, expert parallel's, context parallel's: every cp style's under "cp", as the estimate keys
# context.exposed_seconds): what the pipeline's ramps idle for beside compute.
# FSDP's, ZeRO-1's, Muon's and the host's are once a step, outside the ramps; a pipeline send is
# counted on its own, each on the critical path.
IN_STAGE = ("tp", "ep", "cp")


@dataclass
class Estimate:
    candidate: Candidate
    memory: Memory  # the rank with the most
    memory_per_pp_rank: list[Memory]
    collectives: list[comm.Collective]  # the busiest pipeline rank's
    collectives_per_pp_rank: list[list[comm.Collective]]
    compute_s: float
    compute_by_kind_s: dict[str, float]  # compute_s by kernel kind (plan/kernels.py's StepCompute)
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
            "layout": c.layout.as_dict(),
            "zero_stage": c.zero_stage,
            "sequence_parallel": c.sequence_parallel,
            "pp_schedule": c.pp_schedule if c.pp > 1 else None,
            "pp_stages_per_rank": c.stages_per_rank,
            "microbatches": c.microbatches,
            "micro_batch_size": c.micro_batch_size,
            "activation_checkpointing": c.activation_checkpointing,
            "offload": c.offload,
            "overrides": c.overrides(),
            "memory_bytes_per_gpu": round(self.memory.total),
            "memory_breakdown_bytes": {k: round(v) for k, v in self.memory.as_dict().items()},
            "comm_bytes_per_step": {f"{x.dim}:{x.kind}": round(x.bytes) for x in self.collectives},
            "exposed_comm_s": self.exposed_comm_s,
            "compute_s": self.compute_s,
            "compute_by_kind_s": self.compute_by_kind_s,
            "bubble_s": self.bubble_s,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "fits": self.fits,
            "notes": self.notes,
        }


def _exposed_comm(
    cols: list[comm.Collective],
    c: Candidate,
    cluster: Cluster,
    compute: float,
    layers: int,
    published_overlap: bool,
    ep_overlap: bool,
) -> dict[str, float]:
    """Seconds a rank waits for each dimension's collectives (cp's apart: plan/context.py). On the
    critical path (TP, pipeline sends, ZeRO-1's gather, Muon's all-to-alls) in full; those FSDP/DDP
    overlap share the step's compute, their excess waited for (attributed to their dimensions by
    share) plus the first block's gather, which nothing precedes; those reduced once a step hide
    behind their window only (the last micro-batch's backward). ``published_overlap``
    (plan.published_overlap): TP and pipeline traffic hide behind compute as async TP and Megatron's
    overlapped sends do, and ZeRO-1's gather (bf16 parameters, as ours) hides behind the first
    forward; ``ep_overlap`` (plan.published_ep_overlap): expert parallel's all-to-alls hide behind
    compute, as Megatron's overlap of one micro-batch's dispatch with another's compute does
    (without it they wait, as composer3d-train's)."""
    out: dict[str, float] = {}
    pool: dict[str, float] = {}
    for col in cols:
        if col.dim in context.DIMS:
            continue
        t, window, overlapped = comm.seconds(col, c, cluster), col.window, col.overlapped
        if col.dim == "ep":
            overlapped = ep_overlap
        elif published_overlap and not overlapped and col.dim != "muon":
            overlapped = True
            if col.dim == "dp" and col.kind == "all_gather":
                window = 1 / 3 / c.microbatches
        if overlapped and window < 1:
            out[col.dim] = out.get(col.dim, 0.0) + max(0.0, t - window * compute)
        elif overlapped:
            pool[col.dim] = pool.get(col.dim, 0.0) + t
        else:
            out[col.dim] = out.get(col.dim, 0.0) + t
    total = sum(pool.values())
    for dim, t in pool.items():
        # about one block's traffic, never hidden
        first_gather = t / max(1, 2 * layers) if dim != "tp" else 0.0
        out[dim] = out.get(dim, 0.0) + max(0.0, total - compute) * t / total + first_gather
    return out


@dataclass(frozen=True)
class RankMemories:
    """Each pipeline rank's stages and memory for one candidate: what decides whether it fits,
    priced before the rest of its step (a search prices the step of only those that fit). ``mems``:
    every rank's where it fits; where it does not, only the ranks that decide it
    (``rank_memories``)."""

    sets: list[StageSet]
    mems: list[Memory]
    fits: bool

    @property
    def worst(self) -> Memory:
        return max(self.mems, key=lambda m: m.total)

    @property
    def complete(self) -> bool:
        return len(self.mems) == len(self.sets)


def rank_memories(
    work: Workload, c: Candidate, cluster: Cluster, every_rank: bool = False
) -> RankMemories:
    """Whether ``c`` fits, and where it does (or ``every_rank``) each pipeline rank's memory.

    Ranks holding the same stages (layer counts, the first or last stage) differ only in the
    micro-batches in flight, which fall with the rank (plan/bubble.py), and their memory with them:
    the lowest rank of each kind holds the most, so those decide. At 8,192 GPUs of a 405B the search
    prices a million layouts, a tenth of which fit."""
    sets = stage_sets(work.shape, c.pp, c.stages_per_rank, c.pp_schedule)
    casts_once = work.casts_once(c, cluster)
    router = work.muon is not None and work.muon.router

    def price(s: StageSet) -> Memory:
        return memory(
            work.shape,
            c,
            s,
            work.seq_len,
            cluster,
            work.optimizer,
            work.peft,
            casts_once,
            work.work.compiled,
            work.reference,
            router,
        )

    lowest: dict[tuple, StageSet] = {}
    for s in sets:
        lowest.setdefault(s.kind, s)
    deciding = {s.rank: price(s) for s in lowest.values()}
    worst = max(m.total for m in deciding.values())
    mems = list(deciding.values())
    fits = worst <= cluster.memory_bytes * work.memory_headroom and host_fits(
        mems, cluster, work.memory_headroom
    )
    if fits or every_rank:
        mems = [deciding[s.rank] if s.rank in deciding else price(s) for s in sets]
    return RankMemories(sets, mems, fits)


def estimate(
    work: Workload, c: Candidate, cluster: Cluster, priced: RankMemories | None = None
) -> Estimate:
    """Predict ``c`` for the workload's model, batch and optimizer on ``cluster`` (``priced``: its
    memories, where the caller has them already)."""
    shape, seq = work.shape, work.seq_len
    cb = cluster.compute_bytes
    reduce_bytes = 4 if cb == 4 else DTYPES[work.reduce_dtype].itemsize
    if priced is None or not priced.complete:
        priced = rank_memories(work, c, cluster, every_rank=True)
    sets, mems = priced.sets, priced.mems
    reference = work.reference is not None
    # ranks that hold the same stages and move the same bytes to the host price alike: each kind
    # once (a 405B's pipeline of 16 ranks has three kinds: the first, the last, the rest)
    kinds = [(s.kind, m.optimizer, m.host_activations, m.disk) for s, m in zip(sets, mems)]
    first_of: dict[tuple, int] = {}
    for i, kind in enumerate(kinds):
        first_of.setdefault(kind, i)
    priced_ranks = sorted(first_of.values())
    cols_of = {
        i: comm.collectives(shape, c, sets[i], seq, cb, reduce_bytes, work.ep_dispatch, reference)
        + context.collectives(shape, c, sets[i], seq, cb, reference)
        + (muon_collectives(work.muon, shape, c, sets[i], work.peft, cluster) if work.muon else [])
        for i in priced_ranks
    }
    cols = [cols_of[first_of[kind]] for kind in kinds]
    tokens_per_step = work.global_batch_size * seq
    # (what AdamW steps on the device, the seconds Muon's part of the step adds)
    if work.muon is None:
        state_bytes = OPTIMIZER_STATE_BYTES[work.optimizer]
        steps = {i: (mems[i].optimizer / state_bytes, 0.0) for i in priced_ranks}
    else:  # AdamW's 8 bytes and Muon's 4 a parameter: counted apart
        steps = {
            i: muon_optimizer_step(work.muon, shape, c, sets[i], work.peft, cluster)
            for i in priced_ranks
        }
    kernels_of = {
        i: step_compute(
            shape, c, sets[i], seq // c.cp, steps[i][0], cluster, work.work, reference, steps[i][1]
        )
        for i in priced_ranks
    }
    compute = {i: k.total for i, k in kernels_of.items()}
    busiest = max(priced_ranks, key=lambda i: compute[i])
    # under PP the DPO reference runs as a forward-only pass of its own: its bubble is unfilled
    forward_only = 0.0
    if reference and c.pp > 1:
        adamw, muon_s = steps[busiest]
        s = sets[busiest]
        forward_only = compute[busiest] - (
            step_compute(shape, c, s, seq // c.cp, adamw, cluster, work.work, False, muon_s).total
        )
    exposed: dict[str, float] = {}  # per dimension, the most any pipeline rank waits for it
    waits: dict[int, float] = {}  # per kind of rank, what its stages wait for inside a micro-batch
    for i in priced_ranks:
        mine = _exposed_comm(
            cols_of[i],
            c,
            cluster,
            compute[i],
            sets[i].n_layers,
            work.published_overlap,
            work.published_ep_overlap,
        )
        if c.cp > 1:
            mine["cp"] = context.exposed_seconds(
                shape, c, sets[i], seq, cluster, work.work.attention, reference
            )
        host_exposed, host_overlapped = host_seconds(
            shape, c, sets[i], work.optimizer, cluster, mems[i], reference
        )
        # the copies over the host link hide behind compute, not the host step
        if host_exposed or host_overlapped:
            mine["host"] = host_exposed + max(0.0, host_overlapped - compute[i])
        waits[i] = sum(t for dim, t in mine.items() if dim in IN_STAGE)
        for dim, t in mine.items():
            exposed[dim] = max(exposed.get(dim, 0.0), t)
    # a pipeline's ramps idle for a stage's whole time a micro-batch: its compute and the
    # collectives it waits for inside the micro-batch's forward and backward
    bubble = bubble_seconds(c, compute[busiest] + waits[busiest], forward_only)
    step = compute[busiest] + bubble + sum(exposed.values())
    # as training counts them (training/assemble.py): the reference's forward too
    flops_per_token = shape.flops_per_token(seq) + (
        shape.forward_flops_per_token(seq) if reference else 0
    )
    world = c.world_size
    tflops = flops_per_token * tokens_per_step / world / step / 1e12
    return Estimate(
        candidate=c,
        memory=priced.worst,
        memory_per_pp_rank=mems,
        collectives=cols[busiest],
        collectives_per_pp_rank=cols,
        compute_s=compute[busiest],
        compute_by_kind_s=dataclasses.asdict(kernels_of[busiest]),
        bubble_s=bubble,
        exposed_comm_s=exposed,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_per_step / world / step,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / cluster.peak_flops if cluster.has_mfu else None,
        bubble_fraction=bubble / (compute[busiest] + waits[busiest] + bubble),
        fits=priced.fits,
        notes=_notes(shape, c, work.muon is not None)
        + ([cluster.rates.note] if cluster.rates else []),
    )


def _notes(shape: ModelShape, c: Candidate, muon_step: bool = False) -> list[str]:
    """What no measurement backs yet in this estimate, and what it leaves out."""
    notes = [MOE_UNCALIBRATED] if shape.moe else []
    if c.cp > 1 and c.cp_style in ("allgather", "ulysses"):
        notes.append(CP_MASKED_UNMEASURED.format(style=c.cp_style))
    if muon_step:
        notes.append(MUON_UNMEASURED)
    return notes
