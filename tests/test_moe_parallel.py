"""Mixture of experts under every layout that composes with expert parallel (PP × FSDP × TP + SP ×
EP on 8 ranks with -m slow), on real gloo processes:
the loss curve of one process (fp32, same seed and global batch, both load-balancing mechanisms on:
``model=tiny_moe``), the experts actually split by expert and width with tokens exchanged, an EP
checkpoint resumed under other EP degrees, and the load metrics; ZeRO-1 under expert parallel
(Megatron's distributed optimizer with its expert data-parallel group): the dense parameters'
gradients and state sharded over all data-parallel ranks, the experts' over the ranks holding the
same experts, and its checkpoint resumed under FSDP and the other way round."""

import pytest
from harness import FAST, TINY_MOE_EXPERT_PARAMS, train_in_one_group, train_job

MOE = ["model=tiny_moe", "train.steps=10", "logging.log_every=5"]
ZERO1_EP = ["parallel.ep=2", "parallel.zero_stage=1"]
LAYOUTS = {  # name: (world size, overrides)
    "ep2_selective_ac": (2, ["parallel.ep=2", "memory.activation_checkpointing=selective"]),
    "tp2": (2, ["parallel.tp=2"]),  # no data parallel: no FSDP, experts split by width only
    "zero1_ep2_dp2": (2, ZERO1_EP),  # each rank alone holds its experts
    # ep4 also writes the checkpoint the resume jobs below read (jobs of a group run one after
    # another)
    "ep4": (4, ["parallel.ep=4", "checkpoint.interval=5", "checkpoint.keep_last=0"]),
    "ep2_fsdp4": (
        4,
        ["parallel.ep=2"],
    ),  # dp_shard 4: experts FSDP-sharded over the 2 ranks ep leaves
    "hsdp2x2_ep2": (4, ["parallel.dp_replicate=2", "parallel.ep=2"]),
    "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"]),
    # ZeRO-1 over dp 4 (the dense parameters), its experts' buckets over the 2 ranks ep leaves; it
    # writes a checkpoint
    "zero1_ep2": (4, [*ZERO1_EP, "checkpoint.interval=5", "checkpoint.keep_last=0"]),
    # ZeRO-1 × EP inside pipeline stages, and with the experts split by width too (2-D DTensors):
    # groups of one
    "pp2_zero1_ep2": (4, ["parallel.pp=2", *ZERO1_EP]),
    "zero1_ep2_tp2_sp": (4, [*ZERO1_EP, "parallel.tp=2", "parallel.sequence_parallel=true"]),
}
# name: (the 4-rank run whose step-5 checkpoint it resumes, its overrides)
RESUMED = {
    "resumed_ep2": ("ep4", ["parallel.ep=2"]),
    "resumed_ep1": ("ep4", []),
    "resumed_zero1_ep2": ("ep4", ZERO1_EP),
    "resumed_ep4_from_zero1": ("zero1_ep2", ["parallel.ep=4"]),
}
PROBED = ("ep2_fsdp2_tp2_sp", ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"])
# 8 processes, ~6 s a step on 2 cores: slow. Its pairs are in the default run (pp2_ep2, PROBED,
# zero1_ep2_tp2_sp; PP × TP + SP in the dense parity tests).
EIGHT_RANKS = ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_job(tmp_path_factory.mktemp("moe_ref"), *FAST, *MOE)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    runs = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [name for name, (w, _) in LAYOUTS.items() if w == world]
        jobs = [(root / name, [*FAST, *MOE, *LAYOUTS[name][1]]) for name in names]
        if world == 4:  # after the runs they resume (jobs of a group run one after another)
            names += list(RESUMED)
            jobs += [
                (
                    root / name,
                    [
                        *FAST,
                        *MOE,
                        f"checkpoint.resume={root / source / 'checkpoints' / 'step-00000005'}",
                        *overrides,
                    ],
                )
                for name, (source, overrides) in RESUMED.items()
            ]
        runs.update(zip(names, train_in_one_group(jobs, nproc=world, probe_effects=world == 4)))
    name, overrides = PROBED
    runs[name] = train_job(root / name, *FAST, *MOE, *overrides, nproc=4, probe_effects=True)
    return runs


@pytest.mark.parametrize("name", [*LAYOUTS, PROBED[0]])
def test_moe_loss_matches_single_process(name, reference, layout_runs):
    _assert_follows(name, reference, layout_runs[name])


@pytest.mark.slow
def test_moe_loss_matches_single_process_under_pp_fsdp_tp_sp_and_ep_on_8_ranks(reference, tmp_path):
    run = train_job(tmp_path, *FAST, *MOE, *EIGHT_RANKS, nproc=8)
    _assert_follows("pp2_fsdp2_tp2_sp_ep2", reference, run)


def _assert_follows(name, reference, run):
    assert len(reference.losses) == len(run.losses) == 10
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, (
        f"{name}: per-step |Δloss| {diffs}\nref {reference.losses}\ngot {run.losses}"
    )
    grad_diffs = [
        abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference.metrics, run.metrics)
    ]
    assert max(grad_diffs) < 1e-3, f"{name}: grad norms differ {grad_diffs}"
    # The routing statistics are global: the same load and auxiliary loss as one process.
    for key in ("moe_aux_loss", "expert_load_max", "expert_load_min"):
        assert abs(run.metrics[-1][key] - reference.metrics[-1][key]) < 1e-4, (name, key)
    assert reference.losses[-1] < reference.losses[0]


