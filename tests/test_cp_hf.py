"""Context parallel for Hugging Face models (model=hf): transformers' attention modules call
composer3d's attention through transformers' attention interface, over the cp ranks' shares of the
sequence.

Checked against transformers itself: tiny random Llama and Qwen3 under cp 2 give, at the tokens each
rank holds, transformers' own logits (fp32, 1e-5) in every cp style, causal and with packed
documents (transformers run on each document alone), ring attention also under the placement
balanced by the documents (parallel.cp_balance), and so do the other families cp accepts (Qwen2,
Phi-3, StableLM, four MoE, and Granite with its own attention scale) in ring attention. model=hf
trains under cp 2 and (``-m slow``) cp 2 × FSDP 2, its parameters sharded over all 4 ranks, on the
one-process curve within 1e-4 with document masking on a corpus of short documents (where the masks
change the curve). What the interface cannot compute is refused before launch
(tests/test_config_errors.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from harness import FAST, spawn, train_in_one_group
from hf_models import make_model
from test_context_parallel import corpus  # noqa: F401 — the fixture: short documents, so masks cut the cp chunks
from test_hf_models import SEQ, _tokens, train_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
STYLES = ("ring", "allgather", "ulysses")
# (architecture, cp styles): Llama and Qwen3 in every style; the other families context parallel
# accepts in ring attention (the styles differ only behind ContextParallel.attend, which the native
# tests check in each)
CASES = {
    "llama": STYLES,
    "qwen3": STYLES,
    # sliding windows (24 keys, over 3 of head-tail's 8-token chunks): every layer's (Mistral), and
    # Gemma 3's mix of windowed and full layers with their own rotary bases
    "mistral": STYLES,
    "gemma3_text": ("ring",),
    **{
        arch: ("ring",)
        for arch in (
            "qwen2",
            "phi3",
            "stablelm",
            "qwen3_moe",
            "mixtral",
            "qwen2_moe",
            "olmoe",
            "granite",
        )
    },
}
# Granite scales its attention scores by attention_multiplier, not head_dim**-0.5 (folded into the
# queries)
OVERRIDES = {
    "granite": {
        "attention_multiplier": 0.3,
        "embedding_multiplier": 2.0,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.5,
    }
}
# two packed documents a row, restarting at different places
DOCUMENTS = [(11, SEQ - 11), (20, SEQ - 20)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_hf")
    # the tokenizer only where a run reads text with it
    return {
        arch: make_model(
            root / arch,
            arch,
            seed=i,
            tokenizer=arch in ("llama", "mistral"),
            **OVERRIDES.get(arch, {}),
        )
        for i, arch in enumerate(CASES)
    }


def _positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


@pytest.fixture(scope="module")
def references(models):
    """transformers' logits of each row whole (causal) and of each of its documents alone
    (packed)."""
    from transformers import AutoModelForCausalLM

    tokens, refs = _tokens(), {}
    for arch, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            packed = torch.stack(
                [
                    torch.cat([model(part[None]).logits[0] for part in row.split(lengths)])
                    for row, lengths in zip(tokens, DOCUMENTS)
                ]
            )
            refs[arch] = {"causal": model(tokens).logits, "documents": packed}
    return refs


def _check_forward_under_cp(rank, world_size, models, references):
    from composer3d.config.checks import validate
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.assemble import build_parallel_model

    tokens, errors = _tokens(), {}
    for arch, path in models.items():
        # Llama and Qwen3 in ring attention also with the placement balanced by the documents
        # (parallel.cp_balance)
        cases = [(style, "head_tail") for style in CASES[arch]] + [("ring", "documents")] * (
            arch in ("llama", "qwen3")
        )
        for style, balance in cases:
            cfg = train_config(path, dp_shard=1, cp=2, cp_style=style, cp_balance=balance)
            mesh = ParallelMesh(validate(cfg, world_size), "cpu")
            model = build_parallel_model(cfg, mesh, torch.device("cpu")).model.eval()
            # every attention module calls composer3d's function through transformers' interface
            assert model.config._attn_implementation == "composer3d_context_parallel"
            # the model's own: each batch placed on it, as the trainer does
            context = model.context_parallel
            for kind, positions in (("causal", None), ("documents", _positions())):
                context.place(positions, SEQ)
                # balanced: 16 chunks of 2 tokens (head-tail holds 2 of 8)
                assert context.placement(SEQ).chunk == (
                    2 if balance == "documents" and positions is not None else 8
                )
                with torch.no_grad():
                    got = model(context.shard(tokens), position_ids=context.shard(positions))
                # this rank computes only its tokens
                assert got.shape == (2, SEQ // 2, 512), got.shape
                expected = context.shard(references[arch][kind])
                errors[(arch, style, balance, kind)] = (got - expected).abs().max().item()
    bad = {key: error for key, error in errors.items() if not error < 1e-5}
    assert not bad, f"rank {rank}: max |Δlogits| against transformers {bad}"


def test_forward_under_cp_matches_transformers(models, references, tmp_path):
    spawn(_check_forward_under_cp, 2, tmp_path, models, references)


# Four ranks: model=hf's cp composed with tensor (+ sequence) parallel, and sliding windows under
# cp × FSDP: (architecture, cp style) per layout
FOUR_RANKS = {
    "cp2_tp2_sp": (
        {"dp_shard": 1, "cp": 2, "tp": 2, "sequence_parallel": True},
        [("llama", "ring"), ("qwen3", "ring"), ("qwen3", "allgather"), ("mistral", "ring")],
    ),
    "cp2_fsdp2": (
        {"dp_shard": 2, "cp": 2},
        [("mistral", "ring"), ("mistral", "allgather"), ("gemma3_text", "ring")],
    ),
}


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor):
    """The summed next-token cross-entropy at the global positions ``index`` of ``logits``' tokens
    (the last position has no target), and the count of targets."""
    has_target = index < tokens.shape[1] - 1
    targets = tokens[:, (index + 1).clamp(max=tokens.shape[1] - 1)]
    losses = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none"
    ).view(targets.shape)
    return (losses * has_target).sum(), has_target.sum() * tokens.shape[0]


def _check_four_ranks(rank, world_size, models, references):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer3d.config.checks import validate
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.assemble import build_parallel_model

    tokens, errors = _tokens(), {}
    for layout, (parallel, cases) in FOUR_RANKS.items():
        for arch, style in cases:
            cfg = train_config(models[arch], cp_style=style, **parallel)
            mesh = ParallelMesh(validate(cfg, world_size), "cpu")
            model = build_parallel_model(cfg, mesh, torch.device("cpu")).model.eval()
            # the attention's projections split by head over tp (and sharded by FSDP over cp)
            query = model.model.layers["0"].self_attn.q_proj.weight
            assert isinstance(query, DTensor) and ("tp" in query.device_mesh.mesh_dim_names) == (
                "tp" in parallel
            ), query.device_mesh
            context = model.context_parallel
            for kind, positions in (("causal", None), ("documents", _positions())):
                context.place(positions, SEQ)
                with torch.no_grad():
                    got = model(context.shard(tokens), position_ids=context.shard(positions))
                if isinstance(got, DTensor):  # the head's vocab shards under tp
                    got = got.full_tensor()
                assert got.shape == (2, SEQ // 2, 512), got.shape
                errors[(layout, arch, style, kind, "logits")] = (
                    (got - context.shard(references[arch][kind])).abs().max().item()
                )
                # the loss over the whole sequence, each cp rank's targets summed over the group
                total, count = _next_token_loss(got, tokens, context.token_index(SEQ, got.device))
                summed = torch.stack([total, count.float()])
                dist.all_reduce(summed, group=context.group)
                whole, whole_count = _next_token_loss(
                    references[arch][kind], tokens, torch.arange(SEQ)
                )
                assert summed[1] == whole_count
                errors[(layout, arch, style, kind, "loss")] = abs(
                    (summed[0] / summed[1] - whole / whole_count).item()
                )
    bad = {key: error for key, error in errors.items() if not error < 1e-5}
    assert not bad, f"rank {rank}: against transformers {bad}"
    assert len(errors) == 2 * 2 * sum(len(cases) for _, cases in FOUR_RANKS.values())


def test_cp_composes_with_tp_and_windows_with_fsdp_matching_transformers(
    models, references, tmp_path
):
    """4 ranks: Llama, Qwen3 (ring and all-gather) and Mistral under cp 2 × TP 2 + SP, and the
    sliding-window models (Mistral in ring and all-gather, Gemma 3's windowed and full layers) under
    cp 2 × FSDP 2 give transformers' logits at every rank's tokens and its loss over the sequence
    (1e-5), causal and with packed documents."""
    spawn(_check_four_ranks, 4, tmp_path, models, references)


# -------------------------------------------------------------------------------------- loss parity

HF_CP = [o for o in FAST if not o.startswith("model=")] + [
    "model=hf",
    "train.steps=10",
    "train.seq_len=32",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "checkpoint.enabled=false",
    "data.document_masking=true",
]
CP2 = ["parallel.dp_shard=1", "parallel.cp=2"]
# 4 processes: its parts are in the default run (cp × FSDP of the native model in
# test_context_parallel, model=hf under FSDP in test_hf_training, model=hf under cp here)
CP2_FSDP2 = ["parallel.dp_shard=2", "parallel.cp=2"]


@pytest.fixture(scope="module")
def base(models, corpus):  # noqa: F811 — the imported fixture
    return [*HF_CP, *corpus, f"model.path={models['llama']}"]


@pytest.fixture(scope="module")
def single_process(base, models, tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_hf_single")
    run, causal, windowed = train_in_one_group(
        [
            (root / "documents", base),
            (root / "causal", [*base, "data.document_masking=false"]),
            (root / "mistral", [*base, f"model.path={models['mistral']}"]),
        ],
        nproc=1,
    )
    assert len(run.losses) == 10 and run.losses[-1] < run.losses[0], run.losses
    assert max(abs(a - b) for a, b in zip(run.losses, causal.losses)) > 1e-3, (
        "the masks change this corpus's curve"
    )
    return {"llama": run.losses, "mistral": windowed.losses}


def _assert_parity(name, run, reference):
    diffs = [abs(a - b) for a, b in zip(reference, run.losses)]
    assert len(run.losses) == len(reference) and max(diffs) < 1e-4, (
        f"{name}: per-step |Δloss| {diffs}"
    )
    assert run.run_info["layout"]["cp"] == 2


def test_cp2_training_follows_the_single_process_curve(base, single_process, tmp_path):
    _assert_parity(
        "cp2",
        train_in_one_group([(tmp_path / "cp2", [*base, *CP2])], nproc=2)[0],
        single_process["llama"],
    )


def test_cp2_tp2_sp_and_windowed_cp2_fsdp2_follow_the_single_process_curve(
    base, models, single_process, tmp_path
):
    """4 ranks: Llama under cp 2 × TP 2 + SP, and Mistral (a 24-key window over 32 tokens) under
    cp 2 × FSDP 2, each on its one-process curve (1e-4), document masking on."""
    tp = [*base, *CP2, "parallel.tp=2", "parallel.sequence_parallel=true"]
    windowed = [*base, *CP2_FSDP2, f"model.path={models['mistral']}"]
    runs = train_in_one_group([(tmp_path / "tp", tp), (tmp_path / "windowed", windowed)], nproc=4)
    _assert_parity("cp2_tp2_sp", runs[0], single_process["llama"])
    assert runs[0].run_info["layout"]["tp"] == 2
    _assert_parity("mistral cp2_fsdp2", runs[1], single_process["mistral"])


@pytest.mark.slow
def test_cp2_fsdp2_training_follows_the_single_process_curve(base, single_process, tmp_path):
    run = train_in_one_group([(tmp_path / "cp2_fsdp2", [*base, *CP2_FSDP2])], nproc=4)[0]
    _assert_parity("cp2_fsdp2", run, single_process["llama"])
    assert (
        abs(run.run_info["model_state_bytes_per_rank"] / (16 * run.run_info["num_params"] / 4) - 1)
        < 0.05
    )
