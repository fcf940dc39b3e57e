"""composer3d-plan's calibration: ``plan.calibrate=FILE`` times a layout's kernels at its shapes on
this machine's device and writes their rates; ``plan.calibration=FILE`` puts them in place of the
planner's constants (plan/rates.py). In one process, on the CPU: the command's file at a tiny
layout's shapes, what a file moves of a prediction (each term by its rate, exactly), the files the
planner refuses, and the calibrated prediction beside a rank measured here (``timing``)."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import pytest
import torch
from harness import command_output
from planned import plan_config

from composer3d.plan import Workload, candidate_from_config, estimate
from composer3d.plan.estimate import rank_memories
from composer3d.plan.hardware import cluster_from_config
from composer3d.plan.kernels import ATTENTION_FRACTION, OPTIMIZER_BYTES, step_compute
from composer3d.plan.memory import OPTIMIZER_STATE_BYTES
from composer3d.plan.rates import Rates

# Two ranks of FSDP over a 2-layer Llama of width 128 (8 heads of 16, 4 KV heads, MLP 256): a GEMM
# has 2 × 64 = 128 rows.
LAYOUT = [
    "model=tiny",
    "model.dim=128",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.ffn_hidden_dim=256",
    "model.vocab_size=512",
    "data=synthetic",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "parallel.dp_shard=2",
    "cluster.gpus_per_node=2",
    "cluster.device=cpu",
    "launch.device=cpu",
]


@pytest.fixture
def one_thread():
    """One intra-op thread, as the other tests' ranks run: two threads on this shared 2-core machine
    wait on each other's time slices (a 128-wide matmul measured 16 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> tuple[Path, object]:
    """The command's file for LAYOUT, and what it printed."""
    path = tmp_path_factory.mktemp("calibration") / "cpu.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        done = command_output(
            "composer3d.commands.plan",
            *LAYOUT,
            f"plan.calibrate={path}",
            "plan.calibrate_repeats=1",
        )
    finally:
        torch.set_num_threads(threads)
    assert done.returncode == 0, done.stderr[-3000:]
    return path, done


def test_the_command_writes_the_layouts_shapes_and_their_times(calibration):
    path, done = calibration
    f = json.loads(path.read_text())
    assert (f["format"], f["device"], f["dtype"], f["torch"]) == (
        "composer3d-calibration/1",
        "cpu",
        "float32",
        torch.__version__,
    )
    assert datetime.datetime.fromisoformat(f["date"]).tzinfo is not None
    assert f["layout"] == "dp2 tp1 z3 mb2 ac:none"
    # each distinct linear of a block on the rank, and the head, at 128 rows: m × n (out) × k (in)
    gemms = {tuple(g["names"]): (g["m"], g["n"], g["k"]) for g in f["gemms"]}
    assert gemms == {
        ("wq", "wo"): (128, 128, 128),
        ("wk", "wv"): (128, 64, 128),
        ("w1", "w3"): (128, 256, 128),
        ("w2",): (128, 128, 256),
        ("output",): (128, 512, 128),
    }
    attention = {(a["kernel"], a["seq_len"]) for a in f["attention"]}
    # SDPA's own pick and its flash backend (the CPU has both), at a quarter to twice 64 tokens
    assert attention == {(k, s) for k in ("sdpa", "flash2") for s in (16, 32, 64, 128)}
    assert {(a["batch"], a["heads"], a["kv_heads"], a["head_dim"]) for a in f["attention"]} == {
        (2, 8, 4, 16)
    }
    # both blocks' parameters, each one's rows halved by FSDP: wq, wo 64 × 128; wk, wv 32 × 128;
    # w1, w3 128 × 128; w2 64 × 256; two norms of 64
    block = 2 * 64 * 128 + 2 * 32 * 128 + 2 * 128 * 128 + 64 * 256 + 2 * 64
    assert (f["optimizer"]["params"], f["optimizer"]["tensors"]) == (2 * block, 2 * 9)
    assert f["optimizer"]["implementation"] == "fused"  # optim.implementation=auto on the CPU
    assert f["copy"]["bytes"] == 2 * 128 * 256 * 4  # an MLP activation read and written, fp32
    times = [
        *(g["seconds"] for g in f["gemms"]),
        *(a[k] for a in f["attention"] for k in ("forward_s", "seconds")),
        f["optimizer"]["seconds"],
        f["copy"]["seconds"],
    ]
    assert all(t > 0 for t in times[:-1]) and times[-1] > 0, times
    assert f"written to {path}" in done.stdout and "TFLOP/s" in done.stdout, done.stdout


