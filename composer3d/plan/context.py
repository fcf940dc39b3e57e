"""Context parallel in the planner: what each ``parallel.cp_style`` moves between the cp ranks, how
much of it the attention compute hides, and the attention memory it adds per rank
(parallel/context/context_parallel.py, parallel/context/ring_attention.py).

Every cp rank holds ``seq_len / cp`` tokens of each sequence (head-tail chunks: the same causal work
on each), so the block's activations, its compute and the logits fall as 1/cp; FSDP shards the
parameters over dp_shard × cp. Per layer and micro-batch, with ``kv`` = 2 · kv_heads · head_dim ·
local tokens (this rank's keys and values):

- ring: forward passes ``kv`` to the next rank cp−1 times (compute dtype). Backward passes ``kv``
  round again (cp−1 times) and the fp32 key/value gradients cp times, back to their owner. Each pass
  of ``kv`` is posted before the attention of the block already held, so it hides behind that
  block's compute (a 1/cp share of the rank's attention); the gradients' pass is waited on at once:
  on the critical path.
- allgather: K/V all-gathered in forward (the whole sequence's, saved for backward: cp× the local
  K/V) and their gradients reduce-scattered in backward; one mask of local queries × all keys per
  micro-batch.
- ulysses: q, k, v all-to-all'ed to a head split over the whole sequence and the output back, in
  forward and in backward; one mask of all queries × all keys per micro-batch.
- hierarchical: Ulysses's all-to-alls over each group of u = cp_ulysses consecutive cp ranks
  (``cp_a2a``: a node's links where u·tp fit one), then the ring over the cp/u groups (``cp_ring``,
  stride u·tp: across nodes) with the same bytes a pass as the ring's (u× the tokens, 1/u the
  heads), cp/u − 1 passes and cp/u gradient passes, hidden as the ring's behind 1/(cp/u) of the
  attention each; no mask.
Full checkpointing reruns the forward's traffic, op-level selective the all-gather's (unless
memory.ac_save_gathers=true), and train.objective=dpo's reference runs the forward's once more.
None of the styles' traffic is hidden but the ring's K/V passes. The memory each style adds (the
all-gathered K/V, the ring's buffers, the masks) is plan/activations.py's (``cp_attention``,
``cp_mask_bytes``).
"""

from __future__ import annotations

from composer3d.parallel.context import RING_STYLES
from composer3d.plan.comm import Collective, regathers, seconds
from composer3d.plan.hardware import Cluster
from composer3d.plan.kernels import attention_rate
from composer3d.plan.layouts import Candidate
from composer3d.plan.shapes import ModelShape, StageSet

# the mesh dimensions cp's traffic is counted under (hierarchical's Ulysses groups and ring apart)
DIMS = ("cp", "cp_a2a", "cp_ring")


def _reruns(c: Candidate, layers: int) -> float:
    """Layers whose forward full checkpointing runs again in backward (as plan/comm.py counts
    them)."""
    return {"full": layers, "selective": layers / c.ac_every if c.ac_every else 0}.get(
        c.activation_checkpointing, 0
    )


def kv_bytes(shape: ModelShape, c: Candidate, seq_len: int, compute_bytes: int) -> float:
    """This rank's keys and values of one layer and micro-batch (what the ring passes on each
    step)."""
    return (
        c.micro_batch_size
        * seq_len
        / c.cp
        * 2
        * shape.n_kv_heads
        * shape.head_dim
        / c.tp
        * compute_bytes
    )


def _forwards(c: Candidate, layers: int, reference_forward: bool) -> float:
    """Layers' forwards a micro-batch: each once, what checkpointing reruns, the DPO reference's."""
    return layers + _reruns(c, layers) + (layers if reference_forward else 0)


def collectives(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    compute_bytes: int,
    reference_forward: bool = False,
) -> list[Collective]:
    """The cp traffic of one step on a rank of this stage set (counted as plan/comm.py counts the
    others)."""
    if c.cp == 1:
        return []
    layers = stages.dense_layers + stages.moe_layers
    forwards = _forwards(c, layers, reference_forward) * c.microbatches
    backwards = layers * c.microbatches
    kv = kv_bytes(shape, c, seq_len, compute_bytes)
    # this rank's queries (and the attention output)
    q = kv / (2 * shape.n_kv_heads) * shape.n_heads
    a2a = [Collective("cp", "all_to_all", c.cp, (forwards + backwards) * (2 * q + kv), False)]
    if c.cp_style == "ulysses":
        return a2a
    # the K/V passes hide behind attention (``exposed_seconds``), the gradients' do not
    if c.cp_style in RING_STYLES:
        dim, size = _ring(c)
        passes = [
            Collective(dim, "send", size, (forwards + backwards) * (size - 1) * kv, True),
            Collective(dim, "send", size, backwards * size * kv / compute_bytes * 4, False),
        ]
        if c.cp_style == "ring":
            return passes
        return [*passes, Collective("cp_a2a", "all_to_all", c.cp_ulysses, a2a[0].bytes, False)]
    # counted by the whole sequence's K/V: gathered, then their gradients scattered
    gathers = forwards + (backwards if regathers(c) else 0)
    return [
        Collective("cp", "all_gather", c.cp, gathers * c.cp * kv, False),
        Collective("cp", "reduce_scatter", c.cp, backwards * c.cp * kv, False),
    ]


def _ring(c: Candidate) -> tuple[str, int]:
    """The ring's dimension and size: every cp rank, or (hierarchical) one of each Ulysses
    group."""
    if c.cp_style == "hierarchical":
        return "cp_ring", c.cp // c.cp_ulysses
    return "cp", c.cp


def attention_compute_s(
    shape: ModelShape, c: Candidate, seq_len: int, cluster: Cluster, kernel: str
) -> float:
    """The forward attention (scores and weighted sum, causal: half the full matrix) of one layer
    and micro-batch on this rank, at ``kernel``'s rate (plan.attention_kernel)."""
    flops = (
        2
        * 2
        * shape.n_heads
        / c.tp
        * shape.head_dim
        * seq_len
        * seq_len
        / 2
        * c.micro_batch_size
        / c.cp
    )
    return flops / attention_rate(cluster, kernel, seq_len // c.cp)


def exposed_seconds(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    cluster: Cluster,
    kernel: str,
    reference_forward: bool = False,
) -> float:
    """Seconds a step waits for cp's traffic. The ring: each K/V pass against the attention of the
    block held meanwhile (1/cp of the layer's, twice that in backward), the gradients' passes in
    full; the other styles' collectives in full."""
    if c.cp == 1:
        return 0.0
    cb = cluster.compute_bytes
    traffic = collectives(shape, c, stages, seq_len, cb, reference_forward)
    if c.cp_style not in RING_STYLES:
        return sum(seconds(col, c, cluster) for col in traffic)
    layers = stages.dense_layers + stages.moe_layers
    dim, size = _ring(c)
    kv = Collective(dim, "send", size, kv_bytes(shape, c, seq_len, cb), False)
    pass_s = seconds(kv, c, cluster)
    # a rank's attention, 1/size of it a ring step
    block_s = attention_compute_s(shape, c, seq_len, cluster, kernel) / size
    forward = (size - 1) * max(0.0, pass_s - block_s)
    backward = (size - 1) * max(0.0, pass_s - 2 * block_s) + size * pass_s / cb * 4
    forwards = _forwards(c, layers, reference_forward)
    # hierarchical's all-to-alls, on the critical path
    a2a = sum(seconds(col, c, cluster) for col in traffic if col.kind == "all_to_all")
    return c.microbatches * (forwards * forward + layers * backward) + a2a
