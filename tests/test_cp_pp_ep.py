"""Context parallel composed with pipeline parallel (each microbatch carries its cp chunks through
every stage) and with expert parallel (ep takes every cp rank and more from dp_shard; the
sequence-wise auxiliary loss counts the choices of the whole sequence over cp).

Loss parity with one process over 10 steps (fp32, gloo): ``model=tiny model.n_layers=4
train.seq_len=256`` under PP 2 × cp 2, PP 2 × FSDP 2 × cp 2 and PP 2 × TP 2 + SP × cp 2, with
document masking on and off; ``model=tiny_moe`` (the MoE parallel tests' settings) under FSDP × cp ×
EP, TP + SP × cp × EP and PP × FSDP × cp × EP on 8 ranks; the MoE load metrics and auxiliary loss
equal the one-process ones; PP 2 × cp 2 with ZeRO-1, and it and FSDP × cp × EP compiled; ZeRO-1 × cp
× EP. What each switch did is read from the ranks (``effects``): the tokens and heads each stage's
attention held, its residual stream's tokens and the ranks it spanned, the experts each rank holds
and the ranks their tokens travel between; ZeRO-1's optimizer state is read from the model state
each rank holds, its buckets' groups from its reduce-scatters.
"""

import json

import pytest
import torch
import torch.distributed as dist
from harness import (
    FAST,
    TINY_MOE_EXPERT_PARAMS,
    RunResult,
    assert_follows,
    compiled_jobs,
    composed_jobs,
    processes,
    spawn,
    train_in_one_group,
)
from test_context_parallel import MASKING, corpus, documents  # noqa: F401  (fixtures: short packed documents)