def _planned(calibration: str | None, *overrides: str):
    """(StepCompute's terms of rank 0, the estimate) of LAYOUT planned with ``calibration``."""
    cfg = plan_config(*LAYOUT, *overrides)
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype, calibration)
    work = Workload.from_config(cfg)
    c = candidate_from_config(cfg, cluster.world_size)
    priced = rank_memories(work, c, cluster)
    local = priced.mems[0].optimizer / OPTIMIZER_STATE_BYTES[work.optimizer]
    terms = step_compute(work.shape, c, priced.sets[0], work.seq_len, local, cluster, work.work)
    e = estimate(work, c, cluster)
    assert e.compute_s == pytest.approx(terms.total, rel=1e-12)
    return terms, e, cluster


def _at_constants(measured: dict, cluster, slower: dict[str, float]) -> dict:
    """The command's file with every time replaced by what the constants give for the same work on
    ``cluster`` (the CPU's row), times ``slower[kind]``: a file whose rates are the constants'
    divided by it."""
    peak, cb, hbm = cluster.peak_flops, cluster.compute_bytes, cluster.hbm_bw
    f = json.loads(json.dumps(measured))
    for g in f["gemms"]:
        m, n, k = g["m"], g["n"], g["k"]
        # the three matmuls of plan/kernels.py's roofline: FLOPs at the large-GEMM rate, bytes
        one = (
            2 * m * n * k / (peak * cluster.achievable_fraction)
            + (m * k + n * k + m * n) * cb / hbm
        )
        g["seconds"] = 3 * one * slower.get("gemm", 1)
    for a in f["attention"]:
        flops = 3.5 * 2 * a["batch"] * a["seq_len"] ** 2 * a["heads"] * a["head_dim"]
        total = flops / (peak * ATTENTION_FRACTION[a["kernel"]]) * slower.get("attention", 1)
        a["forward_s"], a["seconds"] = total / 3.5, total
    o = f["optimizer"]
    o["seconds"] = o["params"] * OPTIMIZER_BYTES / hbm * slower.get("optimizer", 1)
    f["copy"]["seconds"] = f["copy"]["bytes"] / hbm * slower.get("elementwise", 1)
    return f


def test_a_file_moves_each_term_of_the_prediction_by_its_rate(calibration, tmp_path):
    """A file measuring exactly what the constants give reproduces their prediction term by term;
    one whose GEMM rates are half that doubles the GEMMs' time and leaves the rest, and so for
    attention, the optimizer step and the memory bandwidth; the step's compute grows by that
    term."""
    measured = json.loads(calibration[0].read_text())
    constant, constant_e, cpu = _planned(None)
    kinds = ("gemm", "attention", "optimizer", "elementwise")

    def planned_with(slower: dict[str, float]):
        path = tmp_path / f"{'-'.join(slower) or 'same'}.json"
        path.write_text(json.dumps(_at_constants(measured, cpu, slower)))
        return _planned(str(path))

    same, same_e, calibrated = planned_with({})
    for kind in kinds:
        assert getattr(same, kind) == pytest.approx(getattr(constant, kind), rel=1e-9), kind
    assert calibrated.hbm_bw == pytest.approx(cpu.hbm_bw, rel=1e-12)
    assert same_e.notes[-1].startswith("rates measured on ") and not constant_e.notes
    for kind in kinds:
        halved, halved_e, _ = planned_with({kind: 2.0})
        for other in kinds:
            want = getattr(constant, other) * (2 if other == kind else 1)
            assert getattr(halved, other) == pytest.approx(want, rel=1e-9), (kind, other)
        assert halved_e.compute_s - constant_e.compute_s == pytest.approx(
            getattr(constant, kind), rel=1e-9
        )
        assert getattr(constant, kind) > 0.01 * constant_e.compute_s, kind  # a term that counts
    # the measured file as written: a GEMM of the step's shape takes its file's time, so the GEMM
    # term is the file's three-matmul seconds summed over a step's linears (7 a block, 2 blocks, and
    # the head) for each of its 2 micro-batches
    terms, _, _ = _planned(str(calibration[0]))
    seconds = {tuple(g["names"]): g["seconds"] for g in measured["gemms"]}
    per_block = sum(len(names) * s for names, s in seconds.items() if names != ("output",))
    assert terms.gemm == pytest.approx(2 * (2 * per_block + seconds["output",]), rel=1e-9)


