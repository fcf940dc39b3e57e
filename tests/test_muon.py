"""optim.name=muon: Muon for the hidden matrices, AdamW for the rest.

In one process: which parameters each steps; two steps against an independent reference written
here in plain PyTorch (Newton–Schulz per matrix and per expert, torch's own AdamW for the rest) to
1e-6 in fp32; Newton–Schulz against the SVD's orthogonal factor; the refusals. On 4 gloo ranks, one
process group: every layout that cuts the matrices (FSDP, HSDP's replicas, FSDP × TP + SP, PP ×
FSDP, EP's stacked experts, cp × FSDP, ZeRO-1's slices, alone and under EP, LoRA's adapters)
follows the one-process curve within 1e-4 over 10 steps, each matrix orthogonalized on one rank; a
resumed run continues the curve exactly (its momentum saved and loaded by DCP), and on it under
another layout.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from harness import FAST, train_config, train_in_one_group

from composer3d.config.checks import validate
from composer3d.errors import ConfigError
from composer3d.models import build_model
from composer3d.models.init import materialize
from composer3d.models.llama.attention import apply_rope, document_mask, head_max_logits
from composer3d.optim.build import build_optimizer
from composer3d.optim.muon import Muon, muon_parameter
from composer3d.optim.orthogonalize import newton_schulz, newton_schulz_flops
from composer3d.optim.qk_clip import QKClip

CPU = torch.device("cpu")
MUON = ["optim.name=muon", "optim.warmup_steps=0", "optim.lr=0.02", "optim.weight_decay=0.1"]


def _model(*overrides):
    cfg = train_config(*FAST, *MUON, *overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    materialize(model, CPU, seed=0)
    return cfg, model


def reference_newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """One matrix, as Muon's paper writes the quintic iteration: X ← aX + b(XXᵀ)X + c(XXᵀ)²X on
    the wide orientation, from X / ‖X‖_F."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        g = x @ x.T
        x = a * x + b * (g @ x) + c * (g @ (g @ x))
    return x.T if matrix.shape[0] > matrix.shape[1] else x