STEPS = ["train.steps=10", "logging.log_every=5"]
DENSE = [
    *(o for o in FAST if not o.startswith("train.seq_len=")),
    "model.n_layers=4",
    "train.seq_len=256",
]
MOE = [
    *FAST,
    "model=tiny_moe",
]  # as tests/test_moe_parallel.py: seq 64, both load-balancing mechanisms on
LAYOUTS = {  # name: (world size, cp, model, overrides, masking kinds in the default run)
    "pp2_cp2": (
        4,
        2,
        DENSE,
        ["parallel.pp=2", "parallel.dp_shard=1", "parallel.cp=2"],
        # without document masking: slow (cp's styles and compositions show it in
        # tests/test_context_parallel.py)
        ("documents",),
    ),
    # TP 2 + SP × cp 2 × EP 2 (the cp ranks): the experts split by width over tp too
    "moe_tp2_sp_cp2_ep2": (
        4,
        2,
        MOE,
        [
            "parallel.dp_shard=1",
            "parallel.cp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
        ("documents",),
    ),
    # ZeRO-1 under PP × cp: each stage's optimizer state sharded over its cp ranks
    "pp2_cp2_zero1": (
        4,
        2,
        DENSE,
        ["parallel.pp=2", "parallel.dp_shard=1", "parallel.cp=2", "parallel.zero_stage=1"],
        ("documents",),
    ),
    # ZeRO-1 × cp 2 × EP 2 (the cp ranks): the dense state sharded over dp × cp = 4, the experts'
    # over dp_shard's 2
    "moe_fsdp2_cp2_ep2_zero1": (
        4,
        2,
        MOE,
        ["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1"],
        ("documents",),
    ),
    # ep 4 = the 2 cp ranks × the 2 of dp_shard: the experts' tokens cross both
    "moe_fsdp2_cp2_ep4": (
        4,
        2,
        MOE,
        ["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=4"],
        ("documents",),
    ),
    # on 8 ranks (slow: their parts are the runs above and tests/test_context_parallel.py's cp ×
    # FSDP)
    "pp2_fsdp2_cp2": (8, 2, DENSE, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.cp=2"], ()),
    # PP 2 × TP 2 + SP × cp 2: each stage's attention over its cp group with its tp rank's heads
    # (FSDP over cp)
    "pp2_tp2_sp_cp2": (
        8,
        2,
        DENSE,
        [
            "parallel.pp=2",
            "parallel.dp_shard=1",
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
        (),
    ),
    # zero bubble, V-shaped: two stages a rank, weight gradients apart from the input gradients the
    # ring passes back
    "pp2_cp2_zbv": (
        4,
        2,
        DENSE,
        ["parallel.pp=2", "parallel.dp_shard=1", "parallel.cp=2", "parallel.pp_schedule=zbv"],
        (),
    ),
    # ep 4 = the 2 cp ranks × 2 of dp_shard's 4; the experts FSDP-sharded over the 2 that ep leaves
    "moe_fsdp4_cp2_ep4": (8, 2, MOE, ["parallel.dp_shard=4", "parallel.cp=2", "parallel.ep=4"], ()),
    # ep 2 = the cp ranks alone; the experts FSDP-sharded over dp_shard
    "moe_pp2_fsdp2_cp2_ep2": (
        8,
        2,
        MOE,
        ["parallel.pp=2", "parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"],
        (),
    ),
}
# Compositions whose parts the default run checks (PP × cp, EP × cp, FSDP × cp, masking on and off):
# slow.
SLOW = [
    (name, kind) for name, (*_, kinds) in LAYOUTS.items() for kind in MASKING if kind not in kinds
]
CASES = [
    pytest.param(name, kind, marks=[pytest.mark.slow] if (name, kind) in SLOW else [])
    for name in LAYOUTS
    for kind in MASKING
]


def _model(name: str) -> str:
    return "moe" if name.startswith("moe") else "dense"


def _run_all(root, documents, keys, known: dict) -> dict:
    """References (one process; those not ``known``) and the layouts of ``keys``, those of a world
    size in one process group."""
    runs = dict(known)
    references = sorted({(_model(name), kind) for name, kind in keys} - set(known))
    jobs = [
        (
            ref,
            root / f"ref_{ref[0]}_{ref[1]}",
            [*(DENSE if ref[0] == "dense" else MOE), *STEPS, *documents[ref[1]]],
        )
        for ref in references
    ]
    runs.update(
        zip([key for key, _, _ in jobs], train_in_one_group([(d, o) for _, d, o in jobs], nproc=1))
    )
    for world in sorted({LAYOUTS[name][0] for name, _ in keys}):
        jobs = [
            (
                (name, kind),
                root / f"{name}_{kind}",
                [*LAYOUTS[name][2], *STEPS, *LAYOUTS[name][3], *documents[kind]],
            )
            for name, kind in keys
            if LAYOUTS[name][0] == world
        ]
        results = train_in_one_group([(d, o) for _, d, o in jobs], nproc=world, probe_effects=True)
        runs.update(zip([key for key, _, _ in jobs], results))
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, documents):  # noqa: F811
    keys = [(name, kind) for name, (*_, kinds) in LAYOUTS.items() for kind in kinds]
    return _run_all(tmp_path_factory.mktemp("cp_pp_ep"), documents, keys, {})


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, documents, runs):  # noqa: F811
    return _run_all(tmp_path_factory.mktemp("cp_pp_ep_slow"), documents, SLOW, runs)


def _run(request, name: str, kind: str):
    found = request.getfixturevalue("slow_runs" if (name, kind) in SLOW else "runs")
    return found[(_model(name), kind)], found[(name, kind)]


@pytest.mark.parametrize("name, kind", CASES)
def test_cp_with_pp_and_ep_matches_single_process(name, kind, request):
    reference, run = _run(request, name, kind)
    assert_follows(reference, run, f"{name} ({kind})")
    world, cp, _, overrides, _ = LAYOUTS[name]
    layout = run.run_info["layout"]
    assert layout["cp"] == cp and layout["pp"] == (2 if "parallel.pp=2" in overrides else 1), layout
    assert layout["tp"] == (2 if "parallel.tp=2" in overrides else 1), layout
    # routing statistics over the whole sequences: the one-process load and aux loss
    if _model(name) == "moe":
        for key in ("moe_aux_loss", "expert_load_max", "expert_load_min"):
            for step, (a, b) in enumerate(zip(reference.metrics, run.metrics)):
                assert abs(a[key] - b[key]) < 1e-4, (name, key, step, a[key], b[key])


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.slow] if not LAYOUTS[n][4] else [])
        for n in LAYOUTS
        if "pp2" in n
    ],
)
def test_each_stage_attends_over_its_cp_group(name, request):
    """Every rank runs attention only in its stage's blocks, over its seq/cp tokens of each
    sequence, with the keys of the cp ranks that hold the same stage (the ranks of a cp group run
    the same blocks); under TP its tp rank's share of the 8 query and 4 key heads, and under
    sequence parallel a residual stream of seq/(cp·tp) tokens."""
    effects = _run(request, name, "documents")[1].effects
    world, cp, _, overrides, _ = LAYOUTS[name]
    seq = 256 if _model(name) == "dense" else 64
    tp = 2 if "parallel.tp=2" in overrides else 1
    residual = seq // cp // (tp if "parallel.sequence_parallel=true" in overrides else 1)
    assert len(effects) == world
    by_rank = {rank["rank"]: rank for rank in effects}
    stages = {tuple(rank["attention"]) for rank in effects}
    assert len(stages) == 2 and sorted(b for s in stages for b in s) == ["0", "1", "2", "3"], stages
    for rank in effects:
        for block in rank["attention"].values():
            assert block["tokens"] == seq // cp and block["residual_tokens"] == residual, block
            assert block["heads"] == [8 // tp, 4 // tp], block
            assert len(block["cp_ranks"]) == cp and rank["rank"] in block["cp_ranks"], block
            assert all(
                by_rank[peer]["attention"].keys() == rank["attention"].keys()
                for peer in block["cp_ranks"]
            )


def test_zero1_shards_each_stages_optimizer_over_its_cp_ranks(runs):
    """ZeRO-1 under PP 2 × cp 2 keeps a stage's parameters and gradients whole (4 + 4 bytes a
    parameter) and shards its optimizer state over the stage's 2 cp ranks (8 / 2, and the reduced
    gradient slice's 4 / 2): 14 bytes a parameter, against FSDP's 16 / 2 under PP 2 × cp 2 (20 if
    the optimizer were not sharded)."""
    zero1 = runs[("pp2_cp2_zero1", "documents")].run_info
    fsdp = runs[("pp2_cp2", "documents")].run_info
    assert zero1["zero_stage"] == 1 and fsdp["zero_stage"] == 3
    ratio = zero1["model_state_bytes_per_rank"] / fsdp["model_state_bytes_per_rank"]
    assert ratio == pytest.approx(14 / 8, rel=0.02), (zero1, fsdp)


def test_zero1_under_cp_and_ep_shards_experts_over_the_ranks_holding_them(runs):
    """ZeRO-1 × cp 2 × EP 2 on 4 ranks: ep takes the cp ranks, so each rank holds 4 of each MoE
    layer's 8 experts, the same 4 as the rank of its cp group's twin in dp_shard; their gradients
    and state are sharded over those 2 ranks, every other parameter's over all 4 (dp × cp); nothing
    is FSDP's."""
    run = runs[("moe_fsdp2_cp2_ep2_zero1", "documents")]
    experts = TINY_MOE_EXPERT_PARAMS
    dense = run.run_info["num_params"] - experts
    assert len(run.effects) == 4
    for rank in run.effects:
        assert rank["fsdp"] == [] and all(
            layer["ep_group_size"] == 2 for layer in rank["moe_layers"]
        )
        assert sorted((b["group_size"], b["elements"]) for b in rank["zero1_buckets"]) == [
            (2, experts // 2),
            (4, dense),
        ]
        assert rank["collective_elements_by_group"]["reduce_scatter"] == {
            "4": dense,
            "2": experts // 2,
        }


# name: (model, overrides): compiled blocks under cp with PP, and with FSDP × EP. The MoE model's
# layers are all MoE here: dynamo compiles the code after cp's attention once per kind of block, and
# a dense first layer would count as a recompile (in the first step, but error_on_recompile fails on
# any)
COMPILED = {
    "pp2_cp2_compiled": ("dense", [], ["parallel.pp=2", "parallel.dp_shard=1", "parallel.cp=2"]),
    "moe_fsdp2_cp2_ep4_compiled": (
        "moe",
        ["model.moe.dense_layers=0"],
        ["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=4"],
    ),
}


# where compiled blocks break their graphs: cp's attention, run eagerly; in a MoE block EP's
# all-to-all too (its splits change with every batch)
EAGER = {
    "dense": ("context parallel attention",),
    "moe": ("context parallel attention", "expert parallel all-to-all"),
}


# PP 2 × cp 2 compiled: slow, as its parts run by default (compiled blocks under PP in
# tests/test_memory_precision.py, under cp with FSDP and EP here)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name == "pp2_cp2_compiled" else [])
        for name in COMPILED
    ],
)
def test_compiled_blocks_under_cp_follow_one_process(name, runs, documents, tmp_path):  # noqa: F811
    """Compiled blocks (through inductor, cp's attention run eagerly between their graphs) under PP
    2 × cp 2 and under FSDP 2 × cp 2 × EP 4, packed documents: the one-process curve (and the MoE's
    auxiliary loss); every rank compiled graphs, ran cp's attention (and EP's all-to-all) eagerly
    between them, and compiled nothing again at a later step (dynamo fails the run if it does);
    nothing else breaks the graphs (the router reads its settings as constants, counts the experts'
    tokens in a shape of its own)."""
    model, variant, layout = COMPILED[name]
    run_dir, report = tmp_path / name, tmp_path / "dynamo"
    report.mkdir()
    trained = [*(DENSE if model == "dense" else MOE), *STEPS, *variant, *documents["documents"]]
    reference = (
        train_in_one_group([(tmp_path / "reference", trained)], nproc=1)[0]
        if variant
        else runs[(model, "documents")]
    )
    # the job's rendezvous
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    processes(
        compiled_jobs,
        4,
        4,
        composed_jobs([(run_dir, [*trained, *layout, "compile.enabled=true"])], 4),
        [store.port],
        str(report),
    )
    run = RunResult(0, "", 0.0, run_dir)
    assert_follows(reference, run, name)
    if model == "moe":
        aux = [
            abs(a["moe_aux_loss"] - b["moe_aux_loss"])
            for a, b in zip(reference.metrics, run.metrics)
        ]
        assert max(aux) < 1e-4, aux
    assert run.run_info["layout"]["cp"] == 2, run.run_info["layout"]
    counts = [json.loads(path.read_text()) for path in sorted(report.glob("rank*.json"))]
    assert len(counts) == 4
    for rank in counts:
        breaks = rank["graph_breaks"]
        assert rank["graphs"] >= 2, rank
        assert all(any(reason in why for why in breaks) for reason in EAGER[model]), rank
        # and nothing else
        assert all(any(reason in why for reason in EAGER[model]) for why in breaks), rank


