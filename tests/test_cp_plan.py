"""composer3d-plan with context parallel: Llama 3 8B at 131,072 tokens on one node of 8 H100s (the
arithmetic; the bytes and peaks of real cp runs are checked against the planner in
tests/test_plan.py's measured layouts)."""

import pytest
from planned import plan_config, planned

from composer3d.plan import Workload, candidate_from_config
from composer3d.plan.activations import cp_mask_bytes
from composer3d.plan.comm import seconds
from composer3d.plan.context import exposed_seconds
from composer3d.plan.estimate import CP_MASKED_UNMEASURED
from composer3d.plan.hardware import cluster_from_config
from composer3d.plan.search import best, checked
from composer3d.plan.shapes import stage_sets

LONG = [
    "model=llama3_8b",
    "train.seq_len=131072",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
    "cluster.nodes=1",
    "cluster.device=h100",
    "memory.activation_checkpointing=full",
]
GIB = 2**30


@pytest.fixture(scope="module")
def by_cp():
    """FSDP over the 8 GPUs as dp_shard × cp, cp 1, 2, 4, 8: the same model state, the sequence cut
    in cp."""
    return {
        cp: planned(*LONG, f"parallel.dp_shard={8 // cp}", f"parallel.cp={cp}")[0]
        for cp in (1, 2, 4, 8)
    }


def test_fsdp_shards_over_cp_and_activation_memory_falls_as_one_over_cp(by_cp):
    state = {cp: e.memory.model_state for cp, e in by_cp.items()}
    assert len({round(s) for s in state.values()}) == 1, (
        f"FSDP shards over dp_shard × cp = 8 in each: {state}"
    )
    sequence = {cp: e.memory.activations + e.memory.logits for cp, e in by_cp.items()}
    # cp 2 and 4 peak in one phase, a block's recomputation in backward: exactly as 1/cp. cp 1 and 8
    # peak at the end of forward beside the logits, which their gradient overwrites, and beside
    # those the head's weight gradient (1 GiB at any cp): within 10% of 1/cp
    assert sequence[2] / sequence[4] == pytest.approx(2, rel=1e-6), sequence
    for cp in (2, 4, 8):
        assert sequence[1] / sequence[cp] == pytest.approx(cp, rel=0.1), (cp, sequence)
    # the whole sequence on one GPU does not fit in 79 GiB × 0.9 with full checkpointing; cut in 2
    # it does
    assert not by_cp[1].fits and by_cp[1].memory.total > 0.9 * 79 * GIB
    assert all(by_cp[cp].fits for cp in (2, 4, 8))


def test_ring_bytes_are_the_hand_count(by_cp):
    """cp 4 (dp_shard 2: 4 micro-batches of 1 per rank), 32 layers, bf16: each pass carries this
    rank's K/V, 2 × 8 KV heads × 128 × 32,768 tokens × 2 bytes = 128 MiB. Per layer and micro-batch:
    3 passes forward, 3 again in full checkpointing's rerun, 3 in backward, and 4 of the fp32
    gradients (256 MiB) back to their owner."""
    kv = 2 * 8 * 128 * 32768 * 2
    assert kv == 128 * 2**20
    sends = {col.overlapped: col.bytes for col in by_cp[4].collectives if col.dim == "cp"}
    assert sends == {True: 4 * 32 * (3 + 3 + 3) * kv, False: 4 * 32 * 4 * 2 * kv}
    assert [col.kind for col in by_cp[4].collectives if col.dim == "cp"] == ["send", "send"]
    assert not any(col.dim == "cp" for col in by_cp[1].collectives)