def test_moe_metrics_and_active_flops(reference):
    record, info = reference.metrics[-1], reference.run_info
    assert 0.9 < record["moe_aux_loss"] < 2.0, record  # 1.0 is perfectly balanced
    assert record["expert_load_max"] >= 1.0 >= record["expert_load_min"] >= 0.0
    # tiny_moe: 3 MoE layers × 8 experts of 3 × 64 × 64 weights; a token goes through 2 of them
    inactive = 3 * 6 * 3 * 64 * 64
    assert info["num_params"] - info["num_active_params"] == inactive
    # counts the active parameters only
    assert info["flops_per_token"] < 6 * (info["num_params"] - 512 * 64)


def test_experts_split_by_expert_and_width(layout_runs):
    """ep=2 × tp=2 (+SP) on 4 ranks with dp_shard=2: each rank holds 4 of the 8 experts at half
    their width, FSDP gives the experts a unit of their own over the one rank ep leaves of dp_shard,
    the router stays whole over TP, and tokens crossed ranks by all-to-all (forward: one exchange
    each way per MoE layer and micro-batch)."""
    effects = layout_runs[PROBED[0]].effects
    assert len(effects) == 4
    for rank in effects:
        layers = rank["moe_layers"]
        assert len(layers) == 3  # tiny_moe: layer 0 dense, 1-3 MoE
        for layer in layers:
            # [experts/ep, hidden/tp, dim]
            assert layer["experts_local_shape"] == [4, 32, 64], layer
            assert layer["experts_own_fsdp_group_size"] == 1, layer
            assert layer["ep_group_size"] == 2
            # one shared expert [64, 64], column-split over tp, then FSDP-sharded over dp_shard=2
            # with the block
            assert layer["shared_local_shape"] == [16, 64]
            # whole on every TP rank (FSDP shards it over dp)
            assert layer["gate_placements"][-1] == "R", layer
        # forward: 2 exchanges per layer and micro-batch; 3 layers, 2 micro-batches per rank (8 / dp
        # 2 / 2)
        assert rank["all_to_all"]["calls"] == 2 * 3 * 2, rank["all_to_all"]
        assert rank["all_to_all"]["rows_sent"] > 0


def test_expert_parallel_checkpoint_resumes_under_other_degrees(reference, layout_runs):
    """The checkpoint ep=4 wrote at step 5 resumes under ep=2 (× FSDP), ep=1 (FSDP over 4) and
    ZeRO-1 × ep=2, and ZeRO-1 × ep=2's under ep=4, on the straight curve: expert weights, their
    optimizer state and the balancing bias re-shard like every other parameter."""
    for name in RESUMED:
        resumed = layout_runs[name]
        assert [m["step"] for m in resumed.metrics] == list(range(6, 11)), name
        diffs = [abs(a - b["loss"]) for a, b in zip(reference.losses[5:], resumed.metrics)]
        assert max(diffs) < 1e-4, f"{name}: {diffs}"


def test_zero1_under_expert_parallel_shards_experts_over_their_replicas(layout_runs):
    """ZeRO-1 × ep=2 on 4 ranks: the dense parameters' gradients are reduce-scattered over all 4
    data-parallel ranks and their Adam state is a quarter of them; each rank's 4 experts of 8 (ep=2)
    over the 2 ranks that hold the same experts, their state a half of those; one all-gather of each
    back. Nothing goes through FSDP. Model state per rank is what that sharding holds (fp32
    parameters and gradient buckets whole, Adam moments and reduced slices sharded)."""
    experts = TINY_MOE_EXPERT_PARAMS
    run = layout_runs["zero1_ep2"]
    dense = run.run_info["num_params"] - experts
    mine = experts // 2  # this rank's experts under ep=2
    assert len(run.effects) == 4
    for rank in run.effects:
        assert rank["fsdp"] == [], rank["fsdp"]
        assert sorted((b["group_size"], b["elements"]) for b in rank["zero1_buckets"]) == [
            (2, mine),
            (4, dense),
        ]
        # one step: every gradient reduced once (the whole buckets went in, padded to the group),
        # every updated slice gathered once
        reduced = rank["collective_elements_by_group"]["reduce_scatter"]
        gathered = rank["collective_elements_by_group"]["all_gather"]
        assert reduced == {"4": dense, "2": mine}, reduced
        assert gathered == {"4": dense // 4, "2": mine // 2}, gathered
        moments = sum(s["numel"] for s in rank["optimizer_state"] if s["key"] == "exp_avg")
        assert moments == dense // 4 + mine // 2, moments
    expected = 8 * dense + 12 * dense / 4 + 8 * mine + 12 * mine / 2
    measured = run.run_info["model_state_bytes_per_rank"]
    assert abs(measured - expected) / expected < 0.01, (measured, expected)
