"""Bytes each collective moves per optimizer step, per mesh dimension, for one pipeline rank — and
on which link.

The counts are composer3d's (measured by tests/test_plan.py around the real training step), per
micro-batch M:
  FSDP (ZeRO-3): each block all-gathered in forward and again in backward, the root (embedding,
    norm, head) once, gradients reduce-scattered once; ZeRO-2 gathers each block once. FSDP reshards
    after every micro-batch's backward, so all of it repeats M times. Under PP composer3d keeps
    stages gathered, and the pipeline syncs gradients at the last micro-batch only: one all-gather
    and one reduce-scatter a step.
  HSDP: the reduce-scatter's output is then all-reduced over dp_replicate. Replicas (DDP; ZeRO-1's
  parameters):
    gradients all-reduced per micro-batch. ZeRO-1: the updated slices all-gathered once a step, in
    the compute dtype.
  TP (DTensor): forward all-reduces after o and down projections and the vocab-parallel embedding;
    backward one all-reduce per column-parallel projection (q, k, v, gate, up: five, where Megatron
    fuses them into two) and the head's input; the vocab-parallel loss all-reduces three fp32 values
    per token.
  SP: the all-reduces become all-gather + reduce-scatter pairs (4 of each per layer and step
    direction pair). Op-level selective checkpointing gathers each block's two inputs again in
    backward, unless memory.ac_save_gathers=true (memory/activation_checkpointing.py).
  MoE layers under TP: one reduction of the experts' partial outputs in forward (an all-gather of
    the input and a reduce-scatter of the output under SP, the reduce-scatter's all-gather in
    backward), and in backward one all-reduce of the gradients into the tokens and their mixing
    weights, where a dense MLP has one per column-parallel projection. Under SP the norms' weight
    gradients are all-reduced too.
  EP: per MoE layer the routed token copies go to their experts' ranks and back, forward and
    backward (all-to-all). Routed experts are FSDP units of their own over what ep leaves of
    dp_shard (``expert_dp``). Across nodes an all-to-all's share for other nodes leaves through each
    GPU's own NIC (``seconds``); a dispatch that sends a token once per node
    (plan.ep_dispatch=per_node, DeepEP/HybridEP's) moves less of it there.
  PP: each stage sends its activations forward and its input gradients back, per micro-batch. CP
  (plan/context.py): FSDP's group is dp_shard × cp; TP, EP and PP move the seq_len / cp tokens a
  rank holds.
  The DPO reference model (train.objective=dpo): its forward, every micro-batch, gathers each block
  once more where blocks reshard after forward (ZeRO-3) and runs TP's forward collectives again;
  what it leaves gathered (its root; under ZeRO-2 its blocks) is gathered once a run.
  Muon (optim.name=muon, plan/muon.py): after the backward, once a step, each matrix's distinct
  pieces gathered to its owner and each holder's piece of the result sent back, two all-to-alls
  over a pipeline stage's dp × cp × tp ranks (``muon_step``).
An all-gather is counted by the tensor it produces, a reduce-scatter by the one it consumes, an
all-reduce, a send and an all-to-all by their tensor. Gathered parameters travel in the compute
dtype, gradients in precision.reduce_dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate
from composer3d.plan.memory import (
    fsdp_shards,
    muon_steps,
    shard_degree,
    shard_numel,
    whole,
    zero1_degree,
)
from composer3d.plan.shapes import ModelShape, StageSet, Unit

# plan.ep_dispatch: every routed copy sent to its expert's rank (composer3d-train), or a token once
# per node
EP_DISPATCH = ("all_to_all", "per_node")


@dataclass(frozen=True)
class Collective:
    # mesh dimension: dp_shard (FSDP: dp_shard × cp), dp_replicate, dp (ZeRO-1 and DDP over all
    # data-parallel ranks), expert_dp (routed experts' FSDP), tp, pp, ep, cp; muon
    # (optim.name=muon's all-to-alls over a pipeline stage's dp × cp × tp ranks)
    dim: str
    kind: str  # all_gather, reduce_scatter, all_reduce, send, all_to_all
    group_size: int
    bytes: float  # per step on this rank
    # hidden behind compute where there is enough of it (FSDP, DDP), or on the critical path
    overlapped: bool
    # the share of the step's compute it can hide behind: the last micro-batch's backward for
    # gradients reduced once a step (ZeRO-1's buckets, FSDP under PP), all of it for what repeats
    # every micro-batch
    window: float = 1.0
    # an all-to-all of routed tokens that crosses to each other node once per token
    # (plan.ep_dispatch=per_node): the routing (experts, top_k) that sets how many nodes a token's
    # copies reach
    per_node: tuple[int, int] | None = None
    # an all-to-all whose tensor holds the rank's own share too (1/n of it stays: EP's), or only
    # what it sends the others (Muon's)
    own_share: bool = True


@cache  # the search prices the same units at the same degrees over and over
def _gathered(unit: Unit, n: int) -> int:
    """Elements an FSDP all-gather of one copy of ``unit`` produces: each parameter padded to a
    multiple of n rows."""
    return sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in unit.params)


def data_parallel(
    units: list[Unit],
    c: Candidate,
    compute_bytes: int,
    reduce_bytes: int,
    reference_forward: bool = False,
) -> list[Collective]:
    m = 1 if c.pp > 1 else c.microbatches  # the pipeline syncs gradients once a step
    # ... during its last micro-batch's backward
    window = 2 / 3 / c.microbatches if c.pp > 1 else 1.0
    out = []
    if fsdp_shards(c):
        reshard = c.zero_stage == 3 and c.pp == 1
        if c.reshard_after_forward != "default":
            reshard = c.reshard_after_forward == "always"
        # A block resharded after forward is gathered for each forward and for backward, and once
        # more for the DPO reference's forward (the frozen copy's blocks, or under adapters_off the
        # policy's own). Roots (and ZeRO-2's blocks) are resharded in backward only: the copy's
        # stay gathered from its first forward on (memory.py), the policy's from its no-grad
        # forward to its backward (one gather a micro-batch, as without a reference).
        block_gathers = (3 if reference_forward else 2) if reshard else 1
        # Routed experts are an FSDP group of their own under ep (over what it leaves of dp_shard).
        groups = (
            (("dp_shard", ("block", "root", "experts")),)
            if c.ep == 1
            else (("dp_shard", ("block", "root")), ("expert_dp", ("experts",)))
        )
        for dim, kind in groups:
            mine = [u for u in units if u.kind in kind]
            if not mine:
                continue
            n = shard_degree(c, mine[0])
            grads = sum(u.count * _gathered(u, shard_degree(c, u)) for u in mine)
            gathers = sum(
                u.count
                * _gathered(u, shard_degree(c, u))
                * (block_gathers if u.kind != "root" else 1)
                for u in mine
            )
            # experts held by one rank of dp_shard (ep = dp_shard): nothing to gather or scatter
            if n > 1:
                out.append(Collective(dim, "all_gather", n, m * gathers * compute_bytes, True))
                out.append(
                    Collective(dim, "reduce_scatter", n, m * grads * reduce_bytes, True, window)
                )
            if c.dp_replicate > 1:
                out.append(
                    Collective(
                        "dp_replicate",
                        "all_reduce",
                        c.dp_replicate,
                        m * grads / n * reduce_bytes,
                        True,
                        window,
                    )
                )
        return out
    if c.zero_stage == 1:
        # the gradients reduce-scattered in buckets once a step, as the backward completes each; the
        # parameters all-gathered in the compute dtype after the optimizer step (the buckets'
        # padding: under dp elements each); under ep the routed experts' over the ranks holding the
        # same ones, in buckets of their own
        groups = (
            ("dp", [u for u in units if u.kind != "experts"]),
            ("expert_dp", [u for u in units if u.kind == "experts"]),
        )
        for dim, mine in groups:
            n = zero1_degree(c, mine[0]) if mine else 1
            if n > 1:
                out.append(
                    Collective(
                        dim,
                        "reduce_scatter",
                        n,
                        whole(mine) * reduce_bytes,
                        True,
                        2 / 3 / c.microbatches,
                    )
                )
                out.append(Collective(dim, "all_gather", n, whole(mine) * compute_bytes, False))
    elif c.dp > 1:
        out.append(
            Collective(
                "dp_replicate", "all_reduce", c.dp_replicate, m * whole(units) * reduce_bytes, True
            )
        )
    return out


def muon_step(
    units: tuple[Unit, ...],
    whole_units: tuple[Unit, ...],
    c: Candidate,
    router: bool,
    ns_bytes: int,
) -> list[Collective]:
    """optim.name=muon's two all-to-alls (optim/orthogonalize.py), in the Newton–Schulz dtype, over
    the n = dp × cp × tp ranks of a pipeline stage's meshes (``units``: the rank's trainable ones,
    ``whole_units`` the same before tp cuts them). Each matrix has one owner (owners dealt evenly by
    work): its distinct pieces (each held by ``r`` replicas: dp_replicate, times tp for a parameter
    TP does not split, the router and some of LoRA's adapters) gather to it, each sent once, by one
    holder, the owner's own not at all; then every other holder receives its piece of the result.
    Counted by the tensor each rank sends (its own share not in it), gather and scatter together,
    on the critical path (the optimizer step, after the backward).

    Where every rank holds a piece of each matrix (the blocks' matrices under FSDP, HSDP, DDP, TP),
    a rank sends, for each of its local elements Muon steps, 1/r − 1/n in the gather and 1 − 1/n in
    the scatter, whichever rank owns it — as optim/orthogonalize.py's dealing does exactly. A routed
    expert is whole on the ranks of its ep slot (FSDP cuts the stack by expert), and the dealing
    gives it to one of them unless its load is a matrix ahead: a rank keeps two of each run of a
    parameter's experts it holds (ties go to the holder; after two it is ahead) and the rest,
    1−2/run of them, go elsewhere, whole, and come back whole; at most what an owner anywhere would
    send. Against the dealing itself on synthetic expert meshes (ep > 1, a rank's mean): exact for
    runs of one or two; for longer runs on 4 to 32 ranks from 0.63× (runs of 3 on 32 ranks) to 1.33×
    what it sends, within 10% from runs of 6 on 8 ranks or more; on 2 ranks, where the other rank
    holds the rest, an overstatement (up to the whole). Under ep = 1 the experts share the blocks'
    mesh and dealing, and some travel even in runs of two (tiny_moe on 4 ranks: 8% of them). Under
    ZeRO-1 each rank holds a flat slice of each parameter, none replicated, among the ranks its
    slices are cut over."""
    n = c.dp * c.cp * c.tp
    if n == 1:
        return []
    zero1 = c.zero_stage == 1 and c.dp * c.cp > 1
    elements = 0.0
    for u, whole_unit in zip(units, whole_units):
        degree = shard_degree(c, u) if fsdp_shards(c) else 1
        for i, (s, s_whole) in enumerate(zip(u.params, whole_unit.params)):
            if not muon_steps(u, i, router):
                continue
            if zero1:
                slices = zero1_degree(c, u)
                elements += 2 * u.count * math.prod(s) / slices * (1 - 1 / slices)
                continue
            local = u.count * shard_numel(s, degree)
            replicas = c.dp_replicate * (c.tp if s[-2:] == s_whole[-2:] else 1)
            anywhere = local * (1 / replicas - 1 / n) + local * (1 - 1 / n)
            if u.kind != "experts":
                elements += anywhere
                continue
            holders = c.tp * c.dp_replicate  # of each expert: its tp pieces' replicas
            kept = local * (1 / replicas - 1 / holders) + local * (1 - 1 / holders)
            away = max(0.0, 1 - 2 / math.ceil(s[0] / degree))
            elements += min(anywhere, (1 - away) * kept + away * (local / replicas + local))
    return [Collective("muon", "all_to_all", n, elements * ns_bytes, False, own_share=False)]


def regathers(c: Candidate) -> bool:
    """Whether op-level selective checkpointing gathers each block's all-gathered inputs again in
    backward."""
    return c.activation_checkpointing == "selective" and c.ac_every == 0 and not c.ac_save_gathers


def tensor_parallel(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    compute_bytes: int,
    reference_forward: bool = False,
) -> list[Collective]:
    if c.tp == 1:
        return []
    tokens = c.micro_batch_size * seq_len * c.microbatches  # per step
    act = tokens * shape.dim * compute_bytes  # one residual tensor, per step
    dense, moe, first, last = (
        stages.dense_layers,
        stages.moe_layers,
        int(stages.first),
        int(stages.last),
    )
    loss = 3 * tokens * 4 * last
    # A MoE layer reduces its experts' partial outputs once in forward; backward sums the gradients
    # into the tokens (and their fp32 mixing weights) over TP once, where a dense MLP has its up and
    # gate projections'.
    mixing = moe * tokens * shape.moe.top_k * 4 if moe else 0
    # Full checkpointing reruns a block's forward collectives up to the last one backward needs
    # (torch stops the recomputation there): the gathers and the attention's reduce-scatter /
    # all-reduce, not the MLP's.
    layers = dense + moe
    rerun = {"full": layers, "selective": layers / c.ac_every if c.ac_every else 0}.get(
        c.activation_checkpointing, 0
    )
    # The DPO reference's forward runs the forward's collectives once more: two reductions a layer
    # (attention's output and the MLP's), the embedding's, the loss's (its log-probabilities: the
    # same vocab-parallel kernel); under SP each layer's two gathers and the head's input's.
    ref = 1 if reference_forward else 0
    if c.sequence_parallel:
        # The norms' weight gradients are partial sums over the sequence shards: all-reduced per
        # micro-batch.
        norms = (2 * layers + last) * shape.dim * compute_bytes * c.microbatches
        # op-level selective: the block's gathers, not its reductions
        regathered = layers if regathers(c) else 0
        return [
            Collective(
                "tp",
                "all_gather",
                c.tp,
                (4 * layers + 2 * (rerun + regathered) + first + last + ref * (2 * layers + last))
                * act,
                False,
            ),
            Collective(
                "tp",
                "reduce_scatter",
                c.tp,
                (4 * dense + 3 * moe + rerun + first + last + ref * (2 * layers + first)) * act,
                False,
            ),
            Collective(
                "tp", "all_reduce", c.tp, moe * act + mixing + norms + (1 + ref) * loss, False
            ),
        ]
    return [
        Collective(
            "tp",
            "all_reduce",
            c.tp,
            (7 * dense + 6 * moe + rerun + first + last + ref * (2 * layers + first)) * act
            + mixing
            + (1 + ref) * loss,
            False,
        )
    ]


def expert_parallel(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    compute_bytes: int,
    dispatch: str = "all_to_all",
    reference_forward: bool = False,
) -> list[Collective]:
    """Each MoE layer sends every routed copy of its tokens to the rank holding its expert and back
    (two all-to-alls in forward, two in backward, after one of the per-expert counts); full
    checkpointing reruns forward's, and so does the DPO reference's forward. A rank's share depends
    on the routing: the group's mean is exact."""
    if c.ep == 1 or not stages.moe_layers:
        return []
    rows = c.micro_batch_size * seq_len * shape.moe.top_k * c.microbatches  # per step
    layers = stages.moe_layers
    rerun = {"full": layers, "selective": layers / c.ac_every if c.ac_every else 0}.get(
        c.activation_checkpointing, 0
    ) + (layers if reference_forward else 0)
    counts = shape.moe.experts * 8 * c.microbatches  # int64
    nbytes = (4 * layers + 2 * rerun) * rows * shape.dim * compute_bytes + (layers + rerun) * counts
    routing = (shape.moe.experts, shape.moe.top_k) if dispatch == "per_node" else None
    return [Collective("ep", "all_to_all", c.ep, nbytes, False, per_node=routing)]


def pipeline(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    compute_bytes: int,
    reference_forward: bool = False,
) -> list[Collective]:
    """Each stage's output forward and its input's gradient back, a micro-batch; the DPO
    reference's forward-only pass sends the outputs once more."""
    if c.pp == 1:
        return []
    act = (
        c.micro_batch_size
        * seq_len
        * shape.dim
        * compute_bytes
        / (c.tp if c.sequence_parallel else 1)
    )
    forward = len(stages.layers) - int(stages.last)
    backward = len(stages.layers) - int(stages.first)
    sends = c.microbatches * ((2 if reference_forward else 1) * forward + backward)
    out = [Collective("pp", "send", c.pp, sends * act, False)]
    if shape.tied and stages.first != stages.last:
        # A tied embedding and its twin head (parallel.tied): their fp32 gradient shards summed once
        # a step.
        head = (math.ceil(shape.vocab / c.tp), shape.dim)
        out.append(
            Collective(
                "pp",
                "all_reduce",
                2,
                shard_numel(head, c.dp_shard * c.cp if fsdp_shards(c) else 1) * 4,
                False,
            )
        )
    return out


def collectives(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    compute_bytes: int,
    reduce_bytes: int,
    ep_dispatch: str = "all_to_all",
    reference_forward: bool = False,
) -> list[Collective]:
    """Every collective of one step on a rank of this pipeline stage set but context parallel's
    (plan/context.py); ``ep_dispatch``: plan.ep_dispatch; ``reference_forward``:
    train.objective=dpo's reference model runs a forward every micro-batch (its gathers, TP's
    forward collectives, its experts' all-to-alls and the pipeline's sends; its cp passes are
    plan/context.py's)."""
    held = seq_len // c.cp  # this rank's tokens of each sequence
    units = stages.units(shape, c.tp, c.ep)
    return (
        data_parallel(units, c, compute_bytes, reduce_bytes, reference_forward)
        + tensor_parallel(shape, c, stages, held, compute_bytes, reference_forward)
        + expert_parallel(shape, c, stages, held, compute_bytes, ep_dispatch, reference_forward)
        + pipeline(shape, c, stages, held, compute_bytes, reference_forward)
    )


def _stride(c: Candidate, dim: str) -> int:
    """Distance in ranks between neighbours of ``dim`` (mesh order pp, dp_replicate,
    dp_shard_mod_ep, ep, cp, tp; routed experts are sharded over dp_shard_mod_ep). Only the asked
    product is computed: the search calls this some 20 times for each of tens of thousands of
    layouts."""
    layout = c.layout
    if dim in ("tp", "muon"):  # muon: a stage's dp × cp × tp ranks, consecutive
        return 1
    if dim in ("cp", "dp_shard", "cp_a2a"):  # cp_a2a: hierarchical cp's Ulysses groups
        return layout.tp
    if dim == "cp_ring":  # hierarchical cp's ring: one rank of each Ulysses group
        return layout.tp * c.cp_ulysses
    if dim in ("ep", "dp"):
        return layout.tp * layout.cp
    if dim == "expert_dp":
        return layout.tp * layout.cp * layout.ep
    if dim == "dp_replicate":
        return layout.tp * layout.cp * layout.dp_shard
    if dim == "pp":
        return layout.tp * layout.cp * layout.dp
    raise KeyError(dim)


def members_on_node(c: Candidate, dim: str, group_size: int, cluster: Cluster) -> int:
    """How many members of a ``dim`` group share a node."""
    stride = _stride(c, dim)
    if stride * group_size <= cluster.gpus_per_node:
        return group_size
    return max(1, min(group_size, cluster.gpus_per_node // stride))


def link_bandwidth(c: Candidate, dim: str, group_size: int, cluster: Cluster) -> float:
    """Per-GPU bandwidth of a group of ``dim``: NVLink within a node; across nodes, each ring
    crosses a node's boundary once, and NCCL runs a ring (channel) per NIC, so the k members a node
    holds share its traffic over k NICs: k times a GPU's share of the network, at most NVLink's."""
    members = members_on_node(c, dim, group_size, cluster)
    if members == group_size:
        return cluster.intra_node_bw
    return min(cluster.intra_node_bw, members * cluster.inter_node_bw)


def send_bandwidth(c: Candidate, dim: str, group_size: int, cluster: Cluster) -> float:
    """A send to the next member of a ``dim`` group (pipeline stages, the cp ring), every member
    sending at once: over NVLink where the group is within a node, else the members at a node's
    boundary send through their own NIC — one GPU's share of the network, which the step waits for
    (a point-to-point send takes one path, not a collective's ring per NIC)."""
    if members_on_node(c, dim, group_size, cluster) == group_size:
        return cluster.intra_node_bw
    return min(cluster.intra_node_bw, cluster.inter_node_bw)


def node_crossings(experts: int, top_k: int, nodes: int) -> float:
    """Of a token's ``top_k`` routed copies, the share a per-node dispatch sends to other nodes: one
    per other node holding any of its experts (``nodes`` of a group, experts spread evenly, routing
    balanced as the published runs force it), against the copies an all-to-all sends there, top_k ·
    (nodes − 1) / nodes."""
    on_node = experts // nodes
    none_there = math.comb(experts - on_node, top_k) / math.comb(experts, top_k)
    return nodes * (1 - none_there) / top_k


def _all_to_all_seconds(col: Collective, c: Candidate, cluster: Cluster) -> float:
    """Each member sends every other its own share, 1/n of its tensor (1/(n − 1) of one that holds
    no share of its own, Muon's): the members on its node over NVLink, the others through its own
    NIC, both at once. No ring crosses a node once for the group:
    what leaves a node is what its GPUs send to other nodes (a per-node dispatch, fewer of the same
    tokens)."""
    n = col.group_size
    k = members_on_node(c, col.dim, n, cluster)
    others = n if col.own_share else n - 1  # the shares the tensor is cut in
    local = col.bytes * (k - 1) / others / cluster.intra_node_bw
    remote = col.bytes * (n - k) / others
    if col.per_node and k < n:
        remote *= node_crossings(*col.per_node, n // k)
    return max(local, remote / cluster.inter_node_bw)


def seconds(col: Collective, c: Candidate, cluster: Cluster) -> float:
    """Ring algorithms: an all-gather or reduce-scatter moves (n−1)/n of the full tensor through
    each GPU's link, an all-reduce twice that; a send its tensor once (``send_bandwidth``); an
    all-to-all as ``_all_to_all_seconds`` says."""
    if col.kind == "all_to_all":
        return _all_to_all_seconds(col, c, cluster)
    n = col.group_size
    if col.kind == "send":
        return col.bytes / send_bandwidth(c, col.dim, n, cluster)
    bw = link_bandwidth(c, col.dim, n, cluster)
    factor = 2 if col.kind == "all_reduce" else 1
    return factor * col.bytes * (n - 1) / n / bw