class ReferenceMuon:
    """Plain PyTorch: SGD momentum with Nesterov, orthogonalized per matrix (per expert), scaled by
    0.2·√max(rows, cols), decoupled weight decay; torch.optim.AdamW for the other parameters."""

    def __init__(self, named, muon_names, lr, weight_decay, betas, eps, momentum=0.95):
        self.muon = [(n, p) for n, p in named if n in muon_names]
        other = [p for n, p in named if n not in muon_names]
        self.adamw = torch.optim.AdamW(
            [
                {"params": [p for p in other if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in other if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            eps=eps,
        )
        self.lr, self.weight_decay, self.momentum = lr, weight_decay, momentum
        self.buffers = {n: torch.zeros_like(p) for n, p in self.muon}

    @torch.no_grad()
    def step(self):
        self.adamw.step()
        for name, p in self.muon:
            buf = self.buffers[name]
            buf.copy_(self.momentum * buf + p.grad)
            u = p.grad + self.momentum * buf
            matrices = [u] if u.ndim == 2 else list(u)
            o = torch.stack([reference_newton_schulz(m) for m in matrices]).reshape(u.shape)
            rows, cols = u.shape[-2:]
            p.copy_(
                p * (1 - self.lr * self.weight_decay)
                - self.lr * 0.2 * math.sqrt(max(rows, cols)) * o
            )


def _loss(model, seed):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (2, 33), generator=generator)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_two_steps_equal_an_independent_reference(model):
    cfg, ours = _model(f"model={model}")
    _, theirs = _model(f"model={model}")
    optimizer, _ = build_optimizer(ours, cfg.optim, device=CPU)
    assert isinstance(optimizer, Muon)
    muon_names = {
        n for n, p in ours.named_parameters() if muon_parameter(n, p, ["*.gate.weight", "*router*"])
    }
    o = cfg.optim
    reference = ReferenceMuon(
        list(theirs.named_parameters()), muon_names, o.lr, o.weight_decay, tuple(o.betas), o.eps
    )
    # the second step's gradients are the first model's, given to both: the comparison is of the
    # steps (momentum included), not of a gradient through weights a rounding apart
    for seed in (1, 2):
        ours.zero_grad()
        _loss(ours, seed).backward()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            b.grad = a.grad.clone()
        optimizer.step()
        reference.step()
    worst = max(
        (a - b).abs().max().item()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    assert worst < 1e-6, worst
    # and the step moved every parameter (nothing silently skipped)
    _, initial = _model(f"model={model}")
    for (name, a), b in zip(ours.named_parameters(), initial.parameters()):
        assert not torch.equal(a, b), name


def test_the_split_muon_for_hidden_matrices_adamw_for_the_rest():
    _, dense = _model("model=tiny")
    _, moe = _model("model=tiny_moe")
    patterns = ["*.gate.weight", "*router*"]
    muon = {
        n
        for n, p in [*dense.named_parameters(), *moe.named_parameters()]
        if muon_parameter(n, p, patterns)
    }
    assert "layers.0.attention.wq.weight" in muon and "layers.0.feed_forward.w2.weight" in muon
    assert {"layers.1.moe.experts.w1", "layers.1.moe.shared_w1.weight"} <= muon
    for adamw in (
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        "layers.0.attention_norm.weight",
        "layers.1.moe.gate.weight",
    ):
        assert adamw not in muon, adamw
    # Hugging Face's names: the decoder's matrices, not the embeddings, head, norms or router
    hf = {
        "model.embed_tokens.weight": False,
        "model.layers.0.self_attn.q_proj.weight": True,
        "model.layers.0.mlp.gate_proj.weight": True,
        "model.layers.0.mlp.gate.weight": False,
        "model.layers.0.mlp.experts.gate_up_proj": True,
        "model.layers.0.input_layernorm.weight": False,
        "lm_head.weight": False,
    }
    for name, expected in hf.items():
        shape = (4,) if "layernorm" in name else (4, 4)
        assert muon_parameter(name, torch.empty(shape), patterns) == expected, name
    # overridable: the patterns name what AdamW takes
    assert not muon_parameter("layers.0.attention.wq.weight", torch.empty(4, 4), ["*.wq.*"])


def test_newton_schulz_approaches_the_svds_orthogonal_factor():
    generator = torch.Generator().manual_seed(0)
    for shape in ((64, 32), (32, 64), (48, 48)):
        g = torch.randn(shape, generator=generator)
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        o = newton_schulz(g, 5, torch.float32)
        singular = torch.linalg.svdvals(o)
        # the quintic trades exactness for speed: singular values land in about [0.7, 1.2]
        assert singular.min() > 0.6 and singular.max() < 1.25, singular
        # the same singular vectors: Oᵀ(UVᵀ) is positive definite, near the identity
        cosine = (o * (u @ vh)).sum() / (o.norm() * (u @ vh).norm())
        assert cosine > 0.98, cosine
        assert torch.allclose(o, reference_newton_schulz(g), atol=1e-5)
    # batched over stacked experts, each on its own
    stack = torch.randn(3, 16, 8, generator=generator)
    batched = newton_schulz(stack, 5, torch.float32)
    for i in range(3):
        assert torch.allclose(batched[i], reference_newton_schulz(stack[i]), atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 8])  # grouped-query (tiny's), and multi-head
def test_qk_clip_scales_the_heads_over_the_threshold_as_k2(kv_heads):
    """After the update, each head whose largest logit of the step (computed here in plain PyTorch
    from the step's inputs and weights) exceeded τ has its query rows scaled by τ/S where its key
    head is shared, its query and key rows by √(τ/S) where not; every other row is the unclipped
    run's."""
    tau = 0.1  # between the tiny model's heads' first logits
    overrides = [f"model.n_kv_heads={kv_heads}", f"optim.muon_clip_threshold={tau}"]
    cfg, clipped = _model(*overrides)
    _, plain = _model(*overrides)
    validate(cfg, 1)
    heads, head_dim = cfg.model.n_heads, cfg.model.dim // cfg.model.n_heads
    optimizer, _ = build_optimizer(clipped, cfg.optim, device=CPU)
    reference, _ = build_optimizer(plain, cfg.optim, device=CPU)
    clip = QKClip(clipped.attention_logits(), tau, CPU, None, None)
    inputs = {}
    for name, block in clipped.layers.items():
        block.attention.register_forward_pre_hook(
            lambda module, args, name=name: inputs.setdefault(name, args[:3]) and None
        )
    weights = {
        n: (b.attention.wq.weight.detach().clone(), b.attention.wk.weight.detach().clone())
        for n, b in clipped.layers.items()
    }
    for model in (clipped, plain):
        _loss(model, 1).backward()
    optimizer.step()
    clip.apply()
    reference.step()
    largest, kinds = [], set()
    for name, block in clipped.layers.items():
        x, cos, sin = (v.detach() for v in inputs[name])
        wq, wk = weights[name]
        q = apply_rope((x @ wq.T).view(*x.shape[:2], heads, head_dim), cos, sin).transpose(1, 2)
        k = apply_rope((x @ wk.T).view(*x.shape[:2], kv_heads, head_dim), cos, sin).transpose(1, 2)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        per_head = scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
        largest.append(per_head.max())
        kinds.update((per_head > tau).tolist())
        factor = torch.where(per_head > tau, tau / per_head, torch.ones_like(per_head))
        rows = lambda f: f.repeat_interleave(head_dim)[:, None]  # noqa: E731
        ours = plain.layers[name].attention
        if kv_heads < heads:
            expected_q, expected_k = ours.wq.weight * rows(factor), ours.wk.weight
        else:
            expected_q = ours.wq.weight * rows(factor.sqrt())
            expected_k = ours.wk.weight * rows(factor.sqrt())
        torch.testing.assert_close(block.attention.wq.weight, expected_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(block.attention.wk.weight, expected_k, rtol=1e-5, atol=1e-6)
    assert kinds == {True, False}  # heads clipped and heads left alike
    assert abs(float(clip.largest) - float(max(largest))) < 1e-5


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["parallel.zero_stage=1", "parallel.dp_shard=1", "parallel.tp=2"], "parallel.zero_stage"),
        (["parallel.offload=optimizer"], "parallel.offload"),
        (["parallel.offload=cpu"], "parallel.offload"),
        (["optim.muon_scale=spectral"], "optim.muon_scale"),
        (["optim.muon_ns_dtype=float16"], "optim.muon_ns_dtype"),
        (["optim.muon_momentum=1.0"], "optim.muon_momentum"),
        (["optim.implementation=fused"], "optim.implementation"),
        (["optim.muon_clip_threshold=100", "parallel.cp=2"], "optim.muon_clip_threshold"),
        (["optim.muon_clip_threshold=100", "peft=lora"], "optim.muon_clip_threshold"),
        (["optim.muon_clip_threshold=100", "optim.name=adamw"], "optim.muon_clip_threshold"),
        (["optim.muon_clip_threshold=100", "compile.enabled=true"], "optim.muon_clip_threshold"),
    ],
)
def test_what_muon_refuses_names_the_key(overrides, key):
    cfg = train_config(*FAST, *MUON, *overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 2 if {"parallel.tp=2", "parallel.cp=2"} & set(overrides) else 1)