def test_ring_passes_hide_behind_attention_at_long_context_not_at_short():
    """At 131k a K/V pass (128 MiB at 450 GB/s) takes far less than the attention of the block
    computed meanwhile, so only the gradients' passes are exposed; at 2,048 tokens over cp 8 the
    passes outlast the blocks (at 4,096 they about match them: attention runs at flash attention's
    rate, plan/kernels.py)."""
    long, cluster = planned(*LONG, "parallel.dp_shard=2", "parallel.cp=4")
    grads = 4 * 32 * 4 * (2 * 8 * 128 * 32768 * 4) / cluster.intra_node_bw
    assert long.exposed_comm_s["cp"] == pytest.approx(grads, rel=1e-9)
    short, cluster = planned(*LONG, "train.seq_len=2048", "parallel.dp_shard=1", "parallel.cp=8")
    shape = Workload.from_config(plan_config(*LONG)).shape
    exposed = exposed_seconds(
        shape, short.candidate, stage_sets(shape, 1, 1, "1f1b")[0], 2048, cluster, "sdpa"
    )
    grads = 8 * 32 * 8 * (2 * 8 * 128 * 256 * 4) / cluster.intra_node_bw
    assert exposed == short.exposed_comm_s["cp"] > grads * 1.05, (
        "the K/V passes add to the gradients' at 2,048"
    )


@pytest.mark.parametrize("style, extra", [("allgather", "all_gather"), ("ulysses", "all_to_all")])
def test_other_styles_cost_their_collectives_and_masks(by_cp, style, extra):
    """Neither is hidden behind compute: the step waits for all of their traffic."""
    e, cluster = planned(
        *LONG, "parallel.dp_shard=4", "parallel.cp=2", f"parallel.cp_style={style}"
    )
    mine = [col for col in e.collectives if col.dim == "cp"]
    assert mine and all(
        col.kind in (extra, "reduce_scatter") and not col.overlapped for col in mine
    )
    assert e.exposed_comm_s["cp"] == pytest.approx(
        sum(seconds(col, e.candidate, cluster) for col in mine)
    )
    # a boolean mask of local (all-gather: 65,536) or all (Ulysses) queries × all 131,072 keys, kept
    # by every layer's attention: more than the ring's buffers
    mask = {"allgather": 8 * GIB, "ulysses": 16 * GIB}[style]
    assert cp_mask_bytes(e.candidate, 131072) == mask
    assert e.memory.activations >= mask and e.memory.total > by_cp[2].memory.total + mask / 2


def test_the_search_chooses_context_parallel_at_131k_tokens():
    """parallel=auto's choice: the fastest layout that fits is a cp layout, faster than any without
    cp, and it passes composer3d's own checks. The all-gather of K/V (8 of 32 heads: a quarter of
    q's bytes) comes within 0.1% of the ring, at 17 GiB more a GPU: the ring, the smaller of two
    equals, is chosen. The all-gather's estimate says what it has not measured: its attention runs
    under a dense mask, priced at the causal kernel's rate."""
    cfg = plan_config(*LONG)
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
    chosen, fitting, _ = best(cfg, cluster)
    assert chosen.candidate.cp > 1 and chosen.candidate.cp_style == "ring", chosen.candidate.short()
    gathering = min(
        (e for e in fitting if e.candidate.cp_style == "allgather"), key=lambda e: e.step_time_s
    )
    assert gathering.step_time_s < chosen.step_time_s < 1.001 * gathering.step_time_s
    assert gathering.memory.total > chosen.memory.total + 10 * GIB
    assert not chosen.notes and gathering.notes == [
        CP_MASKED_UNMEASURED.format(style="allgather")
    ], gathering.notes
    without = [e for e in fitting if e.candidate.cp == 1]
    assert without and chosen.step_time_s < min(e.step_time_s for e in without)
    trial = checked(cfg, chosen.candidate, cluster.world_size)
    assert trial.parallel.cp == chosen.candidate.cp


# Llama 3 8B at 131,072 tokens on 4 nodes of 8 H100s, TP 2 + SP × cp 16: a cp group spans the 4
# nodes, 4 of its ranks on each
ACROSS_NODES = [
    *LONG,
    "cluster.nodes=4",
    "train.global_batch_size=4",
    "parallel.tp=2",
    "parallel.sequence_parallel=true",
    "parallel.cp=16",
    "parallel.dp_shard=1",
]