@pytest.mark.parametrize(
    "name, ep, expert_dp",
    [
        ("moe_fsdp2_cp2_ep4", 4, 1),
        ("moe_tp2_sp_cp2_ep2", 2, 1),
        pytest.param("moe_fsdp4_cp2_ep4", 4, 2, marks=pytest.mark.slow),
        pytest.param("moe_pp2_fsdp2_cp2_ep2", 2, 2, marks=pytest.mark.slow),
    ],
)
def test_experts_take_the_cp_ranks(name, ep, expert_dp, request):
    """Under cp the ep group holds every cp rank of a sequence (its tokens meet at the same
    experts): each rank holds 8/ep experts of each of its MoE layers, FSDP-sharded over what ep
    leaves of dp_shard, and tokens crossed ranks."""
    effects = _run(request, name, "documents")[1].effects
    assert len(effects) == LAYOUTS[name][0]
    for rank in effects:
        cp_ranks = next(iter(rank["attention"].values()))["cp_ranks"]
        assert rank["moe_layers"], rank["rank"]
        for layer in rank["moe_layers"]:
            assert layer["ep_group_size"] == ep and set(cp_ranks) <= set(layer["ep_ranks"]), (
                layer,
                cp_ranks,
            )
            assert layer["experts_local_shape"][0] == 8 // ep // expert_dp, layer
            assert layer["experts_own_fsdp_group_size"] == expert_dp, layer
        assert rank["all_to_all"]["calls"] > 0 and rank["all_to_all"]["rows_sent"] > 0, rank[
            "all_to_all"
        ]


