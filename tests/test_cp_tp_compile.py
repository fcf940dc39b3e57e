"""Context parallel composed with tensor + sequence parallel, with compile and with ZeRO-1.

Under TP × cp each cp rank's share of the sequence is split again over tp for the norms and the residual stream
(sequence parallel), and each tp rank attends with its share of the heads over the whole sequence (ring, allgather
or ulysses across its cp group). Checked against one process's model (logits and gradients, every style, with
documents and without, and what each rank's attention and residual stream hold) and by loss parity at
``model.n_layers=4 train.seq_len=256`` over 10 steps: cp 2 × TP 2 (+SP, and without SP) in every style, ZeRO-1
over dp × cp, compile × cp 2 with no recompile after the first step; cp 2 × FSDP 2 × TP 2 + SP (8 ranks) and
compile × cp 2 × FSDP 2 with ``-m slow`` (their parts run here).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import FAST, RunResult, _train_jobs, processes, spawn, train_in_one_group
from test_context_parallel import MASKING, corpus, documents  # noqa: F401  (fixtures: the short-document corpus)

RUN = [*(o for o in FAST if not o.startswith("train.seq_len=")), "train.seq_len=256", "model.n_layers=4",
       "train.steps=10"]
TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name: (world size, overrides, masking kinds); ring attention unless named
    "cp2_tp2_sp": (4, ["parallel.dp_shard=1", "parallel.cp=2", *TP_SP], list(MASKING)),
    "cp2_tp2_sp_allgather": (4, ["parallel.dp_shard=1", "parallel.cp=2", *TP_SP, "parallel.cp_style=allgather"],
                             list(MASKING)),
    "cp2_tp2_sp_ulysses": (4, ["parallel.dp_shard=1", "parallel.cp=2", *TP_SP, "parallel.cp_style=ulysses"],
                           list(MASKING)),
    "cp2_tp2": (4, ["parallel.dp_shard=1", "parallel.cp=2", "parallel.tp=2"], ["documents"]),  # TP without SP
    "cp2_fsdp2_zero1": (4, ["parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=1"], ["documents"]),
    "cp2_fsdp2_tp2_sp": (8, ["parallel.dp_shard=2", "parallel.cp=2", *TP_SP], list(MASKING)),
}
SLOW_WORLDS = {8}  # cp × FSDP and cp × TP + SP each run in the default run
COMPILED = {  # name: (world size, overrides); with documents
    "cp2_compiled": (2, ["parallel.dp_shard=1", "parallel.cp=2", "compile.enabled=true"]),
    "cp2_fsdp2_compiled": (4, ["parallel.dp_shard=2", "parallel.cp=2", "compile.enabled=true"]),
}
SLOW_COMPILED = {"cp2_fsdp2_compiled"}


# ------------------------------------------------------------------- TP × cp against one process's attention

def _tp_cp_against_full_attention(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from composer3d.config import ModelConfig
    from composer3d.models import MODEL_REGISTRY, build_model
    from composer3d.models.init import materialize
    from composer3d.parallel.context import STYLES, ContextParallel
    from composer3d.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cfg = ModelConfig(name="llama", dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, max_seq_len=64,
                      init_std=0.1)  # sharp attention: a key of the wrong document or future moves logits
    seq = 32
    tokens = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.cat([torch.arange(11), torch.arange(seq - 11)]),
                             torch.cat([torch.arange(20), torch.arange(seq - 20)])])  # two documents a row
    weights = torch.randn(2, seq, 128, generator=torch.Generator().manual_seed(2))
    results = {}
    for style in STYLES:
        for kind, position_ids in (("causal", None), ("documents", positions)):
            full, parted = build_model(cfg), build_model(cfg)
            apply_tensor_parallel(parted, MODEL_REGISTRY["llama"], mesh["tp"], sequence_parallel=True)
            context = ContextParallel(mesh["cp"], style)
            parted.use_context_parallel(context)
            for model in (full, parted):  # the same weights: each generated whole from (seed, name), then cut
                materialize(model, torch.device("cpu"), seed=0)
            seen = {}
            attend = context.attend

            def recording(q, k, v, plan):
                seen.setdefault("attention", [list(q.shape), list(k.shape)])
                return attend(q, k, v, plan)
            context.attend = recording
            def residual(_, args):  # the block's input: this rank's share of the residual stream
                seen.setdefault("residual", list(args[0].shape))
            parted.layers["0"].register_forward_pre_hook(residual)
            expected = full(tokens, position_ids=position_ids)
            got = parted(context.shard(tokens), position_ids=context.shard(position_ids)).full_tensor()
            logits_error = (got - context.shard(expected)).abs().max().item()
            (expected * weights).sum().backward()
            (got * context.shard(weights)).sum().backward()
            grad_error = 0.0  # relative to the largest gradient entry of each parameter
            for a, b in zip(full.parameters(), parted.parameters()):
                grad = b.grad.full_tensor()  # whole over tp, this cp rank's tokens' share: summed over cp
                dist.all_reduce(grad, group=mesh["cp"].get_group())
                grad_error = max(grad_error, ((a.grad - grad).abs().max() / a.grad.abs().max()).item())
            results[f"{style}_{kind}"] = {"logits": logits_error, "grads": grad_error, **seen}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_tp_cp_logits_gradients_and_what_each_rank_holds(tmp_path):
    """cp 2 × TP 2 + SP on 4 ranks, each style, causal and with documents: each rank's logits are one process's at
    its tokens and the gradients summed over cp are one process's (1e-5); each tp rank attends with n_heads/tp
    query and n_kv_heads/tp key heads over its cp share (seq/cp tokens), and its residual stream holds seq/(cp·tp)."""
    spawn(_tp_cp_against_full_attention, 4, tmp_path, str(tmp_path))
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 6, results.keys()
        for case, result in results.items():
            assert result["logits"] < 1e-5 and result["grads"] < 1e-5, (rank, case, result)
            # (batch, heads / tp, tokens / cp, head_dim): 8 and 4 heads, 32 tokens, dim 64 / 8 heads
            assert result["attention"] == [[2, 4, 16, 8], [2, 2, 16, 8]], (rank, case, result)
            assert result["residual"] == [2, 8, 64], (rank, case, result)  # 32 tokens / cp 2 / tp 2


# ------------------------------------------------------------------------------------------------ loss parity

@pytest.fixture(scope="module")
def references(tmp_path_factory, documents):  # noqa: F811  (the imported fixture)
    """One process, with document masking on and off (one process group of one)."""
    root = tmp_path_factory.mktemp("cptp_ref")
    kinds = list(MASKING)
    runs = dict(zip(kinds, train_in_one_group([(root / kind, [*RUN, *documents[kind]]) for kind in kinds], nproc=1)))
    assert runs["documents"].losses != runs["causal"].losses, "document masking changes this corpus's curve"
    return runs


def _layouts_of(world: int):
    return [(name, kind) for name, (w, _, kinds) in LAYOUTS.items() if w == world for kind in kinds]


@pytest.fixture(scope="module")
def tp_cp_runs(tmp_path_factory, documents):  # noqa: F811
    """The layouts of the default run, those of a world size in one process group (the 8-rank ones: ``slow_runs``)."""
    return _train_layouts(tmp_path_factory.mktemp("cptp"), documents, {w for w, _, _ in LAYOUTS.values()} - SLOW_WORLDS)


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, documents):  # noqa: F811
    return _train_layouts(tmp_path_factory.mktemp("cptp_slow"), documents, SLOW_WORLDS)


def _train_layouts(root: Path, documents, worlds) -> dict:  # noqa: F811
    runs = {}
    for world in sorted(worlds):
        keys = _layouts_of(world)
        jobs = [(root / f"{name}_{kind}", [*RUN, *LAYOUTS[name][1], *documents[kind]]) for name, kind in keys]
        runs.update(zip(keys, train_in_one_group(jobs, nproc=world)))
    return runs


def _assert_follows(reference, run, what: str) -> None:
    assert len(reference.losses) == len(run.losses) == 10, what
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, f"{what}: per-step |Δloss| {diffs}"
    grad_diffs = [abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference.metrics, run.metrics)]
    assert max(grad_diffs) < 1e-3, f"{what}: grad norms differ {grad_diffs}"


def _parity_cases(slow: bool):
    return [(name, kind) for world in sorted({w for w, _, _ in LAYOUTS.values()}) if (world in SLOW_WORLDS) == slow
            for name, kind in _layouts_of(world)]


@pytest.mark.parametrize("name, kind", _parity_cases(slow=False))
def test_tp_cp_loss_matches_single_process(name, kind, references, tp_cp_runs):
    run = tp_cp_runs[(name, kind)]
    _assert_follows(references[kind], run, f"{name} ({kind})")
    layout = run.run_info["layout"]
    assert (layout["cp"], layout["tp"]) == (2, 2 if "tp2" in name else 1), layout


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", _parity_cases(slow=True))
def test_tp_cp_fsdp_on_8_ranks_matches_single_process(name, kind, references, slow_runs):
    run = slow_runs[(name, kind)]
    _assert_follows(references[kind], run, f"{name} ({kind})")
    assert {k: run.run_info["layout"][k] for k in ("dp_shard", "cp", "tp")} == {"dp_shard": 2, "cp": 2, "tp": 2}


def test_zero1_shards_optimizer_state_over_dp_and_cp(tp_cp_runs):
    """ZeRO-1 under cp 2 × dp 2: parameters and gradients replicated (4 + 4 bytes a parameter), the optimizer's 8
    bytes sharded over all 4 ranks whose gradients differ (dp × cp), not over dp alone (which would be 12 bytes)."""
    info = tp_cp_runs[("cp2_fsdp2_zero1", "documents")].run_info
    expected = (4 + 4 + 8 / 4) * info["num_params"]
    assert abs(info["model_state_bytes_per_rank"] - expected) / expected < 0.02, (info, expected)


# ---------------------------------------------------------------------------------------------- compile × cp

def _compiled_jobs(rank: int, nproc: int, jobs, ports, report: str) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.config.error_on_recompile = True  # a graph compiled again at a later step fails the run
    _train_jobs(rank, nproc, jobs, ports)
    Path(report, f"rank{rank}.json").write_text(json.dumps(
        {"graph_breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}))


def _train_compiled(tmp_path: Path, name: str, overrides: list[str]) -> tuple[RunResult, list[dict]]:
    """The run, and what dynamo counted on each rank: graph breaks by reason, graphs compiled."""
    world, layout = COMPILED[name]
    run_dir, report = tmp_path / name, tmp_path / f"{name}_dynamo"
    report.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the job's rendezvous
    processes(_compiled_jobs, world, world, [(str(run_dir), [*RUN, *layout, *overrides])], [store.port], str(report))
    return RunResult(0, "", 0.0, run_dir), [json.loads(p.read_text()) for p in sorted(report.glob("rank*.json"))]


def _assert_compiled_around_attention(dynamo: list[dict], world: int) -> None:
    """Each rank compiled its blocks (graphs before and after attention), broke the graph only at context
    parallel's attention (kept out of it: ``ContextParallel.attend``), and compiled nothing again after the first
    step (``error_on_recompile`` would have failed the run)."""
    assert len(dynamo) == world
    for counts in dynamo:
        assert counts["graphs"] >= 2, counts
        assert counts["graph_breaks"] and all("context parallel attention" in reason
                                              for reason in counts["graph_breaks"]), counts


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_COMPILED else n
                                  for n in COMPILED])
def test_compiled_blocks_under_cp_match_single_process(name, references, documents, tmp_path):  # noqa: F811
    run, dynamo = _train_compiled(tmp_path, name, documents["documents"])
    _assert_follows(references["documents"], run, name)
    _assert_compiled_around_attention(dynamo, COMPILED[name][0])
