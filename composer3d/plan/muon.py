"""optim.name=muon in the planner: what Muon's step (optim/muon.py, optim/orthogonalize.py) adds on
a rank beside AdamW's.

Which parameters: every one of two or more dims inside a block (attention and MLP matrices, shared
experts, the stacked routed experts, LoRA's adapters), the MoE router only where
``optim.muon_adamw_params`` does not name it (by default it does); AdamW steps the rest (embedding,
head, norms). Other patterns in ``optim.muon_adamw_params`` (a block's matrix left to AdamW) are not
followed: the planner prices those matrices as Muon's.

- Memory (plan/memory.py ``model_state``): one fp32 momentum per element Muon steps, 4 bytes where
  AdamW keeps 8, sharded as FSDP shards the parameter (under ZeRO-1: each rank's slices).
- Compute, in the optimizer step (plan/kernels.py): AdamW's bytes for its own elements; Muon's eager
  kernels' bytes for each local element it steps (``kernels.muon_bytes``); and Newton–Schulz, which
  runs on the whole matrix (not cut by TP, EP or FSDP) on one owner among the ranks of the
  parameter's mesh (dp × cp × tp ranks of a pipeline stage: FSDP's and HSDP's, TP's, or for the
  routed experts EP's with what it leaves of dp_shard), owners dealt so each rank does about an even
  share: this rank's time is the even share of its meshes' matrices' (``kernels.newton_schulz_s``,
  each stacked expert a matrix of its own), or the largest matrix's where one matrix is more than a
  share (a matrix has one owner).
- Communication (plan/comm.py ``muon_step``): the pieces gathered to each matrix's owner by one
  all-to-all and the result's pieces sent back to their holders by another, in the Newton–Schulz
  dtype, after the backward: on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache

from composer3d.dtypes import DTYPES
from composer3d.peft.planning import BLOCK_MODULES, Peft, split_block, split_root
from composer3d.plan import comm
from composer3d.plan.hardware import DEVICES, Cluster
from composer3d.plan.kernels import muon_bytes, newton_schulz_s
from composer3d.plan.layouts import Candidate
from composer3d.plan.memory import muon_steps, stepped
from composer3d.plan.shapes import ModelShape, StageSet, Unit
from composer3d.training.flops import PEAK_FLOPS, compute_dtype_key

# The router's parameter names Muon's rule sees (optim/muon.py's muon_parameter): the native
# model's, and Hugging Face mixtures of experts' (Qwen-MoE, OLMoE and DeepSeek's; Mixtral's;
# GPT-OSS's)
ROUTER_NAMES = {
    "native": ("layers.1.moe.gate.weight",),
    "hf": (
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.mlp.router.weight",
    ),
}


@dataclass(frozen=True)
class MuonWork:
    """optim.name=muon's settings, as the planner prices them."""

    ns_steps: int = 5  # optim.muon_ns_steps
    ns_dtype: str = "auto"  # optim.muon_ns_dtype
    nesterov: bool = True  # optim.muon_nesterov
    # Muon steps the MoE router: optim.muon_adamw_params names none of its names
    router: bool = False

    @classmethod
    def from_config(cls, optim, model) -> MuonWork | None:
        if optim.name != "muon":
            return None
        names = ROUTER_NAMES["hf" if model.name == "hf" else "native"]
        patterns = list(optim.muon_adamw_params)
        router = not any(fnmatchcase(n, p) for n in names for p in patterns)
        return cls(optim.muon_ns_steps, optim.muon_ns_dtype, optim.muon_nesterov, router)

    def ns_bytes(self, cluster: Cluster) -> int:
        """Bytes per element of the Newton–Schulz dtype (auto: bfloat16 on accelerators, float32 on
        the CPU, as optim/build.py resolves it)."""
        dtype = self.ns_dtype
        if dtype == "auto":
            dtype = "bfloat16" if cluster.accelerator else "float32"
        return DTYPES[dtype].itemsize


def ns_flops_rate(cluster: Cluster, ns_bytes: int) -> float:
    """FLOP/s of Newton–Schulz's GEMMs: the large GEMMs' fraction of the dense peak in the
    Newton–Schulz dtype — the cluster's own peak where that is the compute dtype (the common case:
    bf16 training, auto), else the device table's ratio of the two dtypes' peaks applied to it (a
    float32 matmul at torch's matmul precision: full fp32 unless TF32 is allowed)."""
    rate = cluster.peak_flops * cluster.achievable_fraction
    if ns_bytes == cluster.compute_bytes or not cluster.accelerator:
        return rate
    peaks = dict(PEAK_FLOPS)[DEVICES[cluster.device].flops_key]
    fp32 = peaks.get(compute_dtype_key("float32"), peaks["float32"])
    # the compute dtype's as cluster_from_config takes it
    compute = peaks["bfloat16"] if cluster.compute_bytes == 2 else peaks.get("tf32", fp32)
    return rate * (peaks["bfloat16"] if ns_bytes == 2 else fp32) / compute