def test_rates_between_measured_shapes_and_lengths_interpolate_in_log(calibration):
    f = json.loads(calibration[0].read_text())
    f["attention"] = [a for a in f["attention"] if a["kernel"] == "sdpa" and a["seq_len"] != 64]
    rates = Rates.from_json(f)
    r32, r128 = (rates.attention_rate("sdpa", s) for s in (32, 128))
    assert rates.attention_rate("sdpa", 64) == pytest.approx((r32 + r128) / 2, rel=1e-12)
    assert rates.attention_rate("sdpa", 8) == rates.attention_rate("sdpa", 16)  # flat beyond
    assert rates.attention_rate("sdpa", 10**6) == r128
    assert rates.attention_rate("flash2", 64) is None  # not in the file: the constant's
    # GEMMs: 128 × 64 × 128 (wk, wv) and 128 × 256 × 128 (w1, w3): 128 × 128 × 128 lies halfway in
    # log FLOPs, but is measured (wq, wo): its own rate; 128 × 128 × 64 is not: halfway between the
    # smallest and nothing below it: the smallest's
    by = {tuple(g.names): g.flops_per_s for g in rates.gemms}
    assert rates.gemm_rate(128, 128, 128) == by["wq", "wo"]
    assert rates.gemm_rate(128, 32, 128) == by["wk", "wv"]
    f["gemms"] = [g for g in f["gemms"] if g["names"] not in (["wq", "wo"], ["w2"])]
    pooled = Rates.from_json(f)
    assert pooled.gemm_rate(128, 128, 128) == pytest.approx(
        (by["wk", "wv"] + by["w1", "w3"]) / 2, rel=1e-12
    )


@pytest.mark.parametrize(
    "kind, overrides, said",
    [
        ("missing", [], "no file at"),
        ("not json", [], "is not a calibration file"),
        ("fields", [], "is not a calibration file"),
        ("negative", [], "is not a calibration file"),
        (
            "measured",
            ["cluster.device=h100"],
            "not cluster.device=h100. Plan with cluster.device=cpu",
        ),
        ("measured", ["precision.param_dtype=bfloat16"], "measured in float32"),
    ],
)
def test_a_file_the_plan_cannot_use_is_refused_in_one_line(
    calibration, tmp_path, kind, overrides, said
):
    path = tmp_path / "calibration.json"
    f = json.loads(calibration[0].read_text())
    if kind == "not json":
        path.write_text("{gemms: ")
    elif kind == "fields":
        del f["copy"]
        path.write_text(json.dumps(f))
    elif kind == "negative":
        f["gemms"][0]["seconds"] = 0.0
        path.write_text(json.dumps(f))
    elif kind == "measured":
        path.write_text(json.dumps(f))
    done = command_output(
        "composer3d.commands.plan", *LAYOUT, f"plan.calibration={path}", *overrides
    )
    assert done.returncode == 2 and done.stdout == "", done
    line = done.stderr.strip()
    assert "\n" not in line and "plan.calibration: " in line and said in line, line
    assert "plan.calibrate=" in line or "Plan with" in line, line  # what would work


@pytest.mark.timing
def test_the_calibrated_prediction_meets_a_rank_measured_here(one_thread, tmp_path):
    """A layout wide enough that its kernels, not the host's per-op overhead, take the step (width
    512, 256 tokens): the calibrated compute time is within 1.5× of what plan.measure's rank takes
    here. The CPU's nominal constants land as close on this machine (its one-thread fp32 GEMMs run
    near the nominal 80 GFLOP/s), so which is closer is noise, not asserted."""
    from composer3d.plan.measure import measure_rank

    wide = [
        *LAYOUT,
        "model.dim=512",
        "model.ffn_hidden_dim=1024",
        "model.vocab_size=2048",
        "train.seq_len=256",
        "train.global_batch_size=4",
        "checkpoint.enabled=false",
        "logging.progress_bar=false",
    ]
    path = tmp_path / "cpu.json"
    done = command_output("composer3d.commands.plan", *wide, f"plan.calibrate={path}")
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = plan_config(*wide)
    _, e, _ = _planned(str(path), *wide[len(LAYOUT) :])
    step = measure_rank(cfg, 2, 0, 3).median_step_s
    assert 1 / 1.5 < step / e.compute_s < 1.5, (step, e.compute_s)
    assert math.isfinite(e.compute_s)