# ----------------------------------------------------------------- the auxiliary loss over cp ranks


def _aux_over_cp(rank: int, world: int, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from composer3d.config.schema import MoEConfig
    from composer3d.models.moe import MoE
    from composer3d.parallel.context.context_parallel import ContextParallel

    torch.manual_seed(0)
    moe = MoE(
        16,
        32,
        MoEConfig(experts=4, top_k=2, shared_experts=0, expert_hidden_dim=32, aux_loss_coef=0.01),
    )
    scores = torch.randn(2, 32, 4).softmax(-1)  # (batch, seq, experts), the same on every rank
    chosen = scores.topk(2, dim=-1).indices
    context = ContextParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"])
    share = lambda t: context.shard(t).reshape(-1, t.shape[-1])  # noqa: E731  (this rank's tokens, flattened)
    full = moe._sequence_aux_losses(scores.reshape(-1, 4), chosen.reshape(-1, 2), 2, 32)
    # no cp group: its chunks only
    alone = moe._sequence_aux_losses(share(scores), share(chosen), 2, 32 // world)
    moe.cp_group = context.group
    shared = moe._sequence_aux_losses(share(scores), share(chosen), 2, 32 // world)
    for losses in (shared, alone):  # summed over the cp ranks, as the loss mesh sums them
        dist.all_reduce(losses)
    results[rank] = ((shared - full).abs().max().item(), (alone - full).abs().max().item())


def test_sequence_aux_loss_counts_the_whole_sequence_over_cp(tmp_path):
    """Each cp rank's share of DeepSeek-V3's sequence-wise loss adds up over cp to the loss of the
    whole sequence; the losses of each rank's chunks alone would not (their sum is about cp times
    it)."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    spawn(_aux_over_cp, 2, tmp_path, results)
    for rank, (shared_error, alone_error) in results.items():
        assert shared_error < 1e-6, (rank, shared_error)
        assert alone_error > 0.5, (rank, alone_error)
