"""Mixture of experts under every layout that composes with expert parallel, on real gloo processes: the loss curve of
one process (fp32, same seed and global batch, both load-balancing mechanisms on: ``model=tiny_moe``), the experts
actually split by expert and width with tokens exchanged, an EP checkpoint resumed under other EP degrees, and the
load metrics."""

import pytest
from harness import FAST, train, train_in_one_group

MOE = ["model=tiny_moe", "train.steps=10", "logging.log_every=5"]
LAYOUTS = {  # name: (world size, overrides)
    "ep2_selective_ac": (2, ["parallel.ep=2", "memory.activation_checkpointing=selective"]),
    "tp2": (2, ["parallel.tp=2"]),  # no data parallel: no FSDP, experts split by width only
    # ep4 also writes the checkpoint the resume jobs below read (jobs of a group run one after another)
    "ep4": (4, ["parallel.ep=4", "checkpoint.interval=5", "checkpoint.keep_last=0"]),
    "ep2_fsdp4": (4, ["parallel.ep=2"]),  # dp_shard 4: experts FSDP-sharded over the 2 ranks ep leaves
    "hsdp2x2_ep2": (4, ["parallel.dp_replicate=2", "parallel.ep=2"]),
    "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"]),
    "pp2_fsdp2_tp2_sp_ep2": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]),
}
RESUMED = {"resumed_ep2": ["parallel.ep=2"], "resumed_ep1": []}  # from ep4's step 5, on its 4 ranks
PROBED = ("ep2_fsdp2_tp2_sp", ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("moe_ref"), *FAST, *MOE)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    runs = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [name for name, (w, _) in LAYOUTS.items() if w == world]
        jobs = [(root / name, [*FAST, *MOE, *LAYOUTS[name][1]]) for name in names]
        if world == 4:
            step5 = root / "ep4" / "checkpoints" / "step-00000005"
            names += list(RESUMED)
            jobs += [(root / name, [*FAST, *MOE, f"checkpoint.resume={step5}", *overrides])
                     for name, overrides in RESUMED.items()]
        runs.update(zip(names, train_in_one_group(jobs, nproc=world)))
    name, overrides = PROBED
    runs[name] = train(root / name, *FAST, *MOE, *overrides, nproc=4, probe_effects=True)
    return runs


@pytest.mark.parametrize("name", [*LAYOUTS, PROBED[0]])
def test_moe_loss_matches_single_process(name, reference, layout_runs):
    run = layout_runs[name]
    assert len(reference.losses) == len(run.losses) == 10
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, f"{name}: per-step |Δloss| {diffs}\nref {reference.losses}\ngot {run.losses}"
    grad_diffs = [abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference.metrics, run.metrics)]
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
    assert info["flops_per_token"] < 6 * (info["num_params"] - 512 * 64)  # counts the active parameters only


def test_experts_split_by_expert_and_width(layout_runs):
    """ep=2 × tp=2 (+SP) on 4 ranks with dp_shard=2: each rank holds 4 of the 8 experts at half their width, FSDP gives
    the experts a unit of their own over the one rank ep leaves of dp_shard, the router stays whole over TP, and
    tokens crossed ranks by all-to-all (forward: one exchange each way per MoE layer and micro-batch)."""
    effects = layout_runs[PROBED[0]].effects
    assert len(effects) == 4
    for rank in effects:
        layers = rank["moe_layers"]
        assert len(layers) == 3  # tiny_moe: layer 0 dense, 1-3 MoE
        for layer in layers:
            assert layer["experts_local_shape"] == [4, 32, 64], layer  # [experts/ep, hidden/tp, dim]
            assert layer["experts_own_fsdp_group_size"] == 1, layer
            assert layer["ep_group_size"] == 2
            # one shared expert [64, 64], column-split over tp, then FSDP-sharded over dp_shard=2 with the block
            assert layer["shared_local_shape"] == [16, 64]
            assert layer["gate_placements"][-1] == "R", layer  # whole on every TP rank (FSDP shards it over dp)
        # forward: 2 exchanges per layer and micro-batch; 3 layers, 2 micro-batches per rank (8 / dp 2 / 2)
        assert rank["all_to_all"]["calls"] == 2 * 3 * 2, rank["all_to_all"]
        assert rank["all_to_all"]["rows_sent"] > 0


def test_expert_parallel_checkpoint_resumes_under_other_degrees(reference, layout_runs):
    """The checkpoint ep=4 wrote at step 5 resumes under ep=2 (× FSDP) and ep=1 (FSDP over 4) on the straight curve:
    expert weights, their optimizer state and the balancing bias re-shard like every other parameter."""
    for name in RESUMED:
        resumed = layout_runs[name]
        assert [m["step"] for m in resumed.metrics] == list(range(6, 11)), name
        diffs = [abs(a - b["loss"]) for a, b in zip(reference.losses[5:], resumed.metrics)]
        assert max(diffs) < 1e-4, f"{name}: {diffs}"