def test_hierarchical_cp_runs_ulysses_in_the_node_and_the_ring_across_nodes():
    """cp_ulysses=4: each Ulysses group is 4 cp ranks × tp 2 = one node, its all-to-alls over
    NVLink; the ring runs over the 4 groups, one rank a node, each pass through one GPU's NIC,
    carrying what the plain ring's does (4× the tokens, 1/4 of the heads) 3 times a layer instead of
    15; the gradients' 4 passes instead of 16. Counted by hand, and the step waits for what the
    ring's attention does not hide plus the all-to-alls."""
    e, cluster = planned(*ACROSS_NODES, "parallel.cp_style=hierarchical", "parallel.cp_ulysses=4")
    c = e.candidate
    assert c.cp_ulysses == 4 and "parallel.cp_ulysses=4" in c.overrides()
    kv = 2 * 8 * 128 * 131072 // 16 // 2 * 2  # this rank's K/V: its tokens, its tp share of heads
    # 4 micro-batches of one sequence (dp 1), 32 layers: forward, full checkpointing's rerun and
    # backward
    cols = {(col.dim, col.kind, col.overlapped): col for col in e.collectives if col.dim != "tp"}
    ring = cols[("cp_ring", "send", True)]
    assert (ring.group_size, ring.bytes) == (4, 4 * 32 * 3 * 3 * kv)
    assert cols[("cp_ring", "send", False)].bytes == 4 * 32 * 4 * 2 * kv  # fp32 gradients
    a2a = cols[("cp_a2a", "all_to_all", False)]
    q = kv // 2 * 32 // 8  # 32 query heads for 8 KV heads
    assert (a2a.group_size, a2a.bytes) == (4, 4 * 32 * 3 * (2 * q + kv))
    # the ring's sends through a NIC, the all-to-alls within a node
    assert seconds(ring, c, cluster) == pytest.approx(ring.bytes / cluster.inter_node_bw)
    assert seconds(a2a, c, cluster) == pytest.approx(a2a.bytes * 3 / 4 / cluster.intra_node_bw)
    grads = 4 * 32 * 4 * 2 * kv / cluster.inter_node_bw
    assert e.exposed_comm_s["cp"] >= grads + seconds(a2a, c, cluster)
    assert set(e.exposed_comm_s) >= {"cp"} and not {"cp_ring", "cp_a2a"} & set(e.exposed_comm_s)
    # the ring's own memory, no mask
    assert cp_mask_bytes(c, 131072) == 0


def test_hierarchical_cp_beats_the_ring_across_nodes_and_the_search_offers_it():
    """Across 4 nodes the plain ring waits for 16 gradient passes a layer through a NIC, Ulysses
    groups wider than a node all-to-all across nodes: node-sized groups (cp_ulysses · tp = 8) are
    the fastest of the styles; the search enumerates every Ulysses degree training accepts."""
    from composer3d.plan.layouts import _cp_styles

    steps = {}
    for style, ulysses in [
        ("ring", 0),
        ("hierarchical", 2),
        ("hierarchical", 4),
        ("hierarchical", 8),
    ]:
        extra = [f"parallel.cp_ulysses={ulysses}"] if ulysses else []
        e, _ = planned(*ACROSS_NODES, f"parallel.cp_style={style}", *extra)
        steps[(style, ulysses)] = e.step_time_s
    assert min(steps, key=steps.get) == ("hierarchical", 4), steps
    cfg = plan_config(*ACROSS_NODES)
    styles = _cp_styles(cfg, candidate_from_config(cfg, 32).layout, 3)
    # Ulysses over all 16 would split 4 KV heads a tp rank holds 16 ways: refused, as training does
    assert ("hierarchical", 4) in styles and ("hierarchical", 2) in styles
    assert ("ulysses", 0) not in styles and ("ring", 0) in styles