def trainable_units(units: tuple[Unit, ...], peft: Peft | None, tp: int) -> tuple[Unit, ...]:
    """The trainable parameters of ``units`` (shapes on a rank of ``tp``) as units of their own:
    all of them, or under ``peft`` LoRA's adapters and modules_to_save (as plan/memory.py counts
    them; a MoE block's and the routed experts' stay frozen)."""
    if peft is None:
        return units
    out = []
    for u in units:
        if u.kind == "block" and len(u.params) == len(BLOCK_MODULES):
            trainable = split_block(list(u.params), peft, tp).trainable
        elif u.kind == "root":
            trainable = split_root(list(u.params), list(u.names), peft).trainable
        else:
            trainable = []
        if trainable:
            out.append(Unit(tuple(trainable), u.count, u.kind))
    return tuple(out)


@cache  # one per pipeline rank's stages, shape and settings: the search asks it again and again
def matrices(
    shape: ModelShape, stages: StageSet, peft: Peft | None, router: bool
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The whole matrices (not cut by tp, ep or FSDP) Muon orthogonalizes on this pipeline rank, per
    mesh (the blocks', the routed experts'), as (rows, cols, how many): a 2-D parameter one a layer,
    a stack of routed experts one per expert."""
    meshes: dict[str, list[tuple[int, int, int]]] = {}
    for u in trainable_units(stages.units(shape, 1, 1), peft, 1):
        for i, s in enumerate(u.params):
            if muon_steps(u, i, router):
                count = u.count * (s[0] if len(s) == 3 else 1)
                meshes.setdefault(u.kind, []).append((s[-2], s[-1], count))
    return tuple(tuple(m) for m in meshes.values())


@cache
def orthogonalize_s(
    shape: ModelShape,
    stages: StageSet,
    peft: Peft | None,
    router: bool,
    ranks: int,
    steps: int,
    ns_bytes: int,
    flops_rate: float,
    hbm_bw: float,
) -> float:
    """Seconds of Newton–Schulz on this rank: per mesh of ``ranks`` ranks, an even share of its
    matrices' time, or the largest matrix's where that is more (each matrix has one owner)."""
    total = 0.0
    for mesh in matrices(shape, stages, peft, router):
        times = [
            (newton_schulz_s(rows, cols, steps, ns_bytes, flops_rate, hbm_bw), count)
            for rows, cols, count in mesh
        ]
        total += max(sum(t * n for t, n in times) / ranks, max(t for t, _ in times))
    return total


def mesh_ranks(c: Candidate) -> int:
    """The ranks of a pipeline stage's Muon meshes: dp × cp × tp (EP's ranks are among them)."""
    return c.dp * c.cp * c.tp


def optimizer_step(
    work: MuonWork,
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    peft: Peft | None,
    cluster: Cluster,
) -> tuple[float, float]:
    """(elements this rank's AdamW steps, seconds of Muon's part of the step) on the device (Muon
    runs with no offload: training refuses it)."""
    local, mine = stepped(stages.units(shape, c.tp, c.ep), c, peft, work.router)
    ns_bytes = work.ns_bytes(cluster)
    orthogonalize = orthogonalize_s(
        shape,
        stages,
        peft,
        work.router,
        mesh_ranks(c),
        work.ns_steps,
        ns_bytes,
        ns_flops_rate(cluster, ns_bytes),
        cluster.hbm_bw,
    )
    return local - mine, mine * muon_bytes(ns_bytes, work.nesterov) / cluster.hbm_bw + orthogonalize


def collectives(
    work: MuonWork,
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    peft: Peft | None,
    cluster: Cluster,
) -> list[comm.Collective]:
    """Muon's gather and scatter on a rank of this pipeline stage set (``comm.muon_step``)."""
    return comm.muon_step(
        trainable_units(stages.units(shape, c.tp, c.ep), peft, c.tp),
        trainable_units(stages.units(shape, 1, 1), peft, 1),
        c,
        work.router,
        work.ns_bytes(cluster),
    )
