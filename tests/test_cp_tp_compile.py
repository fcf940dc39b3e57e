"""Context parallel composed with tensor + sequence parallel, with compile and with ZeRO-1.

Under TP × cp each cp rank's share of the sequence is split again over tp for the norms and the
residual stream (sequence parallel), and each tp rank attends with its share of the heads over the
whole sequence (ring, allgather or ulysses across its cp group). Compiled blocks run cp's attention
eagerly between their graphs.

Checked against one process's model (logits and gradients, every style, with documents and without;
what each rank's attention and residual stream hold; where compile breaks the graph and that it
never recompiles), and by loss parity over 10 steps: in the default run cp 2 × TP 2 + SP with
documents in the ring and ulysses, and ZeRO-1 over dp × cp at the cp tests' size; with ``-m
slow`` every layout at the issue's (``model.n_layers=4 train.seq_len=256``), cp 2 × FSDP 2 × TP 2 +
SP on 8 ranks and compile × cp (× FSDP) through inductor among them.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import (
    FAST,
    RunResult,
    assert_follows,
    compiled_jobs,
    composed_jobs,
    processes,
    spawn,
    train_in_one_group,
)
from test_context_parallel import MASKING, corpus, documents  # noqa: F401  (fixtures: the short-document corpus)

BASE = [*(o for o in FAST if not o.startswith("train.seq_len=")), "train.steps=10"]
SIZES = {  # the default run's (the cp tests' size) and the issue's bar (with -m slow)
    "small": ["train.seq_len=64", "model.n_layers=2"],
    "issue": ["train.seq_len=256", "model.n_layers=4"],
}
TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name: (world size, overrides); ring attention unless named
    "reference": (1, []),
    "cp2_tp2_sp": (4, ["parallel.dp_shard=1", "parallel.cp=2", *TP_SP]),
    "cp2_tp2_sp_allgather": (
        4,
        ["parallel.dp_shard=1", "parallel.cp=2", *TP_SP, "parallel.cp_style=allgather"],
    ),
    "cp2_tp2_sp_ulysses": (
        4,
        ["parallel.dp_shard=1", "parallel.cp=2", *TP_SP, "parallel.cp_style=ulysses"],
    ),
    "cp2_tp2": (4, ["parallel.dp_shard=1", "parallel.cp=2", "parallel.tp=2"]),  # TP without SP
    "cp2_fsdp2_zero1": (4, ["parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=1"]),
    "cp2_fsdp2_tp2_sp": (8, ["parallel.dp_shard=2", "parallel.cp=2", *TP_SP]),
}
COMPILED = {  # trained one per process group, dynamo counting (``harness.compiled_jobs``)
    "cp2_compiled": (2, ["parallel.dp_shard=1", "parallel.cp=2", "compile.enabled=true"]),
    "cp2_fsdp2_compiled": (4, ["parallel.dp_shard=2", "parallel.cp=2", "compile.enabled=true"]),
}
# cp × TP + SP in the ring and in ulysses (which splits the heads tp left it again, over cp), with
# documents; the causal mask and the allgather style under TP in the slow run (each is in the
# default run under cp alone: test_context_parallel, whose attention code they share)
DEFAULT_CASES = [
    ("cp2_tp2_sp", "documents"),
    ("cp2_tp2_sp_ulysses", "documents"),
    ("cp2_fsdp2_zero1", "documents"),
]
# every layout with documents; the TP + SP ones (every style) with masking off too
ISSUE_CASES = [
    (name, kind)
    for name in LAYOUTS
    if name != "reference"
    for kind in MASKING
    if kind == "documents" or "tp2_sp" in name
]


# ---------------------------------------------------------------------- against one process's model


def _tiny_model_and_batch():
    from composer3d.config.schema import ModelConfig

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
    seq = 32
    tokens = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, seq, 128, generator=torch.Generator().manual_seed(2))
    return cfg, tokens, weights


def _documents(*starts: int, seq: int = 32) -> torch.Tensor:
    """Position ids of two rows, each two packed documents, the second starting at
    ``starts[row]``."""
    return torch.stack(
        [torch.cat([torch.arange(start), torch.arange(seq - start)]) for start in starts]
    )


def _errors(
    full, parted, context, tokens, weights, position_ids, cp_group, whole=lambda t: t
) -> tuple:
    """The largest logits error at this rank's tokens, and the largest gradient error (relative to
    each parameter's largest entry) of the same scalar, each rank's share summed over cp. ``whole``:
    a parameter's or logits' whole tensor from what this rank holds (DTensor's ``full_tensor`` under
    TP)."""
    for model in (full, parted):
        model.zero_grad(set_to_none=True)
    expected = full(tokens, position_ids=position_ids)
    got = whole(parted(context.shard(tokens), position_ids=context.shard(position_ids)))
    logits_error = (got - context.shard(expected)).abs().max().item()
    (expected * weights).sum().backward()
    (got * context.shard(weights)).sum().backward()
    grad_error = 0.0
    for a, b in zip(full.parameters(), parted.parameters()):
        grad = whole(b.grad).clone()
        dist.all_reduce(grad, group=cp_group)
        grad_error = max(grad_error, ((a.grad - grad).abs().max() / a.grad.abs().max()).item())
    return logits_error, grad_error


# the styles that run on 2 cp ranks (hierarchical needs 4 or more: tests/test_context_parallel.py)
CP2_STYLES = ("ring", "allgather", "ulysses")


def _tp_cp_against_full_attention(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from composer3d.models import MODEL_REGISTRY, build_model
    from composer3d.models.init import materialize
    from composer3d.parallel.context.context_parallel import ContextParallel
    from composer3d.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cfg, tokens, weights = _tiny_model_and_batch()
    results = {}
    for style in CP2_STYLES:
        for kind, position_ids in (("causal", None), ("documents", _documents(11, 20))):
            full, parted = build_model(cfg), build_model(cfg)
            apply_tensor_parallel(
                parted, MODEL_REGISTRY["llama"], mesh["tp"], sequence_parallel=True
            )
            context = ContextParallel(mesh["cp"], style)
            parted.use_context_parallel(context)
            for model in (
                full,
                parted,
            ):  # the same weights: each generated whole from (seed, name), then cut
                materialize(model, torch.device("cpu"), seed=0)
            seen = {}
            attend = context.attend

            def recording(q, k, v, plan):
                seen.setdefault("attention", [list(q.shape), list(k.shape)])
                return attend(q, k, v, plan)

            def residual(_, args):  # the block's input: this rank's share of the residual stream
                seen.setdefault("residual", list(args[0].shape))

            context.attend = recording
            parted.layers["0"].register_forward_pre_hook(residual)
            errors = _errors(
                full,
                parted,
                context,
                tokens,
                weights,
                position_ids,
                mesh["cp"].get_group(),
                whole=lambda t: t.full_tensor(),
            )
            results[f"{style}_{kind}"] = {"logits": errors[0], "grads": errors[1], **seen}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_tp_cp_logits_gradients_and_what_each_rank_holds(tmp_path):
    """cp 2 × TP 2 + SP on 4 ranks, each style, causal and with documents: each rank's logits are
    one process's at its tokens and the gradients summed over cp are one process's (1e-5); each tp
    rank attends with n_heads/tp query and n_kv_heads/tp key heads over its cp share (seq/cp
    tokens), and its residual stream holds seq/(cp·tp)."""
    spawn(_tp_cp_against_full_attention, 4, tmp_path, str(tmp_path))
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 6, results.keys()
        for case, result in results.items():
            assert result["logits"] < 1e-5 and result["grads"] < 1e-5, (rank, case, result)
            # (batch, heads / tp, tokens / cp, head_dim): 8 and 4 heads, 32 tokens, dim 64 / 8 heads
            assert result["attention"] == [[2, 4, 16, 8], [2, 2, 16, 8]], (rank, case, result)
            assert result["residual"] == [2, 8, 64], (rank, case, result)  # 32 tokens / cp 2 / tp 2


def _compiled_cp_against_full_attention(rank: int, world: int, out: str) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from composer3d.models import build_model
    from composer3d.models.init import materialize
    from composer3d.parallel.context.context_parallel import ContextParallel

    # a batch that compiled a graph again would fail here
    torch._dynamo.config.error_on_recompile = True
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    cfg, tokens, weights = _tiny_model_and_batch()
    results = {}
    for style in CP2_STYLES:
        torch._dynamo.reset()
        counters.clear()
        full, parted = build_model(cfg), build_model(cfg)
        context = ContextParallel(mesh["cp"], style)
        parted.use_context_parallel(context)
        for model in (full, parted):
            materialize(model, torch.device("cpu"), seed=0)
        for block in parted.layers.values():
            # dynamo's graphs, breaks and guards, run without a compiler
            block.compile(backend="eager")
        errors = [
            _errors(full, parted, context, tokens, weights, positions, mesh["cp"].get_group())
            for positions in (_documents(11, 20), _documents(5, 27), None)
        ]  # other documents each batch
        results[style] = {
            "errors": errors,
            "graph_breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"],
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_compiled_cp_blocks_break_only_at_attention(tmp_path):
    """Compiled blocks under cp 2, each style, over three batches whose documents differ (the last
    causal): one process's logits and gradients (1e-5); dynamo compiles the block before and after
    attention and breaks the graph only at cp's attention (``ContextParallel.attend``), and a new
    batch compiles nothing again."""
    spawn(_compiled_cp_against_full_attention, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        for style, result in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            assert all(error < 1e-5 for batch in result["errors"] for error in batch), (
                rank,
                style,
                result,
            )
            assert result["graphs"] >= 2, (rank, style, result)
            assert result["graph_breaks"] and all(
                "context parallel attention" in reason for reason in result["graph_breaks"]
            ), (rank, style, result)


# -------------------------------------------------------------------------------------- loss parity


def _train(root: Path, documents, size: str, cases: list[tuple[str, str]]) -> dict:  # noqa: F811
    """(layout, masking) → its run, and ("reference", masking) → one process's; those of a world
    size in one process group."""
    cases = [*(("reference", kind) for kind in MASKING), *cases]
    runs = {}
    for world in sorted({LAYOUTS[name][0] for name, _ in cases}):
        keys = [(name, kind) for name, kind in cases if LAYOUTS[name][0] == world]
        jobs = [
            (root / f"{name}_{kind}", [*BASE, *SIZES[size], *LAYOUTS[name][1], *documents[kind]])
            for name, kind in keys
        ]
        runs.update(zip(keys, train_in_one_group(jobs, nproc=world)))
    assert runs[("reference", "documents")].losses != runs[("reference", "causal")].losses, (
        "document masking changes this corpus's curve"
    )
    return runs


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory, documents):  # noqa: F811
    return _train(tmp_path_factory.mktemp("cptp_small"), documents, "small", DEFAULT_CASES)


@pytest.fixture(scope="module")
def issue_runs(tmp_path_factory, documents):  # noqa: F811
    return _train(tmp_path_factory.mktemp("cptp_issue"), documents, "issue", ISSUE_CASES)


def _assert_layout(run, name: str) -> None:
    degrees = dict(
        arg.removeprefix("parallel.").split("=")
        for arg in LAYOUTS[name][1]
        if "parallel.tp=" in arg or "parallel.cp=" in arg or "parallel.dp_shard=" in arg
    )
    assert {k: str(run.run_info["layout"][k]) for k in degrees} == degrees, run.run_info["layout"]


@pytest.mark.parametrize("name, kind", DEFAULT_CASES)
def test_tp_cp_loss_matches_single_process(name, kind, small_runs):
    assert_follows(small_runs[("reference", kind)], small_runs[(name, kind)], f"{name} ({kind})")
    _assert_layout(small_runs[(name, kind)], name)


def test_zero1_shards_optimizer_state_over_dp_and_cp(small_runs):
    """ZeRO-1 under cp 2 × dp 2: parameters and gradient buckets replicated (4 + 4 bytes a
    parameter), the optimizer's 8 bytes and the reduced gradient slices' 4 sharded over all 4 ranks
    whose gradients differ (dp × cp), not over dp alone (which would be 14 bytes)."""
    info = small_runs[("cp2_fsdp2_zero1", "documents")].run_info
    expected = (4 + 4 + 12 / 4) * info["num_params"]
    assert abs(info["model_state_bytes_per_rank"] - expected) / expected < 0.02, (info, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", ISSUE_CASES)
def test_tp_cp_at_the_issues_size_matches_single_process(name, kind, issue_runs):
    assert_follows(issue_runs[("reference", kind)], issue_runs[(name, kind)], f"{name} ({kind})")
    _assert_layout(issue_runs[(name, kind)], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_cp_at_the_issues_size_matches_single_process(
    name, issue_runs, documents, tmp_path
):  # noqa: F811
    """Inductor-compiled blocks (× FSDP): the one-process curve; graphs broken only at cp's
    attention, and no recompile at any step."""
    world, layout = COMPILED[name]
    run_dir, report = tmp_path / name, tmp_path / "dynamo"
    report.mkdir()
    # the job's rendezvous
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    processes(
        compiled_jobs,
        world,
        world,
        composed_jobs(
            [(run_dir, [*BASE, *SIZES["issue"], *layout, *documents["documents"]])], world
        ),
        [store.port],
        str(report),
    )
    assert_follows(issue_runs[("reference", "documents")], RunResult(0, "", 0.0, run_dir), name)
    for counts in (json.loads(path.read_text()) for path in sorted(report.glob("rank*.json"))):
        assert counts["graphs"] >= 2, counts
        assert counts["graph_breaks"] and all(
            "context parallel attention" in reason for reason in counts["graph_breaks"]
        ), counts
