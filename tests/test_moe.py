"""The mixture-of-experts layer (``models.moe``) against an independent reference written token by
token in plain PyTorch (the way Hugging Face's Mixtral and DeepSeek-V3 describe it), on one process:
routing, mixing, shared experts, the sequence-wise auxiliary loss and its gradient, capacity, and
activation checkpointing's recompute."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from composer3d.models.moe import MoE


def moe_cfg(**overrides):
    cfg = dict(
        experts=8,
        top_k=2,
        shared_experts=1,
        expert_hidden_dim=16,
        dense_layers=0,
        score_func="softmax",
        normalize_top_k=True,
        route_scale=1.0,
        aux_loss_coef=0.01,
        bias_update_rate=0.0,
        capacity_factor=0.0,
    )
    return SimpleNamespace(**{**cfg, **overrides})


def make_moe(seed=0, dim=32, **overrides):
    torch.manual_seed(seed)
    cfg = moe_cfg(**overrides)
    moe = MoE(dim, cfg.expert_hidden_dim, cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    moe.init_buffers()
    return moe


def reference_forward(moe, x, drop=None):
    """Token by token: scores, top-k (by score + bias), weights from the unbiased scores, experts as
    SwiGLUs."""
    cfg = moe.cfg
    out = torch.zeros_like(x)
    flat = x.reshape(-1, x.shape[-1])
    for t, token in enumerate(flat):
        logits = moe.gate.weight @ token
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + moe.expert_bias, cfg.top_k).indices
        weights = scores[chosen]
        if cfg.normalize_top_k:
            weights = weights / weights.sum()
        total = torch.zeros_like(token)
        for slot, (e, w) in enumerate(zip(chosen.tolist(), weights * cfg.route_scale)):
            if drop is not None and drop(t, slot, e):
                continue
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            total = total + w * (w2 @ (F.silu(w1 @ token) * (w3 @ token)))
        if moe.shared_w1 is not None:
            total = total + moe.shared_w2.weight @ (
                F.silu(moe.shared_w1.weight @ token) * (moe.shared_w3.weight @ token)
            )
        out.view(-1, x.shape[-1])[t] = total
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"score_func": "sigmoid", "route_scale": 2.5, "shared_experts": 0},
        {"top_k": 1, "normalize_top_k": False},
    ],
)
def test_moe_matches_token_by_token_reference(overrides):
    moe = make_moe(**overrides)
    x = torch.randn(3, 10, 32)
    torch.testing.assert_close(moe(x), reference_forward(moe, x), atol=1e-5, rtol=1e-5)


def test_bias_chooses_experts_but_does_not_weight_them():
    moe = make_moe(bias_update_rate=0.01)
    moe.expert_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(moe(x), reference_forward(moe, x), atol=1e-5, rtol=1e-5)
    unbiased = make_moe(bias_update_rate=0.0)
    assert not torch.allclose(moe(x), unbiased(x)), (
        "the bias should change which experts are chosen"
    )


def test_grouped_gemm_equals_the_expert_loop(monkeypatch):
    """F.grouped_mm (the CPU and Hopper path) and the per-expert loop compute the same, forward and
    backward."""
    import composer3d.models.moe as moe_module

    moe = make_moe()
    x = torch.randn(4, 16, 32)
    grouped_out = moe(x)
    grouped_out.square().sum().backward()
    grouped_grads = [p.grad.clone() for p in moe.experts.parameters()]
    moe.zero_grad()
    monkeypatch.setattr(moe_module, "grouped_mm_fits", lambda x, w: False)
    loop_out = moe(x)
    loop_out.square().sum().backward()
    torch.testing.assert_close(loop_out, grouped_out, atol=1e-6, rtol=1e-6)
    for a, b in zip(grouped_grads, moe.experts.parameters()):
        torch.testing.assert_close(b.grad, a, atol=1e-5, rtol=1e-5)


def test_sequence_aux_loss_and_its_gradient():
    """The loss is DeepSeek-V3's per sequence (1.0 when balanced) and its gradient reaches the
    router as if coef × mean over sequences had been added to the training loss."""
    moe = make_moe(shared_experts=0)
    x = torch.randn(3, 20, 32)
    coef, sequences = 0.3, 6  # as if the global batch held 6 sequences: these 3 and 3 elsewhere
    moe.aux_grad_scale = coef / sequences
    out = moe(x)
    out.sum().backward()
    attached = moe.gate.weight.grad.clone()

    by_hand = make_moe(shared_experts=0)
    main = reference_forward(by_hand, x).sum()
    logits = x @ by_hand.gate.weight.T
    scores = logits.softmax(-1)
    chosen = scores.topk(2, dim=-1).indices
    hits = torch.zeros_like(scores).scatter_(-1, chosen, 1.0)
    per_sequence = ((hits.sum(1) * 8 / (2 * 20)) * scores.mean(1)).sum(-1)
    (main + coef * per_sequence.sum() / sequences).backward()
    torch.testing.assert_close(attached, by_hand.gate.weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(moe.aux_loss_sum, per_sequence.sum().detach(), atol=1e-6, rtol=1e-6)


def test_capacity_drops_later_choices_per_sequence():
    """With a capacity factor each expert takes at most ceil(c·S·k/E) of a sequence's choices: first
    choices before second ones, earlier positions first; what it drops is left out of the mix (the
    reference skips the same)."""
    moe = make_moe(capacity_factor=0.5, shared_experts=0)
    batch, seq, k, experts = 2, 16, 2, 8
    capacity = math.ceil(0.5 * seq * k / experts)
    x = torch.randn(batch, seq, 32)
    _, chosen, _ = moe.route(x.reshape(-1, 32))
    taken = {}
    kept = set()
    for b in range(batch):
        for slot in range(k):
            for pos in range(seq):
                e = int(chosen[b * seq + pos, slot])
                if taken.get((b, e), 0) < capacity:
                    taken[(b, e)] = taken.get((b, e), 0) + 1
                    kept.add((b * seq + pos, slot))
    assert len(kept) < batch * seq * k, "the test should drop something"
    torch.testing.assert_close(
        moe(x),
        reference_forward(moe, x, drop=lambda t, slot, e: (t, slot) not in kept),
        atol=1e-5,
        rtol=1e-5,
    )


def test_routing_is_counted_once_under_activation_checkpointing():
    moe = make_moe()
    x = torch.randn(2, 8, 32, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    # tokens × top_k, not twice that from the recompute
    assert int(moe.routed_tokens.sum()) == 2 * 8 * 2
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert int(moe.routed_tokens.sum()) == 2 * 8 * 2, "evaluation forwards are not counted"


@pytest.mark.parametrize("policy", [None, "all_matmuls"], ids=["full", "selective"])
def test_compiled_checkpointed_moe_is_one_graph_and_counts_its_routing_once(policy):
    """A MoE layer compiled with its activation checkpointing inside (as compiled blocks run it),
    bf16 on the CPU (the grouped GEMM's compiled path): one graph, no break (the routing count asks
    for no autograd task while traced, and adds into its buffers in place), and over three steps
    each token's choices counted once, not again by the recomputation in backward. Asking for the
    task inside the graph broke it, and the whole checkpointed region then ran eagerly."""
    from torch._dynamo.utils import counters

    from composer3d.memory.activation_checkpointing import checkpointed_forward

    moe = make_moe()
    torch._dynamo.reset()
    counters.clear()

    @torch.compile
    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return checkpointed_forward(moe, policy, False, x)

    try:
        for _ in range(3):
            step(torch.randn(2, 8, 32, requires_grad=True)).float().sum().backward()
        assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1, (
            dict(counters)
        )
    finally:
        torch._dynamo.reset()
    assert int(moe.routed_tokens.sum()) == 3 * 2 * 8 * 2  # steps × tokens × top_k
    assert all(p.grad is not None for p in moe.experts.parameters())


def test_experts_compute_in_autocasts_dtype():
    """Where no FSDP casts the weights (one device), the experts follow autocast like the linear
    layers do."""
    moe = make_moe()
    seen = []
    moe.experts.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    x = torch.randn(2, 8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    # mixed in fp32, back in the residual's dtype
    assert seen == [torch.bfloat16] and y.dtype == torch.float32
    torch.testing.assert_close(y, moe(x), atol=0.1, rtol=0.05)


def test_hugging_face_experts_under_expert_parallel_compute_as_transformers(monkeypatch):
    """composer3d's local computation of transformers' fused experts (under expert parallel), by
    grouped GEMM and by the loop, equals transformers' own experts forward on the same routing,
    forward and backward."""
    pytest.importorskip("transformers")
    from hf_models import hf_config
    from transformers import AutoModelForCausalLM

    from composer3d.models.hf import experts as hf_experts
    from composer3d.models.hf.experts import hf_expert_modules

    torch.manual_seed(0)
    experts = hf_expert_modules(AutoModelForCausalLM.from_config(hf_config("qwen3_moe")))[0]
    tokens, k = torch.randn(24, experts.gate_up_proj.shape[-1]), 2
    chosen = torch.randn(24, experts.num_experts).topk(k, dim=-1).indices
    mixing = torch.rand(24, k)
    expected = experts(tokens, chosen, mixing)  # transformers' default implementation

    def ours():
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=experts.num_experts)
        rows = hf_experts._local_experts(experts, tokens.repeat_interleave(k, 0)[order], counts)
        out = torch.empty_like(rows).index_copy_(0, order, rows)
        return (out.view(24, k, -1) * mixing.unsqueeze(-1)).sum(1)

    assert hf_experts.grouped_mm_fits(tokens, experts.gate_up_proj), (
        "the grouped path runs on this shape"
    )
    results = {}
    for path in ("grouped", "loop"):
        if path == "loop":
            monkeypatch.setattr(hf_experts, "grouped_mm_fits", lambda x, w: False)
        experts.zero_grad()
        out = ours()
        out.square().sum().backward()
        results[path] = (
            out.detach(),
            experts.gate_up_proj.grad.clone(),
            experts.down_proj.grad.clone(),
        )
    experts.zero_grad()
    expected.square().sum().backward()
    for path, (out, gate_up_grad, down_grad) in results.items():
        torch.testing.assert_close(out, expected.detach(), atol=1e-5, rtol=1e-5, msg=path)
        torch.testing.assert_close(
            gate_up_grad, experts.gate_up_proj.grad, atol=1e-5, rtol=1e-5, msg=path
        )
        torch.testing.assert_close(
            down_grad, experts.down_proj.grad, atol=1e-5, rtol=1e-5, msg=path
        )