# -- on 4 ranks ----------------------------------------------------------------------------------

STEPS = ["train.steps=10", *MUON]
CLIP = "optim.muon_clip_threshold=0.1"  # between the tiny model's heads' logits: some clipped
MOE = ["model=tiny_moe"]
LAYOUTS = {
    "fsdp4": ["parallel.dp_shard=4"],
    # replicas: each piece sent once, by one of the ranks holding it
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    # FSDP's shards of TP's shards (a 2-D mesh; the column-parallel dim cut twice)
    "fsdp2_tp2_sp": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2_fsdp2": ["parallel.pp=2", "parallel.dp_shard=2"],
    "cp2_fsdp2": ["parallel.cp=2", "parallel.dp_shard=2"],
    # stacked experts split by expert over ep and by FSDP: each expert's matrices on their own
    "ep2_fsdp2": [*MOE, "parallel.dp_shard=4", "parallel.ep=2"],
    # ZeRO-1's slices of the flattened parameters (cut across matrices): each matrix gathered
    # from them; under ep the experts' slices over the two ranks holding the same experts
    "zero1_dp4": ["parallel.dp_shard=4", "parallel.zero_stage=1"],
    "zero1_ep2_moe": [*MOE, "parallel.dp_shard=4", "parallel.ep=2", "parallel.zero_stage=1"],
    # LoRA's adapters, split with their base by TP (A or B whole on every tp rank)
    "lora_fsdp2_tp2_sp": [
        "peft=lora",
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ],
    # QK-Clip: the heads' maxima over the data-parallel ranks, gathered over tp's heads, each
    # rank scaling the rows FSDP left it
    "clip_fsdp2_tp2_sp": [
        CLIP,
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ],
}
# the one-process run each layout follows
REFERENCE = {"model=tiny_moe": "single_moe", "peft=lora": "single_lora", CLIP: "single_clip"}


