"""Pipeline parallel: every torch schedule, and PP composed with FSDP, HSDP, TP+SP, matches one
process."""

import itertools
import random

import pytest
from harness import FAST, RunResult, train_command, train_in_one_group, train_job

from composer3d.parallel.pipeline.schedules import (
    SCHEDULES,
    schedule_problem,
    split_layers,
    stage_ids_of_rank,
)

FOUR_LAYERS = [*FAST, "model.n_layers=4", "train.steps=10"]
EIGHT_LAYERS = [*FAST, "model.n_layers=8", "train.steps=10"]


@pytest.fixture(scope="module")
def reference4(tmp_path_factory):
    return train_job(tmp_path_factory.mktemp("ref4"), *FOUR_LAYERS)


def _assert_parity(reference, run):
    assert len(run.losses) == len(reference.losses) == 10
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, f"|Δloss| per step {diffs}"
    grad_diffs = [
        abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference.metrics, run.metrics)
    ]
    assert max(grad_diffs) < 1e-3, f"grad norms (clipped over pp too) differ: {grad_diffs}"


COMPOSED = {
    "pp2_fsdp2": (["parallel.pp=2", "parallel.dp_shard=2"], 4),
    "pp2_fsdp2_tp2_sp": (
        [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
        8,
    ),
    "pp2_ddp2_tp2_interleaved": (
        [
            "parallel.pp=2",
            "parallel.dp_replicate=2",
            "parallel.dp_shard=1",
            "parallel.tp=2",
            "parallel.pp_schedule=interleaved_1f1b",
        ],
        8,
    ),
    "pp2_zero1_dp2": (["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=1"], 4),
}


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> dict[str, RunResult]:
    """Every schedule on 2 ranks, and PP composed with the other dimensions on 4 and 8, each world
    size's runs one after another in one process group (start-up paid once)."""
    root = tmp_path_factory.mktemp("pp")
    jobs = {
        2: {
            f"pp2_{s}": [*FOUR_LAYERS, "parallel.pp=2", f"parallel.pp_schedule={s}"]
            for s in SCHEDULES
        }
    }
    for name, (layout, nproc) in COMPOSED.items():
        jobs.setdefault(nproc, {})[name] = [*FOUR_LAYERS, *layout]
    runs = {}
    for nproc, named in sorted(jobs.items()):
        runs.update(
            zip(named, train_in_one_group([(root / n, o) for n, o in named.items()], nproc=nproc))
        )
    return runs


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp2_schedule_matches_single_process(reference4, pipeline_runs, schedule):
    run = pipeline_runs[f"pp2_{schedule}"]
    _assert_parity(reference4, run)
    assert run.run_info["layout"]["pp"] == 2


@pytest.mark.parametrize("name", COMPOSED)
def test_pp_composed_with_data_and_tensor_parallel(reference4, pipeline_runs, name):
    _assert_parity(reference4, pipeline_runs[name])


def test_pp4_interleaved_two_stages_per_rank(tmp_path):
    reference = train_job(tmp_path / "ref", *EIGHT_LAYERS, "train.global_batch_size=16")
    run = train_job(
        tmp_path / "pp4",
        *EIGHT_LAYERS,
        "train.global_batch_size=16",
        "parallel.pp=4",
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_stages_per_rank=2",
        nproc=4,
    )
    _assert_parity(reference, run)


def test_split_balances_cost_and_allows_uneven_stages():
    # A heavy last layer (it carries the head) gets a stage of its own; every stage keeps at least
    # one layer.
    assert split_layers([1, 1, 1, 1, 4], 2) == [range(0, 4), range(4, 5)]
    ranges = split_layers([5, 1, 1, 1, 1, 1, 1, 5], 4)
    assert [len(r) for r in ranges] == [1, 3, 3, 1]


def test_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.randint(1, 9) for _ in range(rng.randint(2, 8))]
        stages = rng.randint(1, len(costs))
        ranges = split_layers(costs, stages)
        assert [i for r in ranges for i in r] == list(range(len(costs))) and all(
            len(r) > 0 for r in ranges
        )
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        assert max(sum(costs[i] for i in r) for r in ranges) == best


def test_stage_placement_looped_and_v_shaped():
    assert stage_ids_of_rank(1, pp=4, stages_per_rank=2, schedule="interleaved_1f1b") == [1, 5]
    assert stage_ids_of_rank(0, pp=4, stages_per_rank=2, schedule="zbv") == [0, 7]
    assert stage_ids_of_rank(3, pp=4, stages_per_rank=2, schedule="dualpipev") == [3, 4]


def test_schedule_requirements_are_known_before_launch():
    assert schedule_problem("1f1b", pp=4, stages_per_rank=1, microbatches=2) is not None
    assert schedule_problem("gpipe", pp=4, stages_per_rank=1, microbatches=2) is None
    assert "2 stages per rank" in schedule_problem("zbv", pp=2, stages_per_rank=1, microbatches=4)
    assert schedule_problem("dualpipev", pp=2, stages_per_rank=2, microbatches=3) is not None
    assert schedule_problem("interleaved_1f1b", pp=2, stages_per_rank=2, microbatches=5) is not None
    assert schedule_problem("interleaved_1f1b", pp=2, stages_per_rank=2, microbatches=4) is None


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (
            ["model.n_layers=2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
            "parallel.pp",
            "4 stages",
        ),
        (
            [
                "parallel.pp=4",
                "parallel.dp_shard=1",
                "model.n_layers=4",
                "train.global_batch_size=4",
                "train.micro_batch_size=2",
            ],
            "parallel.pp_microbatches",
            "at least as many microbatches",
        ),
        (
            ["parallel.pp=2", "model.n_layers=4", "parallel.pp_microbatches=3"],
            "parallel.pp_microbatches",
            "do not divide",
        ),
        (
            ["parallel.pp=2", "model.n_layers=4", "parallel.pp_schedule=pipedream"],
            "parallel.pp_schedule",
            "zbv",
        ),
        (
            [
                "parallel.pp=2",
                "model.n_layers=4",
                "model.tie_embeddings=true",
                "parallel.pp_schedule=zbv",
            ],
            "parallel.pp_schedule",
            "one parameter in two stages",
        ),
    ],
)
def test_bad_pipeline_configs_fail_fast(monkeypatch, capfd, tmp_path, overrides, key, fragment):
    nproc = 4 if "parallel.pp=4" in overrides else 2
    run = train_command(monkeypatch, capfd, tmp_path, *FAST, *overrides, nproc=nproc)
    assert run.returncode == 2, run.output[-2000:]
    assert f"invalid configuration: {key}:" in run.output and fragment in run.output, run.output[
        -2000:
    ]
