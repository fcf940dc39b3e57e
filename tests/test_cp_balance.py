"""Document-balanced context parallel (parallel.cp_balance=documents): each batch's packed documents
decide which chunks of the sequence each cp rank holds, so that the ranks' attention work is even.

The placement gives every rank the same tokens, is a pure function of the documents, and cuts the
busiest rank's work to within a few percent of the mean where head-tail leaves it 1.5–2× (the work
counted is what the ring's kernels compute, checked against the ring's own blocks); under it each
style's attention equals full attention with document masks, forward and backward, and training
under cp 2 × FSDP, cp 4 and PP × cp follows the single-process curve (the fixtures of
tests/test_context_parallel.py).
"""

import statistics

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import FAST, processes, train_in_one_group
from test_context_parallel import STEPS, corpus, documents  # noqa: F401  (fixtures: the short-document corpus)

from composer3d.parallel.context.balance import (
    chunk_work,
    document_ids,
    head_tail,
    plan_placement,
    rank_work,
)


def _packed_positions(rows: int, seq: int, mean: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of documents of exponentially distributed length (mean ``mean``), as the data packs
    them: positions restarting at every document."""
    out = []
    for _ in range(rows):
        positions = []
        while len(positions) < seq:
            length = max(1, int(torch.empty(1).exponential_(1 / mean, generator=generator)))
            positions.extend(range(length))
        out.append(positions[:seq])
    return torch.tensor(out)


def _imbalance(placement, documents) -> float:
    work = rank_work(placement, documents)
    return max(work) / statistics.mean(work)


@pytest.mark.parametrize("cp", [4, 8])
def test_documents_balance_cuts_the_busiest_rank(cp):
    """4,096 tokens of documents of mean 256 to 1,024 tokens: head-tail's busiest rank does up to
    1.4–2× the mean work; the documents placement keeps it within 1.1 of the mean, on every
    batch."""
    generator = torch.Generator().manual_seed(cp)
    head_tail_worst, balanced_worst = 0.0, 0.0
    for mean in (256, 512, 1024):
        for _ in range(4):
            documents = document_ids(_packed_positions(1, 4096, mean, generator))
            balanced = plan_placement(cp, 4096, "documents", documents)
            head_tail_worst = max(head_tail_worst, _imbalance(head_tail(cp, 4096), documents))
            balanced_worst = max(balanced_worst, _imbalance(balanced, documents))
            # never busier than head-tail's busiest rank
            assert max(rank_work(balanced, documents)) <= max(
                rank_work(head_tail(cp, 4096), documents)
            )
    assert head_tail_worst > 1.35, head_tail_worst  # a distribution that unbalances head-tail
    assert balanced_worst <= 1.1, (balanced_worst, head_tail_worst)


def test_placement_holds_equal_tokens_every_token_once_deterministically():
    """Each rank 2·cp·4/cp chunks of seq/(2·cp·4) tokens (the finest cut dividing the sequence); the
    same documents give the same placement (every cp rank computes it alone); plain causal rows and
    head_tail keep head-tail."""
    generator = torch.Generator().manual_seed(0)
    documents = document_ids(_packed_positions(2, 1024, 64, generator))
    placement = plan_placement(4, 1024, "documents", documents)
    assert placement.chunk == 1024 // 32 and all(len(chunks) == 8 for chunks in placement.held)
    assert placement != head_tail(4, 1024)
    assert torch.equal(placement.gathered_index().sort().values, torch.arange(1024))
    assert all(placement.token_index(rank).numel() == 256 for rank in range(4))
    assert plan_placement(4, 1024, "documents", documents.clone()) == placement
    assert plan_placement(4, 1024, "documents", None) == head_tail(4, 1024)
    assert plan_placement(4, 1024, "head_tail", documents) == head_tail(4, 1024)
    # seq 80 under cp 4: 8·2 chunks divide it, 8·3 and 8·4 do not (head-tail's chunks are 10)
    assert plan_placement(
        4, 80, "documents", document_ids(_packed_positions(1, 80, 4, generator))
    ).chunk in (5, 10)


def test_counted_work_is_what_the_ring_computes():
    """``chunk_work`` of each rank equals the scores of the blocks ``ring_blocks`` plans for it: a
    chunk² for each block, half (with the diagonal) for a causal one, the skipped ones none."""
    from composer3d.parallel.context.ring_attention import ring_blocks

    generator = torch.Generator().manual_seed(1)
    documents = document_ids(_packed_positions(2, 256, 24, generator))
    placement = plan_placement(4, 256, "documents", documents)
    for rank, expected in enumerate(rank_work(placement, documents)):
        blocks = [block for source in ring_blocks(rank, placement, documents) for block in source]
        size = placement.chunk
        assert (
            sum(size * (size + 1) // 2 if block.causal else size * size for block in blocks)
            == expected
        )
    assert chunk_work(documents, 8).shape == (32,)


@pytest.mark.parametrize("window", [5, 8, 20, 64])
def test_windowed_work_is_what_the_ring_computes_and_skips_what_the_window_leaves(window):
    """Under a sliding window, with and without documents, head-tail and balanced: each rank's
    counted work (two layers windowed, one full) equals its blocks' scores, and the ring plans no
    block wholly outside every query's window — fewer blocks than causal attention once the window
    is narrower than the chunks' distance."""
    from composer3d.parallel.context.ring_attention import ring_blocks

    generator = torch.Generator().manual_seed(1)
    for rows in (None, document_ids(_packed_positions(2, 256, 40, generator))):
        for balance in ("head_tail", "documents"):
            windows = (window, 0, window)
            placement = plan_placement(4, 256, balance, rows, windows)
            size = placement.chunk
            counted = rank_work(placement, rows, windows)
            for rank in range(4):
                plans = {w: ring_blocks(rank, placement, rows, w) for w in (0, window)}
                scores = {
                    w: sum(
                        size * (size + 1) // 2 if block.causal else size * size
                        for source in plan
                        for block in source
                    )
                    for w, plan in plans.items()
                }
                assert 2 * scores[window] + scores[0] == counted[rank]
                for source, blocks in enumerate(plans[window]):
                    for block in blocks:
                        q_chunk = placement.held[rank][block.queries.start // size]
                        k_chunk = placement.held[source][block.keys.start // size]
                        # the nearest query/key pair of the block is inside the window
                        assert q_chunk * size - (k_chunk + 1) * size + 1 < window
                        # a block the window cuts carries its mask
                        if (q_chunk - k_chunk + 1) * size - 1 >= window:
                            assert block.mask is not None
                if window < 2 * size:
                    assert sum(map(len, plans[window])) < sum(map(len, plans[0]))


# --------------------------------------------------------------------------- against full attention


def _styles_against_full_attention(rank: int, world: int, port: int, errors) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # served by the test's process
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh

        from composer3d.parallel.context.context_parallel import ContextParallel

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
        seq, heads, kv_heads, dim = 128, 8, 4, 16
        generator = torch.Generator().manual_seed(0)  # the same on every rank
        positions = _packed_positions(2, seq, 12, generator)
        q = torch.randn(2, heads, seq, dim, generator=generator)
        k, v = (torch.randn(2, kv_heads, seq, dim, generator=generator) for _ in range(2))
        grad = torch.randn(2, heads, seq, dim, generator=generator)
        documents = document_ids(positions)
        mask = (documents[:, :, None] == documents[:, None, :]) & torch.ones(
            seq, seq, dtype=torch.bool
        ).tril()
        behind = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
        for window in (0, WINDOW):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            windowed = mask & (behind < WINDOW) if window else mask
            expected = F.scaled_dot_product_attention(
                *full, attn_mask=windowed.unsqueeze(1), enable_gqa=True
            )
            expected.backward(grad)
            for style in ("ring", "allgather", "ulysses"):
                context = ContextParallel(mesh, style, "documents", (window,))
                context.place(positions, seq)
                # the balanced cut, not head-tail
                assert context.placed.chunk == seq // (2 * world * 4), context.placed
                local = [context.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
                # the gather back, by placement
                assert torch.equal(context.whole(context.shard(documents)), documents)
                plan = context.attention_plan(seq, documents, torch.device("cpu"), window)
                out = context.attend(*local, plan)
                out.backward(context.shard(grad, dim=2))
                error = (out - context.shard(expected, dim=2)).abs().max().item()
                errors[(rank, window, style, "out")] = error
                for name, got, want in zip("qkv", local, full):
                    errors[(rank, window, style, name)] = (
                        (got.grad - context.shard(want.grad, dim=2)).abs().max().item()
                    )
    finally:
        dist.destroy_process_group()


# narrower than two of the balanced placement's 4-token chunks apart, wider than a document
WINDOW = 7


def test_every_style_equals_full_attention_under_the_documents_placement():
    """4 cp ranks, two rows of documents of mean 12 tokens: each rank's output and its q/k/v
    gradients equal full attention's with the document mask at the tokens the balanced placement
    gives it, in every style (1e-5), causal and under a sliding window."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors = mp.Manager().dict()
    processes(_styles_against_full_attention, 4, 4, store.port, errors)
    assert len(errors) == 4 * 2 * 3 * 4
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] < 1e-5, worst


# -------------------------------------------------------------------------------------- loss parity

BALANCED = ["parallel.cp_balance=documents"]
LAYOUTS = {  # all on 4 ranks, in one process group
    "cp4": (4, ["parallel.dp_shard=1", "parallel.cp=4"]),
    "cp2_fsdp2": (2, ["parallel.dp_shard=2", "parallel.cp=2"]),
    # each microbatch's stages read the batch's one placement
    "pp2_cp2": (2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.cp=2"]),
}


@pytest.fixture(scope="module")
def balanced_runs(tmp_path_factory, documents):  # noqa: F811
    """The one-process reference (``reference``) and each layout, document masking on."""
    root = tmp_path_factory.mktemp("cp_balance")
    (reference,) = train_in_one_group(
        [(root / "reference", [*FAST, *STEPS, *documents["documents"]])], nproc=1
    )
    names = list(LAYOUTS)
    jobs = [
        (root / name, [*FAST, *STEPS, *LAYOUTS[name][1], *BALANCED, *documents["documents"]])
        for name in names
    ]
    return {
        "reference": reference,
        **dict(zip(names, train_in_one_group(jobs, nproc=4, probe_effects=True))),
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_documents_balance_follows_the_single_process_curve(name, balanced_runs):
    """Document masking on, cp_balance=documents: the curve is one process's within 1e-4, and the
    ranks held the balanced placement's chunks (more than head-tail's two, seq 64 cut into 2·cp·4),
    every token once."""
    run, reference = balanced_runs[name], balanced_runs["reference"]
    assert len(run.losses) == len(reference.losses) == 10
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, f"{name}: per-step |Δloss| {diffs}"
    cp = LAYOUTS[name][0]
    held = {}
    for effects in run.effects:
        for block in effects["attention"].values():
            held[tuple(block["cp_ranks"])] = held.get(tuple(block["cp_ranks"]), []) + [
                tuple(block["cp_chunks"])
            ]
    for group, chunks in held.items():
        assert len(group) == cp and all(len(c) == 8 for c in chunks), (group, chunks)
        assert sorted(c for rank_chunks in set(chunks) for c in rank_chunks) == list(
            range(2 * cp * 4)
        ), chunks
