"""Context parallel (parallel.cp): each cp rank holds 1/cp of every sequence, attention spans all of
it. What it cannot run yet is refused before launch (tests/test_config_errors.py).

Checked against plain full attention (the same model on one process, per token and per gradient) in
each style (ring, allgather, ulysses), and by loss parity: cp 2, cp 4, cp × FSDP, cp × HSDP and cp ×
FSDP with full activation checkpointing follow the single-process curve with ring attention, and cp
2 and cp × FSDP with the other two styles, with document masking on and off.
"""

import json
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import FAST, processes, train_in_one_group

STEPS = ["train.steps=10"]
MASKING = {"documents": ["data.document_masking=true"], "causal": ["data.document_masking=false"]}
LAYOUTS = {  # name: (world size, cp, overrides); ring attention, the default style
    "cp2": (2, 2, ["parallel.dp_shard=1", "parallel.cp=2"]),
    "cp4": (4, 4, ["parallel.dp_shard=1", "parallel.cp=4"]),
    "cp2_fsdp2": (4, 2, ["parallel.dp_shard=2", "parallel.cp=2"]),
    "cp2_hsdp2": (4, 2, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.cp=2"]),
    # recomputed in backward, the blocks pass keys and values round the ring again
    "cp2_fsdp2_full_ac": (
        4,
        2,
        ["parallel.dp_shard=2", "parallel.cp=2", "memory.activation_checkpointing=full"],
    ),
}
# the other styles in the cp 2 and cp × FSDP layouts
LAYOUTS.update(
    {
        f"{name}_{style}": (world, cp, [*overrides, f"parallel.cp_style={style}"])
        for style in ("allgather", "ulysses")
        for name in ("cp2", "cp2_fsdp2")
        for world, cp, overrides in [LAYOUTS[name]]
    }
)

# hierarchical: Ulysses over cp_ulysses consecutive cp ranks × the ring across those groups, at cp 4
# (2 × 2) and cp 8 (a ring of 2 groups of 4), and composed with FSDP and with TP + SP (8 ranks)
HIERARCHICAL = ["parallel.cp_style=hierarchical"]
LAYOUTS.update(
    {
        "cp4_hierarchical": (
            4,
            4,
            ["parallel.dp_shard=1", "parallel.cp=4", *HIERARCHICAL, "parallel.cp_ulysses=2"],
        ),
        "cp8_hierarchical": (
            8,
            8,
            ["parallel.dp_shard=1", "parallel.cp=8", *HIERARCHICAL, "parallel.cp_ulysses=4"],
        ),
        "cp4_hierarchical_fsdp2": (
            8,
            4,
            ["parallel.dp_shard=2", "parallel.cp=4", *HIERARCHICAL, "parallel.cp_ulysses=2"],
        ),
        "cp4_hierarchical_tp2_sp": (
            8,
            4,
            [
                "parallel.dp_shard=1",
                "parallel.cp=4",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                *HIERARCHICAL,
                "parallel.cp_ulysses=2",
            ],
        ),
    }
)

# Without document masking (plain causal attention) the default run trains each style at cp 2 and
# the ring at cp 4; the compositions train with document masking there (the harder mask: a
# document's start cut inside a rank's chunk), and without it in the slow run.
DEFAULT_CAUSAL = {"cp2", "cp4", "cp2_allgather", "cp2_ulysses"}
# hierarchical cp at 8 ranks (cp 8, and cp 4 composed with FSDP and with TP + SP): 3 minutes
# together on 2 cores; the default run trains cp 4 = 2 × 2 and checks cp 8's logits and gradients
# against full attention (test_cp_logits_and_gradients_equal_full_attention)
SLOW_COMPOSED = ("cp8_hierarchical", "cp4_hierarchical_fsdp2", "cp4_hierarchical_tp2_sp")
SLOW = [(name, "causal") for name in LAYOUTS if name not in DEFAULT_CAUSAL] + [
    (name, "documents") for name in SLOW_COMPOSED
]


# --------------------------------------------------------------------------- against full attention


def _cp_against_full_attention(
    rank: int, world: int, port: int, documents: bool, style: str, errors
) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # served by the test's process
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from composer3d.config.schema import ModelConfig
        from composer3d.models import build_model
        from composer3d.models.init import materialize
        from composer3d.parallel.context.context_parallel import ContextParallel

        cfg = ModelConfig(
            name="llama",
            dim=64,
            n_layers=2,
            n_heads=8,
            n_kv_heads=4,
            vocab_size=128,
            max_seq_len=64,
            init_std=0.1,
        )  # sharp attention: a key of the wrong document or future moves logits
        full, parted = build_model(cfg), build_model(cfg)
        for model in (full, parted):  # the same weights: each generated from (seed, name)
            materialize(model, torch.device("cpu"), seed=0)
        # hierarchical: Ulysses over half the ranks (2 × 2 at cp 4, 2 groups of 4 at cp 8)
        context = ContextParallel(
            init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"],
            style,
            ulysses=world // 2 if style == "hierarchical" else 0,
        )
        parted.use_context_parallel(context)
        seq = 32
        torch.manual_seed(1)
        tokens = torch.randint(0, 128, (2, seq))
        # two packed documents a row, restarting at different places (or plain causal rows)
        positions = (
            torch.cat([torch.arange(11), torch.arange(seq - 11)]).repeat(2, 1)
            if documents
            else None
        )
        if documents:
            positions[1] = torch.cat([torch.arange(20), torch.arange(seq - 20)])
        expected = full(tokens, position_ids=positions)
        got = parted(context.shard(tokens), position_ids=context.shard(positions))
        assert got.shape == (2, seq // world, 128), got.shape  # this rank computes only its tokens
        logits_error = (got - context.shard(expected)).abs().max().item()
        # gradients of the same scalar: each rank's share of the loss, summed over the cp ranks
        weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
        (expected * weights).sum().backward()
        (got * context.shard(weights)).sum().backward()
        grad_error = 0.0  # relative to the largest gradient entry of each parameter
        for a, b in zip(full.parameters(), parted.parameters()):
            dist.all_reduce(b.grad)
            grad_error = max(
                grad_error, ((a.grad - b.grad).abs().max() / a.grad.abs().max()).item()
            )
        errors[rank] = (logits_error, grad_error)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize(
    "style, world",
    [
        *((style, world) for style in ("ring", "allgather", "ulysses") for world in (2, 4)),
        ("hierarchical", 4),
        ("hierarchical", 8),
    ],
)
def test_cp_logits_and_gradients_equal_full_attention(style, world, documents):
    """Each rank's logits are full attention's at the tokens it holds; gradients summed over cp are
    full's. Hierarchical: Ulysses over pairs × a ring of 2 pairs (cp 4), over fours × a ring of 2
    (cp 8)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors = mp.Manager().dict()
    processes(_cp_against_full_attention, world, world, store.port, documents, style, errors)
    assert len(errors) == world
    for rank, (logits_error, grad_error) in errors.items():
        assert logits_error < 1e-5 and grad_error < 1e-5, (
            f"rank {rank}: logits {logits_error}, grads {grad_error}"
        )


def test_head_tail_chunks_balance_causal_work():
    """Rank r holds chunks r and 2·cp−1−r: together every token once, and the same number of causal
    pairs each."""
    from composer3d.parallel.context.balance import head_tail

    seq, cp = 64, 4
    held = [head_tail(cp, seq).token_index(rank) for rank in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))
    assert held[1].tolist() == [*range(8, 16), *range(48, 56)]
    work = {
        int((index + 1).sum()) for index in held
    }  # keys each query attends to under a causal mask
    assert len(work) == 1, work


# -------------------------------------------------------------------------------------- loss parity


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """Short documents (5 to 60 bytes: several in every 64-token window, so masks cut across the cp
    chunks)."""
    rng = random.Random(0)
    words = "the of ring attention keys values chunk rank token sequence mask document".split()
    path = tmp_path_factory.mktemp("cp_corpus") / "docs.jsonl"
    with path.open("w") as f:
        for _ in range(3000):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))[:60]
            f.write(json.dumps({"text": text}) + "\n")
    return ["data=text_files", f"data.paths=['{path}']"]


@pytest.fixture(scope="module")
def documents(corpus):
    return {kind: [*corpus, *overrides] for kind, overrides in MASKING.items()}


@pytest.fixture(scope="module")
def references(tmp_path_factory, documents):
    root = tmp_path_factory.mktemp("cp_ref")
    runs = dict(
        zip(
            documents,
            train_in_one_group(
                [
                    (root / kind, [*FAST, *STEPS, *overrides])
                    for kind, overrides in documents.items()
                ],
                nproc=1,
            ),
        )
    )
    assert runs["documents"].losses != runs["causal"].losses, (
        "document masking changes this corpus's curve"
    )
    return runs


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, documents):
    """Every layout with document masking on and off (the default run's: not ``SLOW``), those of a
    world size in one process group."""
    keys = [(name, kind) for name in LAYOUTS for kind in MASKING if (name, kind) not in SLOW]
    return _train(tmp_path_factory.mktemp("cp"), documents, keys)


@pytest.fixture(scope="module")
def slow_cp_runs(tmp_path_factory, documents):
    return _train(tmp_path_factory.mktemp("cp_slow"), documents, SLOW)


def _train(root, documents, keys: list[tuple[str, str]]) -> dict:
    runs = {}
    for world in sorted({LAYOUTS[name][0] for name, _ in keys}):
        jobs = [
            ((name, kind), root / f"{name}_{kind}", [*FAST, *STEPS, *overrides, *documents[kind]])
            for name, kind in keys
            for w, _, overrides in [LAYOUTS[name]]
            if w == world
        ]
        results = train_in_one_group(
            [(run_dir, overrides) for _, run_dir, overrides in jobs], nproc=world
        )
        runs.update(zip([key for key, _, _ in jobs], results))
    return runs


@pytest.mark.parametrize(
    "name, kind",
    [
        pytest.param(name, kind, marks=[pytest.mark.slow] if (name, kind) in SLOW else [])
        for name in LAYOUTS
        for kind in MASKING
    ],
)
def test_cp_loss_matches_single_process(name, kind, references, request):
    runs = request.getfixturevalue("slow_cp_runs" if (name, kind) in SLOW else "cp_runs")
    reference, run = references[kind], runs[(name, kind)]
    assert len(reference.losses) == len(run.losses) == 10
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, f"{name} ({kind}): per-step |Δloss| {diffs}"
    grad_diffs = [
        abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference.metrics, run.metrics)
    ]
    assert max(grad_diffs) < 1e-3, f"{name} ({kind}): grad norms differ {grad_diffs}"
    assert run.run_info["layout"]["cp"] == LAYOUTS[name][1]


@pytest.mark.parametrize(
    "name, sharding", [("cp2", 2), ("cp4", 4), ("cp2_fsdp2", 4), ("cp2_hsdp2", 2)]
)
def test_parameters_are_sharded_over_cp_not_replicated(name, sharding, cp_runs):
    """FSDP shards over dp_shard × cp: the model state per rank is 16 bytes a parameter over that
    many ranks."""
    info = cp_runs[(name, "documents")].run_info
    expected = 16 * info["num_params"] / sharding
    assert abs(info["model_state_bytes_per_rank"] - expected) / expected < 0.05, (info, expected)


@pytest.mark.parametrize("masking", ["causal", "documents"])
def test_materialized_block_kernel_in_row_tiles_equals_the_fused_one(monkeypatch, masking):
    """The materialized block kernel (CUDA's document-cut and fp32 blocks, other devices) holds the
    scores of a tile of query rows at a time: in tiles of 3 rows it equals the CPU's fused kernel,
    forward and backward (1e-5)."""
    from composer3d.parallel.context import attention_blocks
    from composer3d.parallel.context.attention_blocks import Block, block_backward, block_forward

    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 16, 8) for _ in range(4))
    mask = None
    if masking == "documents":  # a document starts at key 5: rows before it see none of its keys
        mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
        mask[..., :5, 5:] = False
    block = Block(slice(0, 16), slice(0, 16), masking == "causal", mask)
    scale = 8**-0.5
    fused_out, fused_lse = block_forward(q, k, v, block, scale, "cpu_flash")
    fused_grads = block_backward(grad, q, k, v, fused_out, fused_lse, block, scale, "cpu_flash")
    # 3 query rows a tile
    monkeypatch.setattr(attention_blocks, "SCORE_TILE_BYTES", 2 * 4 * 16 * 4 * 3)
    assert len(attention_blocks._row_tiles(q, 16)) == 6
    out, lse = block_forward(q, k, v, block, scale, "materialized")
    grads = block_backward(grad, q, k, v, fused_out, fused_lse, block, scale, "materialized")
    torch.testing.assert_close(out, fused_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, fused_lse, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, fused_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