# name: the layout whose step-5 checkpoint it resumes, its own layout's overrides
RESUMED = {
    "resumed_fsdp4": ("fsdp4", LAYOUTS["fsdp4"]),
    "resumed_as_fsdp2_tp2_sp": ("fsdp4", LAYOUTS["fsdp2_tp2_sp"]),
    # ZeRO-1's slices of the momentum saved whole, as FSDP's are
    "resumed_zero1_as_fsdp4": ("zero1_dp4", LAYOUTS["fsdp4"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    single = train_in_one_group(
        [
            (root / "single", [*FAST, *STEPS]),
            (root / "single_moe", [*FAST, *STEPS, *MOE]),
            (root / "single_lora", [*FAST, *STEPS, "peft=lora"]),
            (root / "single_clip", [*FAST, *STEPS, CLIP]),
        ],
        nproc=1,
    )
    saves = ["checkpoint.interval=5", "checkpoint.keep_last=0"]
    jobs = [
        (root / name, [*FAST, *STEPS, *saves, *overrides]) for name, overrides in LAYOUTS.items()
    ]
    jobs += [  # after the runs they resume (a group's jobs run one after another)
        (
            root / name,
            [
                *FAST,
                *STEPS,
                f"checkpoint.resume={root / source / 'checkpoints' / 'step-00000005'}",
                *overrides,
            ],
        )
        for name, (source, overrides) in RESUMED.items()
    ]
    return dict(zip(["single", "single_moe", "single_lora", "single_clip"], single)) | dict(
        zip([*LAYOUTS, *RESUMED], train_in_one_group(jobs, nproc=4))
    )


def test_a_resumed_run_continues_with_its_momentum(runs):
    """Steps 6-10 from the step-5 checkpoint: under the same layout the losses of the run that
    saved it, exactly (the momentum buffers and AdamW's moments loaded as they were: without them
    the curve differs at step 6); under FSDP × TP + SP, DCP re-shards them onto the other mesh and
    the curve holds."""
    saved = {m["step"]: m["loss"] for m in runs["fsdp4"].metrics}
    same = {m["step"]: m["loss"] for m in runs["resumed_fsdp4"].metrics}
    other = {m["step"]: m["loss"] for m in runs["resumed_as_fsdp2_tp2_sp"].metrics}
    assert sorted(same) == sorted(other) == [6, 7, 8, 9, 10], (same, other)
    assert all(same[s] == saved[s] for s in same), (same, saved)
    assert max(abs(other[s] - saved[s]) for s in other) < 1e-4, (other, saved)
    saved = {m["step"]: m["loss"] for m in runs["zero1_dp4"].metrics}
    resharded = {m["step"]: m["loss"] for m in runs["resumed_zero1_as_fsdp4"].metrics}
    assert sorted(resharded) == [6, 7, 8, 9, 10], resharded
    assert max(abs(resharded[s] - saved[s]) for s in resharded) < 1e-4, (resharded, saved)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_follows_one_process(layout, runs):
    reference = runs[next((r for o, r in REFERENCE.items() if o in LAYOUTS[layout]), "single")]
    losses = runs[layout].losses
    assert len(losses) == len(reference.losses) == 10
    assert reference.losses[-1] < reference.losses[0] - 0.2, reference.losses  # it learns
    worst = max(abs(a - b) for a, b in zip(losses, reference.losses))
    assert worst < 1e-4, f"{layout}: max |Δloss| {worst:.3g}\n{losses}\n{reference.losses}"
    if CLIP in LAYOUTS[layout]:  # the logits it clipped by, as one process saw them
        seen = [m["attention_logit_max"] for m in runs[layout].metrics]
        alone = [m["attention_logit_max"] for m in reference.metrics]
        assert max(abs(a - b) for a, b in zip(seen, alone)) < 1e-5, (seen, alone)
        assert max(alone) > 0.1, alone  # it clipped
        # and the clipping changed the curve
        assert max(abs(a - b) for a, b in zip(losses, runs["single"].losses)) > 1e-4


def _work(run) -> list[dict]:
    """Each rank's logged plan: matrices owned of those held, FLOPs beside the even share,
    elements sent and received a step."""
    pattern = re.compile(
        r"muon: this rank orthogonalizes (\d+) of the (\d+) matrices .*\(([\d.e+-]+) GFLOP a step; "
        r"an even share ([\d.e+-]+)\) and sends (\d+) elements a step, receives (\d+)"
    )
    work = []
    for log in sorted((run.run_dir / "logs").glob("rank*.log")):
        match = pattern.search(log.read_text())
        assert match, log
        owned, held, flops, even, sent, received = match.groups()
        work.append(
            dict(
                owned=int(owned),
                held=int(held),
                flops=float(flops),
                even=float(even),
                sent=int(sent),
                received=int(received),
            )
        )
    return work


def test_each_matrix_is_orthogonalized_once_and_each_piece_moves_once(runs):
    """The tiny model's 14 hidden matrices (every row count divisible by 4): under FSDP over 4
    ranks each owner lacks three quarters of its matrix and sends three quarters back (1.5 × the
    elements in all); under HSDP 2 × 2 it lacks one half, gets it from one of the two replicas
    holding it, and sends a half to each of the three other holders (2 ×) — not once per replica."""
    _, model = _model("model=tiny")
    sizes = [p.numel() for n, p in model.named_parameters() if muon_parameter(n, p, [])]
    assert len(sizes) == 14
    for layout, moved in (("fsdp4", 1.5), ("hsdp2x2", 2.0)):
        work = _work(runs[layout])
        assert len(work) == 4
        assert all(w["held"] == 14 for w in work), work
        assert sum(w["owned"] for w in work) == 14, work  # each matrix on exactly one rank
        assert (
            sum(w["sent"] for w in work) == sum(w["received"] for w in work) == moved * sum(sizes)
        ), (layout, work)
        # Newton–Schulz dealt by work: no rank above the even share by more than the largest
        # matrix's
        largest = newton_schulz_flops(192, 64, 5) / 1e9
        assert max(w["flops"] for w in work) <= work[0]["even"] + largest, work


@pytest.mark.parametrize("mask_kind", ["causal", "documents", "block_mask"])
def test_each_heads_largest_logit_under_the_mask(mask_kind):
    """``head_max_logits`` against every score written out: the largest q·k/√d of each head where
    the mask lets the query attend (causal; within its document, as SDPA's boolean mask or as a
    flex BlockMask's rule), grouped-query keys shared."""
    from torch.nn.attention.flex_attention import create_block_mask

    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, head_dim = 2, 4, 2, 24, 8
    q = torch.randn(batch, heads, seq, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=generator)
    documents = torch.tensor([[0] * 10 + [1] * 14, [0] * 5 + [1] * 5 + [2] * 14])
    same = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None]
    allowed = causal & same if mask_kind != "causal" else causal.expand(batch, -1, -1)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) / math.sqrt(head_dim)
    expected = scores.masked_fill(~allowed[:, None], float("-inf")).amax(dim=(0, 2, 3))
    if mask_kind == "causal":
        mask = None
    elif mask_kind == "documents":
        mask = document_mask(documents, head_dim)
    else:
        mask = create_block_mask(
            lambda b, h, i, j: (j <= i) & (documents[b, i] == documents[b, j]),
            batch,
            None,
            seq,
            seq,
            device="cpu",
        )
    torch.testing.assert_close(head_max_logits(q, k, mask), expected)
