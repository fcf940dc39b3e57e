"""composer3d-plan's mixture-of-experts step: the all-to-all across nodes, a per-node dispatch, what
hides it, and which GEMMs float8 covers (the arithmetic, checked against counts made here another
way; the bytes of real MoE runs are checked in tests/test_plan.py's measured layouts)."""

import itertools

import pytest
import torch
from planned import plan_config, planned

from composer3d.plan.comm import node_crossings

# Llama 3 8B with 64 experts of a quarter of its MLP's width, top-8: a fine-grained mixture like
# Qwen3's
MOE = [
    "model=llama3_8b",
    "model.moe.experts=64",
    "model.moe.top_k=8",
    "model.moe.expert_hidden_dim=3584",
    "model.moe.dense_layers=0",
    "train.seq_len=4096",
    "train.micro_batch_size=1",
    "cluster.device=h100",
]
EP16_TWO_NODES = [
    *MOE,
    "train.global_batch_size=32",
    "cluster.nodes=2",
    "parallel.dp_shard=16",
    "parallel.ep=16",
]


def _all_to_all(e) -> float:
    (col,) = [c for c in e.collectives if c.dim == "ep"]
    return col.bytes


def test_an_all_to_all_across_nodes_leaves_through_each_gpus_own_nic():
    """EP 16 over two nodes: each GPU sends 7/16 of its routed copies to GPUs of its node over
    NVLink and 8/16 through its one NIC, at once; the NIC's share sets the time. (A ring's count, 8
    NICs a node sharing one crossing, would have priced it 8× less.) Nothing hides it:
    composer3d-train waits for its exchanges, and plan.published_overlap (async TP, overlapped sends
    and gathers) leaves them waiting too."""
    e, cluster = planned(*EP16_TWO_NODES)
    nbytes = _all_to_all(e)
    nic, nvlink = nbytes * 8 / 16 / cluster.inter_node_bw, nbytes * 7 / 16 / cluster.intra_node_bw
    assert nic > nvlink
    assert e.exposed_comm_s["ep"] == pytest.approx(nic, rel=1e-9)
    published, _ = planned(*EP16_TWO_NODES, "plan.published_overlap=true")
    assert published.exposed_comm_s["ep"] == pytest.approx(nic, rel=1e-9)
    # Megatron's overlap of one micro-batch's all-to-alls with another's compute: behind the step's
    # compute, but about one layer's exchange (of 32 layers' forward and backward), which nothing
    # precedes
    overlapped, _ = planned(*EP16_TWO_NODES, "plan.published_ep_overlap=true")
    assert nic < overlapped.compute_s
    assert overlapped.exposed_comm_s["ep"] == pytest.approx(nic / (2 * 32), rel=1e-9)
    # one node (EP 8 of 8 GPUs): all of it over NVLink
    one_node, cluster = planned(
        *MOE,
        "train.global_batch_size=16",
        "cluster.nodes=1",
        "parallel.dp_shard=8",
        "parallel.ep=8",
    )
    assert one_node.exposed_comm_s["ep"] == pytest.approx(
        _all_to_all(one_node) * 7 / 8 / cluster.intra_node_bw
    )


@pytest.mark.parametrize("experts, top_k, nodes", [(16, 4, 2), (16, 4, 4), (12, 3, 3), (8, 1, 2)])
def test_a_per_node_dispatch_sends_a_token_once_to_each_other_node_its_experts_are_on(
    experts, top_k, nodes
):
    """node_crossings against every routing a token can have (its top_k experts of ``experts``,
    spread evenly over ``nodes`` nodes, each routing as likely): the copies a per-node dispatch
    sends off the token's node (one per other node holding any of them), over those an all-to-all
    sends (one per expert there)."""
    per_node = experts // nodes
    crossings = copies = 0
    for chosen in itertools.combinations(range(experts), top_k):  # the token lives on node 0
        remote = [e for e in chosen if e >= per_node]
        crossings += len({e // per_node for e in remote})
        copies += len(remote)
    assert node_crossings(experts, top_k, nodes) == pytest.approx(crossings / copies, rel=1e-12)


def test_a_per_node_dispatch_prices_only_the_copies_that_cross():
    """plan.ep_dispatch=per_node (DeepEP / HybridEP in published runs): 64 experts top-8 over two
    nodes, a token's 8 copies become at most one crossing; the NIC's share shrinks by that, the
    NVLink share stays, and the slower of the two is what the step waits for."""
    plain, cluster = planned(*EP16_TWO_NODES)
    per_node, _ = planned(*EP16_TWO_NODES, "plan.ep_dispatch=per_node")
    nbytes = _all_to_all(per_node)
    assert nbytes == _all_to_all(plain)  # the same tokens leave their ranks either way
    share = node_crossings(64, 8, 2)
    # nearly every token has an expert on the other node: one crossing of its 8 copies / 4
    assert 0.24 < share < 0.25
    expected = max(
        nbytes * 8 / 16 * share / cluster.inter_node_bw, nbytes * 7 / 16 / cluster.intra_node_bw
    )
    assert per_node.exposed_comm_s["ep"] == pytest.approx(expected, rel=1e-9)
    assert per_node.tokens_per_s_per_gpu > plain.tokens_per_s_per_gpu


def test_float8_prices_what_composer3d_converts_the_experts_and_head_in_bf16():
    """composer3d's float8 converts nn.Linear layers but the output head; a MoE block's stacked
    experts are parameters, not Linear layers, so they stay in bf16 (checked on the tiny MoE model
    itself). The planner's float8 step saves on the attention, router and shared experts' GEMMs
    only, unless plan.published_float8_experts (Transformer Engine's grouped GEMMs) moves the
    experts to float8 too."""
    from composer3d.config.checks import resolve_model_config
    from composer3d.models import build_model
    from composer3d.precision.float8 import convert_to_float8

    cfg = plan_config("model=tiny_moe")
    resolve_model_config(cfg.model)
    model = build_model(cfg.model)
    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    assert experts
    converted = convert_to_float8(model, "tensorwise", torch.device("cpu"), False)
    assert (
        converted and not any(".experts." in n for n in converted) and "output" not in converted
    ), converted
    from torchao.float8.float8_linear import Float8Linear

    assert not any(
        isinstance(model.get_submodule(n.rpartition(".")[0]), Float8Linear) for n in experts
    )
    assert any(isinstance(m, Float8Linear) for m in model.modules())

    one_node = [
        *MOE,
        "train.global_batch_size=8",
        "cluster.nodes=1",
        "parallel.dp_shard=8",
        "parallel.ep=8",
        "compile.enabled=true",
    ]
    bf16 = planned(*one_node)[0].compute_s
    fp8 = planned(*one_node, "precision.float8.enabled=true")[0].compute_s
    fp8_experts = planned(
        *one_node, "precision.float8.enabled=true", "plan.published_float8_experts=true"
    )[0].compute_s
    assert fp8_experts < fp8 < bf16
    # the routed experts hold most of a token's matmul weights (8 × 3 × 4096 × 3584 = 352M of 394M a
    # layer): converting them saves more than converting everything else
    assert fp8 - fp8_experts > bf16 - fp8
