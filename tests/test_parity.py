"""Loss parity: every layout gives the single-process loss curve (fp32, same seed and global batch).
The reference runs through the command; the layouts through ``composer3d.commands.train.run`` as
torchrun's workers run it."""

import pytest
from harness import FAST, train_in_one_group, train_job

STEPS = ["train.steps=10"]
# A tensor-parallel step costs DTensor's dispatch per op and micro-batch (about 0.12 s a micro-batch
# of the tiny model on 2 cores): the layouts without data parallelism take the global batch as one
# micro-batch. Accumulation under TP is fsdp2_tp2_sp's (2 micro-batches a rank) and the reference's
# (4).
ONE_MICRO_BATCH = "train.micro_batch_size=8"
LAYOUTS = {
    "fsdp4": ["parallel.dp_shard=4"],
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "fsdp2_tp2_sp": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2": ["parallel.tp=2", "parallel.dp_shard=1", ONE_MICRO_BATCH],
    "tp4": ["parallel.tp=4", "parallel.dp_shard=1", ONE_MICRO_BATCH],
    "zero1_dp4": ["parallel.dp_shard=4", "parallel.zero_stage=1"],
    # ZeRO-1 over DTensor (TP) parameters: slices of their local shards, sequence parallel's norm
    # gradients summed
    "zero1_dp2_tp2_sp": [
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.zero_stage=1",
        "train.micro_batch_size=4",
    ],
    "zero2_dp4": ["parallel.dp_shard=4", "parallel.zero_stage=2"],
    "ddp4": ["parallel.dp_replicate=4", "parallel.dp_shard=1"],
    # op-level selective checkpointing over SP's all-gathers: regathered in backward (default) or
    # kept
    "tp2_sp": [
        "parallel.tp=2",
        "parallel.dp_shard=1",
        "parallel.sequence_parallel=true",
        "checkpoint.enabled=false",
        ONE_MICRO_BATCH,
    ],
    "tp2_sp_ac_regather": [
        "parallel.tp=2",
        "parallel.dp_shard=1",
        "parallel.sequence_parallel=true",
        "memory.activation_checkpointing=selective",
        "memory.ac_every=0",
        "checkpoint.enabled=false",
        ONE_MICRO_BATCH,
    ],
    "tp2_sp_ac_keep_gathers": [
        "parallel.tp=2",
        "parallel.dp_shard=1",
        "parallel.sequence_parallel=true",
        "memory.activation_checkpointing=selective",
        "memory.ac_every=0",
        "memory.ac_save_gathers=true",
        "checkpoint.enabled=false",
        ONE_MICRO_BATCH,
    ],
}
WORLD = {"tp2": 2, "tp2_sp": 2, "tp2_sp_ac_regather": 2, "tp2_sp_ac_keep_gathers": 2}


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    return train_job(tmp_path_factory.mktemp("ref"), *FAST, *STEPS)


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory):
    """Every layout once per session, those of a world size one after another in one process group
    (start-up paid once); the memory tests read the same runs."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {}
    for world in sorted({WORLD.get(name, 4) for name in LAYOUTS}):
        names = [name for name in LAYOUTS if WORLD.get(name, 4) == world]
        jobs = [(root / name, [*FAST, *STEPS, *LAYOUTS[name]]) for name in names]
        runs.update(zip(names, train_in_one_group(jobs, nproc=world)))
    return runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_matches_single_process(name, reference, layout_runs):
    run = layout_runs[name]
    assert len(reference.losses) == len(run.losses) == 10
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, (
        f"{name}: per-step |Δloss| {diffs}\nref {reference.losses}\ngot {run.losses}"
    )
    grad_diffs = [
        abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference.metrics, run.metrics)
    ]
    assert max(grad_diffs) < 1e-3, f"{name}: grad norms differ {grad_diffs}"
    assert reference.losses[-1] < reference.losses[0], "the reference itself should learn"


def test_the_run_ends_with_what_it_trained_and_where_it_saved(reference):
    """The last line of a run: its step of train.steps, the tokens and time of this run, the final
    loss as logged, the last checkpoint."""
    last = reference.output.strip().splitlines()[-1]
    head, tail = last.split(" finished: ", 1)[1].split(" tokens in ", 1)
    assert head == "step 10 of train.steps=10 (10 this run: 5,120", last  # 10 steps of 8 × 64
    assert tail.endswith(
        f"; final loss {reference.losses[-1]:.4f}; last checkpoint "
        f"{reference.run_dir / 'checkpoints' / 'step-00000010'}"
    ), last


def test_zero1_curve_equals_zero3_and_one_process(reference, layout_runs):
    """ZeRO-1's reduce-scatter of bucketed gradients sums them as FSDP's does: fp32 curves equal to
    1e-5."""
    for other in (reference, layout_runs["fsdp4"]):
        diffs = [abs(a - b) for a, b in zip(other.losses, layout_runs["zero1_dp4"].losses)]
        assert len(diffs) == 10 and max(diffs) < 1e-5, diffs


def test_regathering_in_backward_keeps_the_curve(layout_runs):
    """Op-level selective checkpointing under tp=2 + SP, its all-gathers redone in backward or kept
    (memory.ac_save_gathers): the same losses and gradient norms as each other, exactly (the
    recomputed gather returns the same shards), and as the run without checkpointing (fp32
    rounding)."""
    plain, regather, keep = (
        layout_runs[n] for n in ("tp2_sp", "tp2_sp_ac_regather", "tp2_sp_ac_keep_gathers")
    )
    assert len(regather.metrics) == len(keep.metrics) == len(plain.metrics) == 10
    for a, b in zip(regather.metrics, keep.metrics):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)
    for a, b in zip(plain.metrics, regather.metrics):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6, (
            a,
            b,
        )


# Model-state bytes per rank (fp32 param + grad + 2 Adam moments = 16 bytes per parameter), by
# layout. P: all parameters; N: data-parallel ranks sharding them. Adam's per-parameter 'step'
# scalars add a few bytes.
# RMSNorm weights: the parameters tensor parallel leaves whole (2 per block + final)
def _norm_params(
    info,
):
    return (2 * 2 + 1) * 64  # tiny: 2 layers, dim 64


@pytest.mark.parametrize(
    "name, formula",
    [
        ("fsdp4", lambda P, info: 16 * P / 4),  # ZeRO-3: everything sharded
        (
            "zero2_dp4",
            lambda P, info: 16 * P / 4,
        ),  # FSDP2 ZeRO-2: sharded at rest, gathered fwd→bwd only
        # ZeRO-1: params and gradient buckets replicated; Adam state and the reduced gradient slices
        # sharded
        ("zero1_dp4", lambda P, info: 8 * P + 12 * P / 4),
        ("hsdp2x2", lambda P, info: 16 * P / 2),  # HSDP: sharded over the 2 ranks of dp_shard
        ("ddp4", lambda P, info: 16 * P),  # DDP: everything replicated
        (
            "tp4",
            lambda P, info: 16 * ((P - _norm_params(info)) / 4 + _norm_params(info)),
        ),  # TP: all but norms split
    ],
)
def test_model_state_bytes_per_rank(name, formula, layout_runs):
    info = layout_runs[name].run_info
    expected = formula(info["num_params"], info)
    measured = info["model_state_bytes_per_rank"]
    assert abs(measured - expected) / expected < 0.05, (
        f"{name}: measured {measured} vs formula {expected:.0f}"
    )


def test_tied_embeddings_parity(tmp_path):
    """A head tied to the embedding stays one parameter under TP (vocab-sharded) and FSDP: same
    curve."""
    tied = ["model.tie_embeddings=true", "train.steps=6"]
    ref = train_job(tmp_path / "ref", *FAST, *tied)
    run = train_job(tmp_path / "tp", *FAST, *tied, *LAYOUTS["fsdp2_tp2_sp"], nproc=4)
    assert max(abs(a - b) for a, b in zip(ref.losses, run.losses)) < 1e-4, (ref.losses, run.losses)
    assert run.run_info["num_params"] == ref.run_info["num_params"]
