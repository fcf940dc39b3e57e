"""composer3d-plan: predictions measured on this machine, the console script, and parallel=auto.

The measured-vs-predicted tests train 35 layouts of a 4-layer Llama (dim 128, fp32, gloo) for two
steps each, in two process groups (tests/plan_measure.py): 22 layouts on 2 processes (one per core
of this machine), 13 that need 4 (the default run measures 19, at least one per composition; the
rest, SLOW_LAYOUTS, run under -m slow); 8 of them are the same width with mixture-of-experts layers
(tiny_moe: FSDP, expert parallel alone, with FSDP over what it leaves, HSDP, TP+SP, PP and
checkpointing), 4 are context parallel (each style, the ring under full checkpointing, cp × FSDP).
Per layout they compare what the planner predicts with what the real training step did: model-state
bytes (within 2%), the peak of live tensor bytes on the busiest rank (within 15%), bytes per
collective kind and group per rank (within 2%; all-to-all as its pipeline stage's mean, which the
routing does not change; collectives under 1% of a rank's traffic — the gradient norm's scalars —
are only required to stay under 1% together). For pp=2 at M=8 under GPipe, 1F1B and interleaved 1F1B
(v=2) a third group times the pipeline's idle share (within 20%), each chunk's compute lengthened by
a fixed wait so that what is measured is the schedule, not this shared machine's CPU scheduler. pp=4
with one layer per stage is measured at 8 micro-batches (its peak predicted 9% low under 1F1B, 1%
under GPipe; at 16, 12.5% and 5%: the planner leaves out the pipeline's per-micro-batch receive
buffers and backward's temporaries, docs/planner.md).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import FAST, command_output, train
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict
from plan_measure import run_measurements
from planned import plan_config, planned
from yaml import safe_load as yaml_value

from composer3d.config.registration import register_configs
from composer3d.plan import Workload, candidate_from_config, estimate
from composer3d.plan.hardware import cluster_from_config

ROOT = Path(__file__).parents[1]
RUN = [
    "data=synthetic",
    "train.seq_len=64",
    "launch.device=cpu",
    "checkpoint.enabled=false",
    "logging.progress_bar=false",
]
MODEL = [
    "model=tiny",
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.vocab_size=512",
    *RUN,
]
# tiny_moe at the same width: 8 experts of width 128, top-2, one shared expert, the first of 4
# layers dense.
MOE = ["model=tiny_moe", "model.dim=128", "model.moe.expert_hidden_dim=128", *RUN]
BATCH = ["train.global_batch_size=8", "train.micro_batch_size=2"]
TP_BATCH = [
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
]  # few micro-batches: TP's collectives are many
PP_BATCH = [
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
]  # 8 micro-batches per pipeline at dp=1

# Two ranks, one per core of this machine.
LAYOUTS_2 = {
    "fsdp_z3": [*MODEL, *BATCH, "parallel.dp_shard=2"],
    "fsdp_z2": [*MODEL, *BATCH, "parallel.dp_shard=2", "parallel.zero_stage=2"],
    "fsdp_accumulate": [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.dp_shard=2",
    ],
    "zero1": [*MODEL, *BATCH, "parallel.zero_stage=1"],
    "zero1_accumulate": [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.zero_stage=1",
    ],
    "ddp": [*MODEL, *BATCH, "parallel.dp_shard=1", "parallel.dp_replicate=2"],
    "ddp_accumulate": [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.dp_shard=1",
        "parallel.dp_replicate=2",
    ],
    "tp2": [*MODEL, *TP_BATCH, "parallel.tp=2"],
    "tp2_sp": [*MODEL, *TP_BATCH, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "fsdp_ac_full": [*MODEL, *BATCH, "parallel.dp_shard=2", "memory.activation_checkpointing=full"],
    "fsdp_ac_selective": [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=2",
        "memory.activation_checkpointing=selective",
    ],
    "ddp_ac_full": [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=1",
        "parallel.dp_replicate=2",
        "memory.activation_checkpointing=full",
    ],
    "tp_sp_ac_full": [
        *MODEL,
        *TP_BATCH,
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "memory.activation_checkpointing=full",
    ],
    "pp_1f1b": [*MODEL, *PP_BATCH, "parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp_gpipe": [*MODEL, *PP_BATCH, "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "moe_fsdp": [*MOE, *BATCH, "parallel.dp_shard=2"],
    "moe_ep2": [*MOE, *BATCH, "parallel.dp_shard=2", "parallel.ep=2"],
    "moe_ep2_ac_full": [
        *MOE,
        *BATCH,
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "memory.activation_checkpointing=full",
    ],
    "moe_ep2_ac_selective": [
        *MOE,
        *BATCH,
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "memory.activation_checkpointing=selective",
    ],
    # ZeRO-1 under ep = dp_shard: each rank alone holds its experts, their gradients reduced over no
    # other rank
    "moe_zero1_ep2": [
        *MOE,
        *BATCH,
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.zero_stage=1",
    ],
    # context parallel: FSDP over the cp ranks; the ring's K/V sends (forward, backward, full AC's
    # rerun), the all-gather's K/V and their gradients, Ulysses' all-to-alls (the ring without AC:
    # cp2_fsdp2, on 4 ranks)
    "cp2_ring_ac_full": [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=1",
        "parallel.cp=2",
        "memory.activation_checkpointing=full",
    ],
    "cp2_allgather": [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=1",
        "parallel.cp=2",
        "parallel.cp_style=allgather",
    ],
    "cp2_ulysses": [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=1",
        "parallel.cp=2",
        "parallel.cp_style=ulysses",
    ],
}
# Pipelines whose idle share is timed (tests/plan_measure.py): PAD_S of simulated compute per
# forward chunk, twice that per backward. Looped BFS and the zero-bubble schedules are not among
# them: they measure above the planner's (P−1)/(v·M) and its zero-bubble ideal (docs/planner.md).
TIMED_PIPELINES = {
    schedule: [*MODEL, *PP_BATCH, "parallel.pp=2", f"parallel.pp_schedule={schedule}"]
    for schedule in ("1f1b", "gpipe", "interleaved_1f1b")
}
TIMED_STEPS, PAD_S = 3, 0.1
# Layouts of four ranks (two dimensions of two).
LAYOUTS_4 = {
    "hsdp_z3": [*MODEL, *BATCH, "parallel.dp_shard=2", "parallel.dp_replicate=2"],
    "hsdp_z2": [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=2",
        "parallel.dp_replicate=2",
        "parallel.zero_stage=2",
    ],
    "fsdp_tp_sp": [*MODEL, *TP_BATCH, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp4_sp": [*MODEL, *TP_BATCH, "parallel.tp=4", "parallel.sequence_parallel=true"],
    # 8 micro-batches per pipeline
    "pp_tp_sp": [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ],
    "pp_ddp": [
        *MODEL,
        "train.global_batch_size=16",
        "train.micro_batch_size=1",
        "parallel.pp=2",
        "parallel.dp_shard=1",
        "parallel.dp_replicate=2",
    ],
    # a tied embedding: its twin head on the last stage, their gradient shards summed
    # (parallel.tied)
    "pp_fsdp_tied": [
        *MODEL,
        "model.tie_embeddings=true",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.pp=2",
        "parallel.dp_shard=2",
    ],
    # one layer per stage, 8 micro-batches
    "pp4_1f1b": [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.pp=4",
        "parallel.pp_schedule=1f1b",
    ],
    "pp4_gpipe": [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.pp=4",
        "parallel.pp_schedule=gpipe",
    ],
    "moe_ep2_fsdp4": [*MOE, *BATCH, "parallel.dp_shard=4", "parallel.ep=2"],
    "moe_hsdp_ep2": [
        *MOE,
        *BATCH,
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
    ],
    "moe_ep2_tp2_sp": [
        *MOE,
        *TP_BATCH,
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ],
    "moe_pp2_ep2": [
        *MOE,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
    ],
    "cp2_fsdp2": [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=2",
        "parallel.cp=2",
    ],  # FSDP over dp_shard × cp = 4
    # ZeRO-1: the dense parameters' state over dp × cp (4), the experts' over the 2 ranks holding
    # the same ones
    "cp2_zero1": [*MODEL, *BATCH, "parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=1"],
    "moe_zero1_ep2_dp4": [
        *MOE,
        *BATCH,
        "parallel.dp_shard=4",
        "parallel.ep=2",
        "parallel.zero_stage=1",
    ],
}


def _predict(overrides: list[str], nproc: int):
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train", overrides=[f"launch.nproc_per_node={nproc}", "run.dir=unused", *overrides]
        )
    cluster = cluster_from_config(
        OmegaConf.create(
            {**OmegaConf.to_container(cfg.cluster), "device": "cpu", "gpus_per_node": nproc}
        ),
        "float32",
    )
    return estimate(Workload.from_config(cfg), candidate_from_config(cfg, nproc), cluster)


# Measured in the slow tier only (`pytest -m slow`): variants of a composition the default run
# measures already (the other ZeRO stage, accumulation, the other checkpointing policy or pipeline
# schedule, 4 ranks where 2 show the same collectives). Every dimension and composition keeps a
# measured layout in the default run; the variants keep their check in the whole suite.
SLOW_LAYOUTS = {
    "fsdp_z2",
    "fsdp_accumulate",
    "zero1_accumulate",
    "ddp",
    "tp2",
    "fsdp_ac_full",
    "ddp_ac_full",
    "tp_sp_ac_full",
    "pp_gpipe",
    "moe_fsdp",
    "moe_ep2_ac_full",
    "moe_ep2_ac_selective",
    "hsdp_z3",
    "tp4_sp",
    "pp_ddp",
    "pp4_gpipe",
    "moe_ep2_fsdp4",
    "moe_hsdp_ep2",
    "cp2_zero1",
    "moe_zero1_ep2_dp4",
}


@pytest.fixture(scope="module", params=["default", pytest.param("slow", marks=pytest.mark.slow)])
def measured(request, tmp_path_factory) -> dict[str, tuple[list[dict], object]]:
    """Per layout of the tier: what each rank measured, and the planner's estimate (one process
    group per world size)."""
    slow = request.param == "slow"
    out = {}
    for nproc, all_layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4)):
        layouts = {n: job for n, job in all_layouts.items() if (n in SLOW_LAYOUTS) == slow}
        jobs = list(layouts.values())
        runs = run_measurements(jobs, nproc, tmp_path_factory.mktemp(f"plan{nproc}"))
        out.update({n: (ranks, _predict(job, nproc)) for n, ranks, job in zip(layouts, runs, jobs)})
    assert len(out) >= 15
    return out


def _pp_rank(rank: int, est) -> int:
    c = est.candidate
    return rank // (c.dp * c.cp * c.tp)  # pp is the outermost mesh dim


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b


def test_model_state_bytes_within_2_percent(measured):
    rows = []
    for name, (ranks, est) in measured.items():
        got = max(r["model_state_bytes"] for r in ranks)
        want = max(m.model_state for m in est.memory_per_pp_rank)
        rows.append((name, want, got, _rel(want, got)))
    bad = [r for r in rows if r[3] > 0.02]
    assert not bad, f"model state off by more than 2% (layout, predicted, measured, error): {bad}"


# LoRA / QLoRA on a model whose linears dominate (2 layers of 512, MLP 4096: every targeted weight
# whole NF4 blocks), the head trained whole beside the adapters; one process.
PEFT_MODEL = [
    "model=tiny",
    "model.dim=512",
    "model.ffn_hidden_dim=4096",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    *RUN,
    *BATCH,
    "parallel.dp_shard=1",
]
PEFT_JOBS = {
    "lora": [*PEFT_MODEL, "peft=lora", "peft.modules_to_save=[output]"],
    "qlora": [*PEFT_MODEL, "peft=qlora", "peft.modules_to_save=[output]"],
}


def test_peft_model_state_is_the_trainable_parameters_and_the_frozen_bytes(tmp_path):
    """A frozen parameter has no gradient and no optimizer state, QLoRA's base is NF4 (half a byte a
    value and its scales): the planner's model-state bytes for LoRA and QLoRA against the real
    model's after a step (sum of its parameters', gradients' and optimizer state's tensor bytes)
    within 2%, where 16 B per parameter (the full fine-tune's state, held to the real one by
    test_model_state_bytes_within_2_percent) is 3× (LoRA) and 10× (QLoRA) more."""
    runs = run_measurements(list(PEFT_JOBS.values()), 1, tmp_path)
    got = {name: ranks[0]["model_state_bytes"] for name, ranks in zip(PEFT_JOBS, runs)}
    predicted = {name: _predict(job, 1).memory.model_state for name, job in PEFT_JOBS.items()}
    for name in PEFT_JOBS:
        assert _rel(predicted[name], got[name]) < 0.02, (name, predicted[name], got[name])
    full = _predict(PEFT_MODEL, 1).memory.model_state
    assert got["lora"] < full / 3 and got["qlora"] < full / 10, (got, full)


def test_peak_memory_within_15_percent(measured):
    rows = []
    for name, (ranks, est) in measured.items():
        got = max(r["peak_bytes"] for r in ranks)
        rows.append((name, est.memory.total, got, _rel(est.memory.total, got)))
    bad = [r for r in rows if r[3] > 0.15]
    assert not bad, f"peak memory off by more than 15% (layout, predicted, measured, error): {bad}"


def _routing_averaged(ranks: list[dict], rank: int, est) -> dict[str, float]:
    """``rank``'s measured bytes, its all-to-all as the mean of its pipeline stage's ranks: how many
    token copies a rank's experts receive (and send back) depends on the routing, the group's total
    does not."""
    got = dict(ranks[rank]["collective_bytes"])
    key = f"all_to_all/{est.candidate.ep}"
    if key in got:
        stage = [r for i, r in enumerate(ranks) if _pp_rank(i, est) == _pp_rank(rank, est)]
        got[key] = sum(r["collective_bytes"][key] for r in stage) / len(stage)
    return got


def test_collective_bytes_within_2_percent(measured):
    bad = []
    for name, (ranks, est) in measured.items():
        for rank in range(len(ranks)):
            want: dict[str, float] = {}
            for col in est.collectives_per_pp_rank[_pp_rank(rank, est)]:
                if col.bytes:
                    key = f"{col.kind}/{col.group_size}"
                    want[key] = want.get(key, 0.0) + col.bytes
            got = _routing_averaged(ranks, rank, est)
            total = sum(got.values())
            big = {
                k
                for k in set(want) | set(got)
                if max(want.get(k, 0), got.get(k, 0)) >= 0.01 * total
            }
            for key in big:
                if key not in got or _rel(want.get(key, 0.0), got[key]) > 0.02:
                    bad.append((name, rank, key, want.get(key), got.get(key)))
            small = sum(v for k, v in got.items() if k not in big)
            if small > 0.01 * total:
                bad.append((name, rank, "unpredicted small collectives", small, total))
    assert not bad, (
        "collective bytes off by more than 2% (layout, rank, kind/group, predicted, measured): "
        f"{bad}"
    )


@pytest.mark.timing
def test_pipeline_idle_fraction_within_20_percent(tmp_path):
    """The pipeline's idle share of a step per schedule (pp=2, 8 micro-batches; v=2 stages per rank
    where the schedule loops): 1 − the ranks' mean time inside stage compute over the step (the
    longest rank's time inside the schedule), median of TIMED_STEPS steps, against the predicted
    bubble (P−1)/(v·M) as a share of the step. Each chunk's compute is lengthened by a fixed wait
    (tests/plan_measure.py says why: on this 2-core machine a rank's own compute runs at whatever
    share of a core it gets)."""
    runs = run_measurements(list(TIMED_PIPELINES.values()), 2, tmp_path, TIMED_STEPS, PAD_S)
    rows = []
    for (name, job), ranks in zip(TIMED_PIPELINES.items(), runs):
        est = _predict(job, 2)
        idle = [
            1
            - sum(r["busy_s"][i] for r in ranks)
            / len(ranks)
            / max(r["schedule_s"][i] for r in ranks)
            for i in range(TIMED_STEPS)
        ]
        got = statistics.median(idle)
        rows.append(
            (
                name,
                round(est.bubble_fraction, 4),
                round(got, 4),
                round(_rel(est.bubble_fraction, got), 3),
            )
        )
    bad = [r for r in rows if r[3] > 0.2]
    assert not bad, (
        f"pipeline idle share off by more than 20% (schedule, predicted, measured, error): {bad}"
    )


@functools.cache
def _published_rows() -> list[tuple[int, str, float | None, object, float]]:
    """benchmarks/plan_published.py's rows as (row, source, published tokens/s, the planner's
    Estimate, published TFLOP/s per GPU in composer3d's count): the CLI's arithmetic, in
    process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_published import ROWS, on_device, published_tflops

    register_configs()
    out = []
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        for row, source, overrides, tokens, tflops in ROWS:
            cfg = compose("train", overrides=on_device(overrides))
            cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
            e = estimate(
                Workload.from_config(cfg),
                candidate_from_config(cfg, cluster.world_size),
                cluster,
            )
            per_token = e.tflops_per_gpu / e.tokens_per_s_per_gpu
            out.append(
                (row, source, tokens, e, published_tflops(overrides, tokens, tflops, per_token))
            )
    return out


def test_readme_table_is_what_the_planner_predicts():
    """recipes/README.md's comparison with published throughput: its predicted column is the
    planner's for the rows of benchmarks/plan_published.py."""
    table = {}
    for line in (ROOT / "recipes" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and cells[1].isdigit() and cells[-3].replace(".", "").isdigit():
            table[int(cells[1])] = float(cells[-3])
    assert table == {row: round(e.tflops_per_gpu, 1) for row, _, _, e, _ in _published_rows()}
    # and under it, where each row's predicted step goes, as the script prints it
    from plan_published import step_shares

    section = (ROOT / "recipes" / "README.md").read_text().split("### Where each predicted step")[1]
    shown = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in section.split("\n\n")[2].splitlines()[2:]
    ]
    predicted = []
    for row, _, _, e, _ in _published_rows():
        step, *shares = step_shares(e.as_json())
        predicted.append([str(row), f"{step:.2f}", *(f"{x:.0%}" for x in shares)])
    assert shown == predicted


def test_every_published_row_is_predicted_within_25_percent():
    """Every row of the planner's published table (recipes/README.md), from one GPU to Llama 3's
    16,384: its predicted TFLOP/s within 25% of the published, each row's layout as published and
    nothing set per row."""
    errors = {
        row: round(e.tflops_per_gpu / published - 1, 3)
        for row, _, _, e, published in _published_rows()
    }
    assert len(errors) == 31 and all(abs(err) <= 0.25 for err in errors.values()), errors


@pytest.mark.cli  # the script runs composer3d-plan for each row
def test_plan_published_prints_its_table_and_held_out_rows(monkeypatch, capsys):
    """benchmarks/plan_published.py end to end on three of its rows (a smoke run: the whole script
    plans 40 layouts, minutes): a table row and two held-out ones, the mixture of experts among
    them, each with the error of the planner's prediction against its published figure, and where
    the table row's predicted step goes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_published

    monkeypatch.setattr(plan_published, "ROWS", [r for r in plan_published.ROWS if r[0] == 16])
    monkeypatch.setattr(
        plan_published,
        "HELD_OUT",
        [r for r in plan_published.HELD_OUT if r[0] in ("T5.1", "MB.Q3")],
    )
    monkeypatch.setattr(sys, "argv", ["plan_published.py"])
    plan_published.main()
    table, breakdown = capsys.readouterr().out.split("where each predicted step goes")
    lines: dict[str, str] = {}  # each row's first line: its prediction (its breakdown follows)
    for line in (table + breakdown).splitlines():
        if line.strip():
            lines.setdefault(line.split()[0], line)
    # row 16's breakdown: step seconds, then each term's share of the step
    row16 = next(line for line in breakdown.splitlines() if line.split()[:1] == ["16"])
    shares = [float(x.rstrip("%")) for x in row16.split()[-12:]]
    # one GPU: its whole step is compute, no bubble, nothing exposed
    assert sum(shares[1:5]) >= 99 and shares[5:] == [0.0] * 7, shares
    assert lines["16"].split()[-1] == "-3%", lines
    assert lines["T5.1"].split()[-3:] == ["100", "109", "+9%"], lines
    assert lines["MB.Q3"].split()[-3:] == ["8,960", "11,467", "+28%"], lines


def test_planner_predicts_composer3d_steps_at_the_current_code():
    """composer3d's own runs on one H200 at the current code (benchmarks/plan_published.py, rows
    measured beside torchtitan from 2026-11-26 to 28): eager and compiled, selective AC by either
    policy or none, either cast, the 1B and the 3B, each predicted within 6% of its measured
    tokens/s. The eager constants set on the issue's older eager runs predicted row 19 29% slow;
    charging alternate_matmuls half the forward GEMMs (it reruns wk, wo and w3: a third of their
    FLOPs) predicted rows 24 and 28 4% and 7% slow."""
    errors = {
        row: round(e.tokens_per_s_per_gpu / tokens - 1, 3)
        for row, source, tokens, e, _ in _published_rows()
        if "H200" in source
    }
    assert len(errors) == 8 and all(abs(err) < 0.06 for err in errors.values()), errors


def test_readme_what_fits_rows_are_what_the_planner_prints():
    """The plan.what_fits example (docs/planner.md): its command, rerun, prints every row the page
    shows, to the digit."""
    readme = (ROOT / "docs" / "planner.md").read_text()
    block = readme.split("$ composer3d-plan model=llama3_8b cluster.gpus_per_node=1", 1)[1].split(
        "```", 1
    )[0]
    command, shown = block.split("plan.what_fits=true\n", 1)
    overrides = [
        "model=llama3_8b",
        "cluster.gpus_per_node=1",
        *command.replace("\\", " ").split(),
        "plan.what_fits=true",
    ]
    out = _plan(*overrides)
    assert out.returncode == 0, out.stderr
    rows = [line for line in shown.splitlines() if line.startswith("  ") and line.strip() != "…"]
    assert len(rows) >= 8
    printed = set(out.stdout.splitlines())
    assert [row for row in rows if row not in printed] == [], out.stdout


def test_attention_kernel_times_attention_at_its_rate_and_nothing_else():
    """plan.attention_kernel: Llama 3 8B at 32,768 tokens under full checkpointing (torchtitan's
    Table 2 layout) predicted with FlashAttention-2's rate (flash2) and SDPA's (sdpa). The compute
    differs by the attention alone, counted by hand: 32 layers × 2·s·H·Q FLOPs a token forward × 4.5
    (backward 2.5×, the forward rerun once) at 0.33 against 0.38 of the peak; under the ring (cp 8,
    2,048 tokens) the slower blocks hide more of each K/V pass."""
    register_configs()
    layout = [
        "model=llama3_8b",
        "train.seq_len=32768",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "cluster.nodes=1",
        "parallel.dp_shard=8",
        "memory.activation_checkpointing=full",
        "cluster.device=h100",
    ]
    ring = [
        *layout[:1],
        "train.seq_len=2048",
        *layout[2:5],
        "parallel.dp_shard=1",
        "parallel.cp=8",
        *layout[6:],
    ]
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        got = {}
        for kernel in ("sdpa", "flash2"):
            for name, overrides in (("fsdp", layout), ("ring", ring)):
                cfg = compose("train", overrides=[*overrides, f"plan.attention_kernel={kernel}"])
                cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
                got[kernel, name] = estimate(
                    Workload.from_config(cfg), candidate_from_config(cfg, 8), cluster
                )
    s = 32768
    attention_flops = 32 * 2 * s * 4096 * s * 4.5
    expected = attention_flops / cluster.peak_flops * (1 / 0.33 - 1 / 0.38)
    assert got["flash2", "fsdp"].compute_s - got["sdpa", "fsdp"].compute_s == pytest.approx(
        expected, rel=1e-9
    )
    assert expected > 0.5  # seconds, of a 6 s step: at this length attention is most of the step
    # FSDP hides behind both
    assert got["flash2", "fsdp"].exposed_comm_s == got["sdpa", "fsdp"].exposed_comm_s
    assert 0 < got["flash2", "ring"].exposed_comm_s["cp"] < got["sdpa", "ring"].exposed_comm_s["cp"]


def test_norm_kernel_adds_a_composite_norms_bytes_to_an_eager_step_only():
    """plan.norm_kernel=composite (torchtitan's 2024-12 RMSNorm, its published eager rows): Llama 3
    8B on FSDP 8 under op-level selective checkpointing. The eager step grows by the composite
    norms' extra bytes over HBM, counted by hand: 65 norms (two a block, the final one) × 16,384
    tokens × 4096 × (32 more bytes forward, rerun once, 70 more backward); a compiled step, whose
    norms Inductor fuses, not at all."""
    register_configs()
    layout = [
        "model=llama3_8b",
        "train.seq_len=8192",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
        "cluster.nodes=1",
        "parallel.dp_shard=8",
        "memory.activation_checkpointing=selective",
        "cluster.device=h100",
    ]
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        got = {}
        for compiled in (False, True):
            for kernel in ("fused", "composite"):
                cfg = compose(
                    "train",
                    overrides=[
                        *layout,
                        f"compile.enabled={str(compiled).lower()}",
                        f"plan.norm_kernel={kernel}",
                    ],
                )
                cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
                got[compiled, kernel] = estimate(
                    Workload.from_config(cfg), candidate_from_config(cfg, 8), cluster
                )
    expected = 65 * 16384 * 4096 * (32 * 2 + 70) / cluster.hbm_bw
    assert got[False, "composite"].compute_s - got[False, "fused"].compute_s == pytest.approx(
        expected, rel=1e-9
    )
    assert expected > 0.1  # seconds, of a 2.4 s step
    assert got[True, "composite"].compute_s == got[True, "fused"].compute_s


# The DPO reference model (train.objective=dpo): Llama 3 8B on FSDP 8 (every first dim divides by 8:
# a rank's shard is an eighth of the 8,030,261,248 parameters), two micro-batches a step.
DPO = ["data=preference", "data.paths=[pairs.jsonl]", "train.objective=dpo"]
DPO_LAYOUT = [
    "model=llama3_8b",
    "train.seq_len=4096",
    "train.global_batch_size=16",
    "train.micro_batch_size=1",
    "cluster.device=h100",
    "parallel.dp_shard=8",
]
PARAMS_8B, BLOCK_8B, LAYERS_8B = 8_030_261_248, 218_112_000, 32
ROOT_8B = PARAMS_8B - LAYERS_8B * BLOCK_8B  # embedding, norm, head


@pytest.mark.parametrize("zero", [3, 2])
def test_a_dpo_reference_copy_holds_its_shards_and_what_its_forward_leaves_gathered(zero):
    """preference.reference=copy: the frozen copy's parameters, stored and sharded as the policy's
    (fp32: 4 bytes a parameter, an eighth of them), and no gradient or optimizer state; FSDP
    reshards what it gathered in backward, which the copy never runs (and after forward only
    ZeRO-3's blocks), so its root stays gathered in bf16, under ZeRO-2 its blocks too. Its no-grad
    forward saves nothing: activations and logits are SFT's. LoRA's adapters_off (the policy itself)
    and SimPO (no reference) add nothing."""
    layout = [*DPO_LAYOUT, f"parallel.zero_stage={zero}"]
    sft, copy, simpo = (
        planned(*layout, *more)[0].memory
        for more in ([], DPO, [*DPO, "preference.loss_type=simpo"])
    )
    assert copy.parameters - sft.parameters == 4 * PARAMS_8B / 8
    gathered = ROOT_8B if zero == 3 else PARAMS_8B
    assert copy.comm_buffers - sft.comm_buffers == 2 * gathered
    assert (
        dataclasses.replace(copy, parameters=sft.parameters, comm_buffers=sft.comm_buffers) == sft
    )
    assert simpo == sft
    lora, lora_off = (
        planned(*layout, "peft=lora", *more)[0].memory
        for more in ([], [*DPO, "preference.reference=adapters_off"])
    )
    assert lora_off == lora


@pytest.mark.parametrize("ac", ["none", "full"])
def test_a_dpo_reference_runs_one_more_forward_a_micro_batch(ac):
    """The reference's forward, every micro-batch, costs what a forward costs whatever the
    checkpointing (it saves nothing, so nothing reruns): a third of an unchecked step's GEMMs (its
    matmuls and head: full DPO's GEMMs 4/3 of SFT's without checkpointing), attention's forward
    (1 of its 3.5) and a third of the elementwise work; the optimizer step is SFT's. TFLOP/s count
    it as training does: 2·N + 2·L·H·Q·T a token more, 4/3 of SFT's FLOPs. SimPO runs no
    reference."""
    from composer3d.plan.kernels import step_compute
    from composer3d.plan.shapes import stage_sets

    layout = [*DPO_LAYOUT, f"memory.activation_checkpointing={ac}"]
    (sft, cluster), (dpo, _), (simpo, _) = (
        planned(*layout, *more) for more in ([], DPO, [*DPO, "preference.loss_type=simpo"])
    )
    work = Workload.from_config(plan_config(*layout))
    c = sft.candidate
    (stages,) = stage_sets(work.shape, 1, 1, c.pp_schedule)
    local = sft.memory.optimizer / 8  # the parameters a rank's AdamW steps (8 bytes of state each)

    def parts(candidate, reference: bool):
        return step_compute(
            work.shape, candidate, stages, 4096, local, cluster, work.work, reference
        )

    policy, both = parts(c, False), parts(c, True)
    unchecked = parts(dataclasses.replace(c, activation_checkpointing="none"), False)
    if ac == "none":
        assert both.gemm == pytest.approx(4 / 3 * policy.gemm, rel=1e-12)
    assert both.gemm - policy.gemm == pytest.approx(unchecked.gemm / 3, rel=1e-12)
    assert both.attention - policy.attention == pytest.approx(unchecked.attention / 3.5, rel=1e-12)
    assert both.elementwise - policy.elementwise == pytest.approx(
        unchecked.elementwise / 3, rel=1e-12
    )
    assert (both.optimizer, both.host) == (policy.optimizer, policy.host)
    assert dpo.compute_s == pytest.approx(both.total, rel=1e-12)
    assert sft.compute_s == pytest.approx(policy.total, rel=1e-12)

    def flops_per_token(e) -> float:
        return e.tflops_per_gpu * 1e12 / e.tokens_per_s_per_gpu

    assert flops_per_token(dpo) == pytest.approx(4 / 3 * flops_per_token(sft), rel=1e-12)
    assert (simpo.compute_s, flops_per_token(simpo)) == (sft.compute_s, flops_per_token(sft))


def test_a_dpo_reference_gathers_its_blocks_again_under_zero3_and_reruns_tps_forward():
    """Communication: under ZeRO-3 the reference's forward gathers each block once more a
    micro-batch (the frozen copy's, or under adapters_off the policy's own; its root stays gathered:
    none), in bf16; under ZeRO-2 it gathers nothing (its blocks stay gathered from the first step).
    Under TP + SP its forward runs each layer's two gathers and two reduce-scatters, the embedding's
    reduce-scatter, the head's gather and the vocab-parallel loss's three fp32 values a token again.
    Gradients: as SFT's."""

    def by_kind(*overrides: str) -> dict[str, float]:
        e = planned(*overrides)[0]
        return {f"{x.dim}:{x.kind}": x.bytes for x in e.collectives}

    z3 = [*DPO_LAYOUT, "parallel.zero_stage=3"]
    sft, dpo = by_kind(*z3), by_kind(*z3, *DPO)
    micro = 2
    assert dpo["dp_shard:all_gather"] - sft["dp_shard:all_gather"] == micro * 32 * BLOCK_8B * 2
    assert dpo["dp_shard:reduce_scatter"] == sft["dp_shard:reduce_scatter"]
    lora, lora_off = (
        by_kind(*z3, "peft=lora", *more)
        for more in ([], [*DPO, "preference.reference=adapters_off"])
    )
    assert (
        lora_off["dp_shard:all_gather"] - lora["dp_shard:all_gather"] == micro * 32 * BLOCK_8B * 2
    )
    z2 = [*DPO_LAYOUT, "parallel.zero_stage=2"]
    assert by_kind(*z2, *DPO) == by_kind(*z2)
    assert by_kind(*z3, *DPO, "preference.loss_type=simpo") == sft

    tp = [
        *DPO_LAYOUT[:-1],
        "parallel.dp_shard=1",
        "parallel.tp=8",
        "parallel.sequence_parallel=true",
    ]
    sft, dpo = by_kind(*tp), by_kind(*tp, *DPO)
    tokens = 16 * 4096  # a step's, each micro-batch's once
    act = tokens * 4096 * 2
    assert dpo["tp:all_gather"] - sft["tp:all_gather"] == (2 * 32 + 1) * act
    assert dpo["tp:reduce_scatter"] - sft["tp:reduce_scatter"] == (2 * 32 + 1) * act
    assert dpo["tp:all_reduce"] - sft["tp:all_reduce"] == 3 * tokens * 4


def test_a_precomputed_reference_costs_a_step_nothing():
    """preference.reference=precomputed: its pass over the data runs before the first step, so a
    step holds no reference and runs no reference forward: memory, compute and collectives are
    SFT's to the byte (the copy's are not)."""
    z3 = [*DPO_LAYOUT, "parallel.zero_stage=3"]
    (sft, _), (pre, _), (copy, _) = (
        planned(*z3, *more) for more in ([], [*DPO, "preference.reference=precomputed"], DPO)
    )
    assert (pre.memory.total, pre.compute_s, pre.collectives) == (
        sft.memory.total,
        sft.compute_s,
        sft.collectives,
    )
    assert copy.memory.total > sft.memory.total and copy.compute_s > sft.compute_s


def test_the_search_leaves_out_the_layouts_dpo_refuses():
    """For train.objective=dpo the search (composer3d-plan, parallel=auto) weighs pipeline and
    context-parallel layouts but no V-shaped schedule (torch runs none forward only, as the
    reference runs: training refuses them; SimPO has no reference and gets them); a mixture of
    experts plans; what fits tiles no loss (refused with dpo), only the MLP."""
    from composer3d.parallel.pipeline.schedules import V_SHAPED
    from composer3d.plan.fits import Options, with_options
    from composer3d.plan.layouts import enumerate_candidates
    from composer3d.plan.validation import validate_plan

    def found(*overrides: str) -> list:
        return enumerate_candidates(plan_config(*DPO_LAYOUT, *overrides), 8, 8)

    dpo, sft, simpo = found(*DPO), found(), found(*DPO, "preference.loss_type=simpo")
    assert {(2, 1), (4, 1), (1, 2), (1, 8), (2, 2)} <= {(c.pp, c.cp) for c in dpo}
    schedules = [{c.pp_schedule for c in run if c.pp > 1} for run in (dpo, sft, simpo)]
    assert not schedules[0] & set(V_SHAPED)
    assert set(V_SHAPED) <= schedules[1] and set(V_SHAPED) <= schedules[2]
    validate_plan(plan_config(*DPO, "model=tiny_moe"))
    c = planned(*DPO_LAYOUT, *DPO)[0].candidate
    tiled = Options("full", True, False, "none")
    assert (
        with_options(c, tiled, 8192, "dpo").tile_mlp,
        with_options(c, tiled, 8192).tile_loss,
    ) == (4, 4)
    assert with_options(c, tiled, 8192, "dpo").tile_loss == 0


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_zero_bubble"])
def test_a_dpo_reference_under_pp_sends_its_forward_and_idles_its_own_ramps(schedule):
    """Under PP the reference runs every micro-batch forward before the policy's step: each stage
    but the last sends its outputs once more a micro-batch (gradients as without);
    that pass's ramps hold no backward to fill them, so its compute idles the whole (P−1)/(v·M)
    where a zero-bubble schedule leaves a third of it to the policy's."""
    layout = [
        *DPO_LAYOUT[:-1],
        "parallel.pp=2",
        "parallel.dp_shard=4",
        f"parallel.pp_schedule={schedule}",
    ]
    (sft, _), (dpo, _) = planned(*layout), planned(*layout, *DPO)

    def sends(e) -> list[float]:
        return [sum(x.bytes for x in cols if x.dim == "pp") for cols in e.collectives_per_pp_rank]

    c = dpo.candidate
    act = 4096 * 4096 * 2  # a micro-batch's hidden states: one sequence of 4096 × 4096 in bf16
    # each of a rank's v stages sends forward but the last stage (on the last rank)
    forward = [c.stages_per_rank, c.stages_per_rank - 1]
    more = [d - s for d, s in zip(sends(dpo), sends(sft))]
    assert more == [c.microbatches * act * f for f in forward] and min(sends(sft)) > 0
    ramp = (c.pp - 1) / (c.stages_per_rank * c.microbatches)
    policy_share = ramp / 3 if schedule == "interleaved_zero_bubble" else ramp
    assert sft.bubble_s == pytest.approx(sft.compute_s * policy_share, rel=1e-12)
    reference = dpo.compute_s - sft.compute_s  # its forward-only pass
    assert reference > 0.2 * sft.compute_s
    expected = sft.compute_s * policy_share + reference * ramp
    assert dpo.bubble_s == pytest.approx(expected, rel=1e-9)
    assert dpo.bubble_fraction == pytest.approx(expected / (dpo.compute_s + expected), rel=1e-9)


def test_a_pipelines_ramps_idle_for_the_collectives_a_stage_waits_for():
    """The bubble is (P−1)/(v·M) of all a stage spends on its micro-batches: under PP × TP + SP
    (and cp) its TP and cp collectives on the critical path as well as its kernels; with TP's
    hidden (plan.published_overlap) its kernels and cp's. FSDP's traffic, once a step, adds
    nothing."""
    layout = [
        *DPO_LAYOUT[:-1],
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.dp_shard=2",
        "parallel.sequence_parallel=true",
    ]
    for extra in ([], ["parallel.cp=2", "parallel.dp_shard=1"]):
        waits, _ = planned(*layout, *extra)
        c = waits.candidate
        ramp = (c.pp - 1) / (c.stages_per_rank * c.microbatches)
        exposed = waits.exposed_comm_s
        in_stage = exposed["tp"] + exposed.get("cp", 0.0)
        assert exposed["tp"] > 0.05 * waits.compute_s
        assert waits.bubble_s == pytest.approx(ramp * (waits.compute_s + in_stage), rel=1e-12)
        assert waits.bubble_fraction == pytest.approx(
            waits.bubble_s / (waits.compute_s + in_stage + waits.bubble_s), rel=1e-12
        )
        hidden, _ = planned(*layout, *extra, "plan.published_overlap=true")
        assert hidden.exposed_comm_s["tp"] == 0.0
        assert hidden.bubble_s == pytest.approx(
            ramp * (hidden.compute_s + hidden.exposed_comm_s.get("cp", 0.0)), rel=1e-12
        )
        # under cp the ring's gradient passes are waited on
        assert (exposed.get("cp", 0.0) > 0) == bool(extra)


def test_the_search_interleaves_four_and_eight_chunks_a_rank_where_the_layers_allow():
    """The search offers interleaved 1F1B and interleaved zero bubble at 2, 4 and 8 chunks a rank
    (as many stages as layers at most), looped BFS at 2 only; each doubling halves the ramps."""
    from composer3d.plan.layouts import enumerate_candidates

    cfg = plan_config(
        "model=llama3_8b",
        "train.seq_len=4096",
        "train.global_batch_size=64",
        "cluster.device=h100",
        "cluster.nodes=2",
    )
    chunks: dict[tuple[str, int], set[int]] = {}
    for c in enumerate_candidates(cfg, 16, 8):
        if c.pp > 1:
            chunks.setdefault((c.pp_schedule, c.pp), set()).add(c.stages_per_rank)
    # 32 layers: 8 chunks a rank at pp 2 and 4, 4 at pp 8, 2 at pp 16
    for schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        assert [chunks[(schedule, pp)] for pp in (2, 4, 8, 16)] == [
            {2, 4, 8},
            {2, 4, 8},
            {2, 4},
            {2},
        ], schedule
    assert chunks[("looped_bfs", 4)] == {2} and chunks[("1f1b", 4)] == {1}
    layout = [
        "model=llama3_8b",
        "train.seq_len=4096",
        "train.global_batch_size=16",
        "train.micro_batch_size=1",
        "cluster.device=h100",
        "parallel.pp=4",
        "parallel.dp_shard=2",
        "parallel.pp_schedule=interleaved_1f1b",
    ]
    bubbles = {}
    for v in (2, 4, 8):
        e, _ = planned(*layout, f"parallel.pp_stages_per_rank={v}")
        bubbles[v] = e.bubble_s / e.compute_s
    assert bubbles[2] == pytest.approx(3 / (2 * 8)) and bubbles[8] == pytest.approx(bubbles[2] / 4)


def test_the_ranks_that_decide_whether_a_layout_fits_are_the_lowest_of_each_kind():
    """Whether a layout fits, and its worst rank's memory, priced from the lowest pipeline rank of
    each kind of stage set (the search's shortcut) equal pricing every rank, over every schedule,
    checkpointing mode and pipeline degree of a search, fitting or not; where it fits, every rank
    is priced."""
    from composer3d.plan.estimate import rank_memories
    from composer3d.plan.layouts import enumerate_candidates

    cfg = plan_config(
        "model=llama3_8b",
        "train.seq_len=8192",
        "train.global_batch_size=64",
        "cluster.device=h100",
        "cluster.nodes=2",
    )
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
    work = Workload.from_config(cfg)
    candidates = [c for c in enumerate_candidates(cfg, 16, 8) if c.pp > 1]
    kinds, fitting = set(), 0
    for c in candidates[:: max(1, len(candidates) // 600)]:
        short, full = rank_memories(work, c, cluster), rank_memories(work, c, cluster, True)
        assert short.fits == full.fits and short.worst == full.worst, c
        assert (short.complete or not short.fits) and full.complete
        kinds.add((c.pp_schedule, c.activation_checkpointing, c.pp))
        fitting += short.fits
    assert fitting > 20 and len(kinds) > 40, (fitting, len(kinds))


def _dpo_rank(tmp_path: Path, *layout: str):
    """(config, the planner's estimate) of a DPO run of the 4-layer model on 2 ranks of the CPU, on
    pairs of short phrases (prompt, chosen, rejected) that fit a row of 128 tokens."""
    from composer3d.config.checks import validate

    words = "the quick brown fox jumps over the lazy dog while pipeline parallel splits".split()

    def phrase(i: int, n: int) -> str:
        return " ".join(words[(i * 5 + k) % len(words)] for k in range(n))

    rows = [
        {
            "prompt": phrase(i, 3) + ":",
            "chosen": " " + phrase(i + 3, 2),
            "rejected": " " + phrase(i + 7, 3),
        }
        for i in range(64)
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = plan_config(
        *(o for o in MODEL if not o.startswith(("data=", "train.seq_len="))),
        "train.seq_len=128",  # the pairs' rows
        *BATCH,
        *layout,
        "data=preference",
        f"data.paths=[{pairs}]",
        "train.objective=dpo",
        "cluster.device=cpu",
        "cluster.gpus_per_node=2",
        "launch.nproc_per_node=2",
        f"run.dir={tmp_path / 'run'}",
    )
    validate(cfg, 2)
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
    return cfg, estimate(Workload.from_config(cfg), candidate_from_config(cfg, 2), cluster), cluster


@pytest.mark.parametrize("reference", ["copy", "precomputed"])
def test_a_dpo_rank_measured_here_meets_the_planner_with_its_reference(tmp_path, reference):
    """plan.measure of a DPO rank, in this process (rank 0 of FSDP 2 under ZeRO-2, torch's fake
    backend): the frozen copy's shards count in its model state, and in its peak what the copy's
    forward leaves gathered (every parameter, in the compute dtype: FSDP reshards them in backward
    only); both meet the planner's at the bars above (model state within 2%, the peak within 15%:
    measured 1.05× the prediction, 1.30× without the copy's terms). With precomputed reference
    log-probabilities a step holds no copy, and the measure takes no pass over the data."""
    from composer3d.plan.measure import comparison, measure_rank

    cfg, e, cluster = _dpo_rank(
        tmp_path,
        "parallel.dp_shard=2",
        "parallel.zero_stage=2",
        f"preference.reference={reference}",
    )
    result = comparison(measure_rank(cfg, 2, 0, 1), e, cluster)
    measured, predicted = result["measured"], result["predicted"]
    assert _rel(measured["model_state_bytes"], predicted["model_state_bytes"]) < 0.02, result
    assert _rel(measured["peak_bytes"], predicted["peak_bytes"]) < 0.15, result


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.dp_shard=2"],
        ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true"],
        ["parallel.dp_shard=1", "parallel.pp=2"],
        ["parallel.dp_shard=1", "parallel.cp=2", "parallel.cp_style=ring"],
    ],
    ids=["fsdp", "tp2_sp", "pp2", "cp2_ring"],
)
def test_a_dpo_ranks_collectives_are_the_planners(tmp_path, layout):
    """A DPO step's all-gathers, reduce-scatters and pipeline sends on rank 0 of 2 (in this
    process, torch's fake backend: every collective dispatched is counted, as the measurements above
    count them) are the planner's within 2%: under ZeRO-3 the copy's blocks gathered once more a
    micro-batch, its root not again; under TP + SP its forward's gathers and reduce-scatters
    (measured to the byte); under PP the first stage's outputs sent for the reference's pass and the
    policy's (its stages built with their boundary's shapes, as plan.measure builds them: no other
    stage answers here); under cp's ring the keys and values passed for the reference's forward
    too."""
    import torch.distributed as dist
    from plan_measure import CollectiveBytes
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from composer3d.data import build_sequences
    from composer3d.launch.distributed import Env
    from composer3d.launch.rank import prepare_rank
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.trainer import Trainer

    cfg, e, _ = _dpo_rank(tmp_path, *layout)
    resolved, device = prepare_rank(cfg, Env(0, 0, 2))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        t = cfg.train
        sequences = build_sequences(cfg.data, cfg.model.vocab_size, t.seq_len, t.seed, cfg.model)
        mesh = ParallelMesh(resolved, device.type)
        trainer = Trainer(cfg, mesh, device, sequences, static_pipeline=resolved.pp > 1)
        trainer.train_step()  # the first: what the copy's forward keeps gathered is gathered here
        trainer.zero_grad()
        comms = CollectiveBytes()
        with comms:
            trainer.train_step()
        trainer.close()
    finally:
        dist.destroy_process_group()
    want: dict[str, float] = {}
    for col in e.collectives_per_pp_rank[0]:  # rank 0's: the first stage
        key = f"{col.kind}/{col.group_size}"
        want[key] = want.get(key, 0.0) + col.bytes
    for key in [k for k in ("all_gather/2", "reduce_scatter/2", "send/2") if k in want]:
        assert _rel(comms.bytes[key], want[key]) < 0.02, (key, comms.bytes, want)
    assert ("send/2" in want) == any(o in layout for o in ("parallel.pp=2", "parallel.cp=2")), want


def _plan(*overrides: str, cli: bool = False) -> subprocess.CompletedProcess:
    """composer3d-plan ``overrides``: in this process (what it prints and its exit code), or with
    ``cli`` as a user runs it (plan.measure's process group is its own)."""
    if not cli:
        return command_output("composer3d.commands.plan", *overrides)
    return subprocess.run(
        [sys.executable, "-m", "composer3d.commands.plan", *overrides],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plan_ranks_layouts_as_json_and_reports_one_layout():
    search = _plan(
        "model=llama3_8b",
        "train.seq_len=8192",
        "train.global_batch_size=32",
        "cluster.nodes=4",
        "plan.format=json",
        "plan.top=5",
    )
    assert search.returncode == 0, search.stderr
    rows = [json.loads(line) for line in search.stdout.splitlines()]
    assert len(rows) == 5
    for row in rows:
        for key in (
            "layout",
            "memory_bytes_per_gpu",
            "step_time_s",
            "tokens_per_s_per_gpu",
            "tflops_per_gpu",
            "mfu",
            "bubble_fraction",
        ):
            assert key in row, key
        assert row["memory_bytes_per_gpu"] <= 79 * 2**30 * 0.9
    tokens, memory = (
        [r["tokens_per_s_per_gpu"] for r in rows],
        [r["memory_bytes_per_gpu"] for r in rows],
    )
    # faster first; within 0.1% of each other (equals to the planner), smaller first
    for i in range(len(rows) - 1):
        assert tokens[i] >= tokens[i + 1] or (
            tokens[i + 1] <= 1.001 * tokens[i] and memory[i] <= memory[i + 1]
        ), rows
    one = _plan(
        "model=llama3_8b",
        "train.seq_len=8192",
        "train.global_batch_size=32",
        "cluster.nodes=4",
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.pp_schedule=interleaved_1f1b",
    )
    assert one.returncode == 0, one.stderr
    for part in (
        "parameters",
        "optimizer",
        "activations",
        "logits",
        "comm_buffers",
        "dp_shard",
        "tp",
        "pp",
        "bubble",
        "MFU",
        "tokens/s per GPU",
    ):
        assert part in one.stdout, part


def test_plan_of_a_mixture_of_experts_weighs_expert_parallel():
    """A MoE shape (Llama 3 8B with 8 experts of its MLP's width, top-2): the search tries ep
    degrees, and a layout with ep reports the all-to-all and the experts' own FSDP group, whose
    sharding ep divides."""
    moe = [
        "model=llama3_8b",
        "model.moe.experts=8",
        "model.moe.top_k=2",
        "model.moe.dense_layers=0",
        "train.seq_len=4096",
        "train.global_batch_size=64",
        "cluster.nodes=2",
    ]
    search = _plan(*moe, "plan.format=json", "plan.top=200")
    assert search.returncode == 0, search.stderr
    rows = [json.loads(line) for line in search.stdout.splitlines()]
    with_ep = [r for r in rows if r["layout"]["ep"] > 1]
    assert with_ep and all("ep:all_to_all" in r["comm_bytes_per_step"] for r in with_ep)
    assert not any(
        "ep:all_to_all" in r["comm_bytes_per_step"] for r in rows if r["layout"]["ep"] == 1
    )
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=1"]
    reports = {ep: _plan(*moe, *layout, f"parallel.ep={ep}", "plan.format=json") for ep in (1, 4)}
    one, four = (json.loads(reports[ep].stdout) for ep in (1, 4))
    assert (
        "expert_dp:all_gather" in four["comm_bytes_per_step"]
        and "ep:all_to_all" in four["comm_bytes_per_step"]
    )
    # dp_shard is 8: ep=4 leaves the experts sharded over 2 ranks, ep=1 over 8 — the same bytes of
    # model state
    assert four["memory_breakdown_bytes"]["parameters"] == pytest.approx(
        one["memory_breakdown_bytes"]["parameters"], rel=0.01
    )
    # but each rank gathers a quarter of the experts (the bulk of the model), over a group of 2
    # instead of 8
    assert "expert_dp:all_gather" not in one["comm_bytes_per_step"]
    gathered = (
        four["comm_bytes_per_step"]["expert_dp:all_gather"]
        + four["comm_bytes_per_step"]["dp_shard:all_gather"]
    )
    assert gathered < one["comm_bytes_per_step"]["dp_shard:all_gather"] / 3


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_plan_counts_a_hugging_face_mixture_of_experts(model_type, tmp_path):
    """A transformers mixture of experts planned from its config.json: its parameters are the
    model's own (the experts counted one by one, not as one dense MLP; what is left out are q/k
    norms, biases and Qwen2-MoE's shared expert gate), its routed experts' are the model's experts',
    its active ones leave out all but top_k of them; and a layout with ep plans, its tokens
    exchanged over the ep ranks."""
    from hf_models import make_model
    from transformers import AutoModelForCausalLM

    from composer3d.config.checks import resolve_model_config
    from composer3d.plan.shapes import ModelShape

    path = make_model(tmp_path / model_type, model_type, tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    real = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose("train", overrides=["model=hf", f"model.path={path}"])
    resolve_model_config(cfg.model)
    shape = ModelShape.from_config(cfg.model)
    config = model.config
    assert shape.moe.experts == 8 and shape.moe.top_k == config.num_experts_per_tok
    assert shape.num_params == pytest.approx(real, rel=0.01) and shape.num_params <= real
    experts = sum(
        math.prod(p)
        for i in range(shape.n_layers)
        if shape.is_moe(i)
        for p in shape.expert_params(1, 1)
    )
    assert experts == routed
    assert (
        shape.num_params - shape.num_active_params == routed * (8 - config.num_experts_per_tok) // 8
    )
    proc = _plan(
        "model=hf",
        f"model.path={path}",
        "model.pretrained=false",
        "cluster.gpus_per_node=2",
        "parallel.ep=2",
        "plan.format=json",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["comm_bytes_per_step"]["ep:all_to_all"] > 0, (
        proc.stdout
    )


def test_plan_counts_a_sliding_window_models_flops_as_training_does(tmp_path):
    """Gemma 3's layers alternate a 24-token window with full attention (transformers' layer_types):
    the planner's FLOPs per token, as training's, count the scores a windowed layer needs, 24 · (64
    − 24 + 1) / 2 = 492 of a 32-token causal layer's 528."""
    from hf_models import make_model

    from composer3d.config.checks import resolve_model_config
    from composer3d.plan.shapes import ModelShape

    path = make_model(tmp_path / "gemma3_text", "gemma3_text", tokenizer=False)
    cfg = plan_config("model=hf", f"model.path={path}")
    resolve_model_config(cfg.model)
    shape = ModelShape.from_config(cfg.model)
    assert shape.windows == (24, 0, 24, 0)
    full = 6 * (shape.num_active_params - shape.embedding_numel)
    attention = 6 * shape.n_heads * shape.head_dim * 32
    assert shape.flops_per_token(32) == round(full + (2 * 492 / 528 + 2) * attention)
    assert shape.flops_per_token(16) == full + 4 * attention // 2  # the window covers all 16 tokens
    # plan.what_fits grows the layers: the pattern repeats (8 layers, 4 of them windowed)
    grown = dataclasses.replace(shape, n_layers=8)
    assert grown.flops_per_token(32) == round(
        6 * (grown.num_active_params - grown.embedding_numel) + (4 * 492 / 528 + 4) * attention
    )


def test_plan_refuses_a_mixture_of_experts_it_cannot_count(tmp_path):
    """Dense layers between MoE ones (Qwen3-MoE's mlp_only_layers): no native shape has them;
    refused naming model.path and why, not planned as if the dense layers came first."""
    from hf_models import make_model

    path = make_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer=False, mlp_only_layers=[1])
    proc = _plan("model=hf", f"model.path={path}", "model.pretrained=false")
    assert proc.returncode == 2, proc.stderr
    assert "model.path" in proc.stderr and "mlp_only_layers=[1]" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "override, key",
    [
        ("parallel.ep=2", "parallel.ep"),
        ("cluster.device=tpu", "cluster.device"),
        ("plan.format=csv", "plan.format"),
        ("cluster.hbm_gbps=0", "cluster.hbm_gbps"),
        ("plan.attention_kernel=flash3", "plan.attention_kernel"),
        ("plan.norm_kernel=triton", "plan.norm_kernel"),
        ("plan.ep_dispatch=deepep", "plan.ep_dispatch"),
    ],
)
def test_plan_refuses_bad_input_in_one_line(override, key):
    proc = _plan("model=llama3_8b", override)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and key in proc.stderr, proc.stderr


def test_a_cluster_no_layout_fits_is_refused_with_what_the_smallest_needs():
    """The search prices only the layouts that fit in full; where none does, the refusal names the
    least memory any layout needs, and a device that size (its headroom added) plans."""
    small = _plan("model=llama3_8b", "cluster.gpus_per_node=2", "cluster.memory_gib=10")
    assert small.returncode == 2 and small.stderr.strip().count("\n") == 0, small.stderr
    found = re.search(r"(\d+) valid layouts tried; the smallest needs ([\d.]+) GiB", small.stderr)
    assert "cluster.nodes" in small.stderr and found, small.stderr
    need = float(found[2])
    headroom = plan_config().plan.memory_headroom
    large = _plan(
        "model=llama3_8b",
        "cluster.gpus_per_node=2",
        f"cluster.memory_gib={(need + 0.1) / headroom:.2f}",
        "plan.format=json",
        "plan.top=1000",
    )
    assert large.returncode == 0, large.stderr
    rows = [json.loads(line) for line in large.stdout.splitlines()]
    assert 0 < len(rows) < int(found[1])
    assert min(r["memory_bytes_per_gpu"] for r in rows) / 2**30 == pytest.approx(need, abs=0.05)


def test_parallel_auto_trains_and_records_its_choice(tmp_path):
    run = train(tmp_path, *FAST, "parallel=auto", "train.steps=2", nproc=2)
    auto = run.run_info["parallel_auto"]
    assert auto["overrides"] and auto["why"] and "prediction" in auto
    assert "parallel=auto chose" in run.output
    assert (
        run.run_info["layout"]["pp"]
        * run.run_info["layout"]["tp"]
        * run.run_info["layout"]["dp_shard"]
        * run.run_info["layout"]["dp_replicate"]
        == 2
    )


@pytest.mark.parametrize("ac", ["none", "full"])
def test_activation_offload_keeps_two_blocks_on_the_device(ac):
    """memory.activation_offload: the device keeps the saved tensors of the block in backward and
    the one prefetched (2 of Llama 3 8B's 32), the other 30 are host memory; nothing else moves, and
    the search keeps the option in the layouts it proposes."""
    from composer3d.plan.layouts import enumerate_candidates

    register_configs()
    args = [
        "model=llama3_8b",
        "train.seq_len=8192",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.dp_shard=8",
        "cluster.device=h100",
        f"memory.activation_checkpointing={ac}",
    ]
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        plain_cfg, offload_cfg = (
            compose("train", overrides=[*args, *extra])
            for extra in ([], ["memory.activation_offload=true"])
        )
    cluster = cluster_from_config(plain_cfg.cluster, plain_cfg.precision.param_dtype)
    plain, offload = (
        estimate(Workload.from_config(cfg), candidate_from_config(cfg, cluster.world_size), cluster)
        for cfg in (plain_cfg, offload_cfg)
    )
    before, after = plain.memory.as_dict(), offload.memory.as_dict()
    # full checkpointing keeps each block's input (8192 tokens × 4096, bf16); without it, every
    # block the same share of what the forward keeps; a block's recomputation in backward stays on
    # the device
    moved = 30 * 8192 * 4096 * 2 if ac == "full" else before["activations"] * 30 / 32
    assert after["host_activations"] == pytest.approx(moved, rel=1e-9)
    assert after["activations"] + after["host_activations"] == pytest.approx(
        before["activations"], rel=1e-9
    )
    assert before["host_activations"] == 0 and after["total"] < before["total"]
    assert {k: v for k, v in after.items() if "activations" not in k and k != "total"} == {
        k: v for k, v in before.items() if "activations" not in k and k != "total"
    }
    assert "memory.activation_offload=true" in offload.candidate.overrides()
    assert all(c.activation_offload for c in enumerate_candidates(offload_cfg, 8, 8))


# Op-level selective checkpointing, per memory.ac_policy
SELECTIVE = ["memory.activation_checkpointing=selective", "memory.ac_every=0"]
# (ranks, overrides): 1,024 tokens a step, so that the blocks' activations lead the peak
AC_POLICY_LAYOUTS = {
    "dense": (1, [*MODEL, "model.vocab_size=256", "train.seq_len=256"]),
    "moe": (
        1,
        [*MOE, "train.seq_len=256"],
    ),  # one dense layer, three with a shared expert beside the routed ones
    "tp2_sp": (
        2,
        [
            *MODEL,
            "model.vocab_size=256",
            "train.seq_len=256",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.dp_shard=1",
        ],
    ),
}


@pytest.mark.parametrize("layout", list(AC_POLICY_LAYOUTS))
def test_alternate_matmuls_keeps_less_by_what_one_measured_rank_shows(layout):
    """memory.ac_policy=alternate_matmuls recomputes a block's 2nd, 4th, … linear matmul (wk, wo,
    w3; in a MoE block wk, wo and the shared expert's w1 and w2) instead of keeping its output: the
    planner's peak falls below all_matmuls's by what rank 0 measures (plan.measure's tracker, fake
    process group, one step each), within 10% of the difference (it is exact), and each peak is
    within 5% (measured: 1–3%; under TP + SP it was 17% low while the planner left out the outputs
    of TP's collectives, which both policies keep). At this vocabulary both peaks fall in backward,
    where the block being recomputed holds all its activations whatever the policy: the difference
    is the other blocks' (at vocab 512 the planner puts all_matmuls's at the end of forward and the
    difference is 8% off). The planner used to give both policies the same activations."""
    from composer3d.config.checks import validate
    from composer3d.plan.measure import measure_rank

    register_configs()
    ranks, overrides = AC_POLICY_LAYOUTS[layout]
    predicted, measured = {}, {}
    threads = torch.get_num_threads()
    # one thread, as a worker runs (tests/harness.py): ten times faster on this machine
    torch.set_num_threads(1)
    try:
        for policy in ("all_matmuls", "alternate_matmuls"):
            with initialize_config_module(config_module="composer3d.conf", version_base=None):
                cfg = compose(
                    "train",
                    overrides=[
                        *overrides,
                        "train.global_batch_size=4",
                        "train.micro_batch_size=4",
                        *SELECTIVE,
                        f"memory.ac_policy={policy}",
                        "run.dir=unused",
                        f"launch.nproc_per_node={ranks}",
                        "cluster.device=cpu",
                        f"cluster.gpus_per_node={ranks}",
                    ],
                )
            validate(cfg, ranks)
            cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
            predicted[policy] = estimate(
                Workload.from_config(cfg), candidate_from_config(cfg, ranks), cluster
            ).memory.total
            measured[policy] = measure_rank(cfg, ranks, 0, 1).peak_bytes
    finally:
        torch.set_num_threads(threads)
    for policy in predicted:
        assert _rel(predicted[policy], measured[policy]) < 0.05, (policy, predicted, measured)
    saved = {
        name: d["all_matmuls"] - d["alternate_matmuls"]
        for name, d in (("predicted", predicted), ("measured", measured))
    }
    assert saved["measured"] > 0.05 * measured["all_matmuls"], (saved, measured)
    assert abs(saved["predicted"] - saved["measured"]) < 0.1 * saved["measured"], (
        saved,
        predicted,
        measured,
    )


# Op-level selective over blocks that all-gather: the gathered tensors recomputed (default) or kept
# (memory.ac_save_gathers): tp=2 + SP's inputs of attention and the feed-forward,
# cp_style=allgather's K/V
GATHERING = {
    "tp2_sp": [
        *MODEL,
        "model.vocab_size=256",
        "train.seq_len=256",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.dp_shard=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
    ],
    # vocab 2048: the logits hold the peak at the end of forward (at 512 a block's recomputation in
    # backward comes within a few percent of it, and which of the two holds it is then not the
    # planner's)
    "cp2_allgather": [
        o if not o.startswith("model.vocab_size=") else "model.vocab_size=2048"
        for o in LAYOUTS_2["cp2_allgather"]
    ],
}
GATHER_JOBS = {
    (name, keep): [*job, *SELECTIVE, f"memory.ac_save_gathers={str(keep).lower()}"]
    for name, job in GATHERING.items()
    for keep in (False, True)
}


def _gather_bytes(collectives) -> float:
    return sum(c.bytes for c in collectives if (c.kind, c.group_size) == ("all_gather", 2))


def test_op_level_selective_gathers_again_in_backward_for_less_memory(tmp_path):
    """The gathered tensors are recomputed by default: backward all-gathers them again (under tp=2 +
    SP each block's two inputs, 2·L·tokens·dim·4 bytes more on a rank; under cp=2 allgather each
    block's K/V), and every rank's peak is lower by what the planner predicts, within 2% of the
    difference (measured: to the byte, 3 MiB or 11% of the TP rank's peak, 128 KiB of the cp rank's;
    the peak falls in backward: all blocks' kept tensors but the one recomputing, whose whole
    activations exist either way). memory.ac_save_gathers=true keeps them: no all-gather in backward
    but those of the reduce-scatters' gradients and FSDP's."""
    runs = dict(zip(GATHER_JOBS, run_measurements(list(GATHER_JOBS.values()), 2, tmp_path)))
    est = {job: _predict(overrides, 2) for job, overrides in GATHER_JOBS.items()}
    for name in GATHERING:
        regather, keep = runs[name, False], runs[name, True]
        predicted = _gather_bytes(est[name, False].collectives_per_pp_rank[0]) - _gather_bytes(
            est[name, True].collectives_per_pp_rank[0]
        )
        if name == "tp2_sp":
            assert predicted == 2 * 4 * (4 * 256) * 128 * 4, predicted
        for rank in range(2):
            regathered = (
                regather[rank]["collective_bytes"]["all_gather/2"]
                - keep[rank]["collective_bytes"]["all_gather/2"]
            )
            assert regathered > 0 and _rel(predicted, regathered) < 0.02, (
                name,
                rank,
                predicted,
                regathered,
            )
        peak = {k: max(r["peak_bytes"] for r in runs[name, k]) for k in (False, True)}
        total = {k: est[name, k].memory.total for k in (False, True)}
        saved = {"measured": peak[True] - peak[False], "predicted": total[True] - total[False]}
        assert saved["measured"] > 0 and _rel(saved["predicted"], saved["measured"]) < 0.02, (
            name,
            saved,
            peak,
        )
        for k in (False, True):
            assert _rel(total[k], peak[k]) < 0.15, (name, k, total, peak)
    tp_peak = max(r["peak_bytes"] for r in runs["tp2_sp", True])
    assert tp_peak - max(r["peak_bytes"] for r in runs["tp2_sp", False]) > 0.05 * tp_peak


LLAMA_3B = ["model.dim=3072", "model.n_layers=28", "model.n_heads=24", "model.ffn_hidden_dim=8192"]
H200_1B = [
    "model=llama3_1b",
    "model.tie_embeddings=false",
    "train.seq_len=8192",
    "train.global_batch_size=1",
    "train.micro_batch_size=1",
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "cluster.device=h200",
    "parallel.dp_shard=1",
    *SELECTIVE,
]


@pytest.mark.parametrize(
    "overrides, measured_gib",
    [
        (
            ["compile.enabled=false"],
            28.94,
        ),  # eager: precision.cast=auto is params, cast_once's copies kept
        (
            ["compile.enabled=true"],
            26.21,
        ),  # compiled: autocast, each block's casts made again in its recomputation
        (["compile.enabled=true", "memory.ac_policy=alternate_matmuls"], 23.58),
        (
            ["compile.enabled=false", "precision.cast=autocast"],
            28.52,
        ),  # eager autocast: its cache holds every cast
        # without checkpointing, compiled (autocast) and eager (params, cast_once)
        (["compile.enabled=true", "memory.activation_checkpointing=none"], 31.02),
        (["compile.enabled=false", "memory.activation_checkpointing=none"], 33.50),
        (
            ["compile.enabled=true", *LLAMA_3B],
            57.82,
        ),  # the 3B (2026-11-28): its peak is the end of forward
    ],
)
def test_one_device_peak_follows_how_it_casts(overrides, measured_gib):
    """The peaks one H200 measured (docs/performance.md: the loss's gradient written over the
    logits, 2026-11-27; the autocast rows again on 2026-11-28, the head casting its weight in
    backward: Llama 3.2 1B dims, untied head, 8192 tokens) within 3%: whole bf16 copies of the
    weights under precision.cast=params; under autocast compiled, the recomputing block's (an
    embedding lookup casts none, the head keeps none: the compiled rows fell 0.46 GiB with it);
    eager, every block's until forward ends (that row did not move: 28.52 GiB before and after,
    predicted 2.7% low). Charging compiled autocast every weight's copy, as a matmul without
    checkpointing keeps it, predicted the compiled rows 8-9% high; eager autocast one block's, 7%
    low (28.5 GiB measured, 26.6 predicted). Not here: the 3B under alternate_matmuls, 54.07 GiB
    measured and 52.40 predicted (-3.1%). Its allocator trace puts the peak just after the head's
    backward with 10.6 GiB of the blocks' saved tensors, where the same compiled block on the CPU
    keeps the planner's 9.2 to the byte: inductor's CUDA partition of that block keeps more."""
    est, _ = planned(*H200_1B, *overrides)
    assert _rel(est.memory.total / 2**30, measured_gib) < 0.03, (
        est.memory.total / 2**30,
        measured_gib,
    )


BLOCK = (
    64,
    4,
    2,
    192,
)  # dim, heads, KV heads, ffn: a tiny block, built as TransformerBlock and as the config
BLOCK_DIMS = [
    "model=tiny",
    *(
        f"model.{key}={value}"
        for key, value in zip(("dim", "n_heads", "n_kv_heads", "ffn_hidden_dim"), BLOCK)
    ),
]
BLOCK_TOKENS = 128


def _kept_by_block(compiled: bool, autocast: bool = True, policy: str | None = None) -> int:
    """Bytes one block (BLOCK_DIMS, fp32 weights under bf16 autocast, else bf16 weights) keeps for
    backward on the CPU: its saved tensors but the weights' casts (the planner counts those with the
    casts) and RoPE's tables (every block's, once); under ``policy``, op-level selective
    checkpointing by it, as training wraps a block."""
    from composer3d.memory.activation_checkpointing import apply_activation_checkpointing
    from composer3d.models.llama import TransformerBlock, rope_tables

    dtype = torch.float32 if autocast else torch.bfloat16
    holder = torch.nn.Module()
    dim, heads = BLOCK[:2]
    holder.layers = torch.nn.ModuleDict({"0": TransformerBlock(*BLOCK, 1e-5).to(dtype)})
    if policy:
        apply_activation_checkpointing(holder, "selective", 0, policy)
    block = holder.layers["0"]
    if compiled:
        block.compile()
    x = torch.randn(1, BLOCK_TOKENS, dim, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(dim // heads, BLOCK_TOKENS, 10000.0)
    weights = {
        shape for p in block.parameters() for shape in (tuple(p.shape), tuple(p.shape[::-1]))
    }
    tables = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        if tuple(t.shape) not in weights and t.untyped_storage().data_ptr() not in tables:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    try:
        for _ in range(2):  # the first compiles
            saved.clear()
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), hooks:
                out = block(x, cos, sin, None)
            out.float().sum().backward()
    finally:
        # this block's graph does not count towards other tests' recompile limits
        torch._dynamo.reset()
    return sum(saved.values())


def _planned_block(autocast: bool, *memory: str) -> float:
    """The planner's bytes per token one compiled BLOCK_DIMS block keeps."""
    from composer3d.plan.activations import layer_activations
    from composer3d.plan.shapes import ModelShape

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose("train", overrides=[*BLOCK_DIMS, *memory, "precision.param_dtype=bfloat16"])
    return (
        2
        * layer_activations(
            ModelShape.from_config(cfg.model),
            candidate_from_config(cfg, 1),
            False,
            2,
            compiled=True,
            fp32_residual=autocast,
        ).saved
    )


def test_a_compiled_block_keeps_what_the_planner_counts_without_checkpointing():
    """A compiled block without checkpointing under bf16 autocast on the CPU: the bytes its graph
    keeps for backward (its fp32 input, autocast's residual stream, included; the weights' bf16
    casts, which the planner counts with the casts, left out) are the planner's per-token count to
    the byte. Eager keeps q's projection, o's input and the SiLU output too: counting those for
    compiled runs predicted the H200's 33.0 GiB 7.5% high."""
    compiled, eager = _kept_by_block(True), _kept_by_block(False)
    count = _planned_block(True, "memory.activation_checkpointing=none")
    assert compiled == count * BLOCK_TOKENS, (compiled, count * BLOCK_TOKENS)
    assert eager > 1.2 * compiled, (eager, compiled)


@pytest.mark.parametrize("policy", ["all_matmuls", "alternate_matmuls"])
def test_a_compiled_block_keeps_what_the_planner_counts_under_op_level_checkpointing(policy):
    """A compiled block under op-level selective checkpointing, on the CPU, under autocast (its fp32
    input kept) and with bf16 weights (FSDP's way to bf16): what its graph keeps is the planner's
    count to the byte. Counting what eager checkpointing keeps (w2's output, which backward never
    reads, included) came within 0.5% under autocast only as the fp32 input's extra bytes made up
    for w2's, and was 8% high in bf16."""
    selective = [
        "memory.activation_checkpointing=selective",
        "memory.ac_every=0",
        f"memory.ac_policy={policy}",
    ]
    for autocast in (True, False):
        kept = _kept_by_block(True, autocast, policy)
        count = _planned_block(autocast, *selective)
        assert kept == count * BLOCK_TOKENS, (autocast, kept, count * BLOCK_TOKENS)


ONE_H100_8B = [
    "model=llama3_8b",
    "train.seq_len=4096",
    "train.global_batch_size=1",
    "train.micro_batch_size=1",
    "cluster.gpus_per_node=1",
    "parallel.dp_shard=1",
    "memory.activation_checkpointing=full",
]


def test_offload_moves_model_state_to_the_host_and_costs_its_copies_and_host_step():
    """Llama 3 8B on one H100: it fits only with ZeRO-Offload (its fp32 parameters and gradients
    alone are 64 GB); offload=optimizer moves the optimizer's state (masters, moments, a gradient
    buffer) and pays its copies and host step on the critical path; a node with too little host
    memory for what moved does not fit."""
    plain, cluster = planned(*ONE_H100_8B)
    opt, _ = planned(*ONE_H100_8B, "parallel.offload=optimizer")
    cpu, _ = planned(*ONE_H100_8B, "parallel.offload=cpu")
    params, grads, state = plain.memory.parameters, plain.memory.gradients, plain.memory.optimizer
    assert (
        opt.memory.optimizer == 0
        and opt.memory.parameters == params
        and opt.memory.host == params + grads + state
    )
    assert cpu.memory.parameters == cpu.memory.gradients == cpu.memory.optimizer == 0
    assert cpu.memory.host == params + grads + state
    assert not plain.fits and opt.fits and cpu.fits, (
        plain.memory.total,
        opt.memory.total,
        cpu.memory.total,
    )
    assert cpu.memory.total < opt.memory.total < plain.memory.total
    assert "host" not in plain.exposed_comm_s
    assert opt.exposed_comm_s["host"] == pytest.approx(
        (params + grads) / cluster.host_link_bw + params / cluster.host_optimizer_bw
    )
    # the host step; its copies overlap
    assert cpu.exposed_comm_s["host"] >= params / cluster.host_optimizer_bw
    assert cpu.step_time_s > plain.step_time_s
    small, _ = planned(*ONE_H100_8B, "parallel.offload=cpu", "cluster.host_memory_gib=64")
    assert not small.fits  # 8B's ~120 GiB of model state does not fit a 64 GiB host
    # offload_dir: the masters and moments in files (the gradient buffer stays in host memory), read
    # and written back by every host step at the disk's rate; that host fits it
    files, _ = planned(
        *ONE_H100_8B,
        "parallel.offload=optimizer",
        "parallel.offload_dir=/nvme",
        "cluster.host_memory_gib=64",
    )
    assert files.memory.disk == params + state and files.memory.host == grads and files.fits
    assert files.exposed_comm_s["host"] == pytest.approx(
        opt.exposed_comm_s["host"] + 2 * files.memory.disk / cluster.disk_bw
    )


# -- optim.name=muon ------------------------------------------------------------------------------

MUON = ["optim.name=muon"]
MUON_LAYOUTS = {
    "one_device": (MODEL, [], 1, 1),
    "fsdp4": (MODEL, ["parallel.dp_shard=4"], 4, 1),
    # each rank's flat slices (a quarter of every parameter), and their fp32 masters (bf16 gathers)
    "zero1": (MODEL, ["parallel.dp_shard=4", "parallel.zero_stage=1"], 4, 1),
    "ep2_fsdp4_moe": (MOE, ["parallel.dp_shard=4", "parallel.ep=2"], 4, 2),
    # the router left to Muon too (by default optim.muon_adamw_params names it)
    "ep2_fsdp4_moe_router": (
        MOE,
        ["parallel.dp_shard=4", "parallel.ep=2", "optim.muon_adamw_params=[]"],
        4,
        2,
    ),
}


def _muon_shapes(overrides: list[str]) -> list[tuple[torch.Size, bool]]:
    """Each of the model's parameters' shape (built on meta) and whether Muon steps it, by Muon's
    own rule (optim/muon.py's ``muon_parameter``) and the config's patterns."""
    from composer3d.models import build_model
    from composer3d.optim.muon import muon_parameter

    cfg = plan_config(*overrides)
    with torch.device("meta"):
        model = build_model(cfg.model)
    patterns = list(cfg.optim.muon_adamw_params)
    return [(p.shape, muon_parameter(n, p, patterns)) for n, p in model.named_parameters()]


def _muon_split(overrides: list[str], ranks: int, ep: int = 1) -> tuple[int, int]:
    """(elements Muon steps, elements AdamW steps) of a rank's FSDP shards over ``ranks`` (the
    routed experts cut by ``ep`` first, then FSDP over what it leaves)."""
    split = [0, 0]
    for shape, muon in _muon_shapes(overrides):
        rows, rest = shape[0], math.prod(shape[1:])
        if len(shape) == 3:  # [experts, out, in]
            local = math.ceil(rows // ep / (ranks // ep)) * rest
        else:
            local = math.ceil(rows / ranks) * rest
        split[not muon] += local
    return split[0], split[1]


@pytest.mark.parametrize("layout", list(MUON_LAYOUTS))
def test_muon_keeps_one_momentum_for_its_matrices_and_adams_two_moments_for_the_rest(layout):
    """optim.name=muon's state: one fp32 momentum (4 bytes) for each element of the block matrices
    and the stacked experts (the router too where optim.muon_adamw_params leaves it), AdamW's two
    fp32 moments (8) for the embedding, head and norms (and the router by default), as FSDP shards
    each parameter (and ep the experts): the model's parameters counted by hand. It differs from
    AdamW's by 4 bytes for each of Muon's elements, and in nothing else."""
    model, parallel, ranks, ep = MUON_LAYOUTS[layout]
    overrides = [*model, *BATCH, f"cluster.gpus_per_node={ranks}", *parallel]
    muon, rest = _muon_split([*overrides, *MUON], ranks, ep)
    assert muon and rest
    with_muon, with_adamw = planned(*overrides, *MUON)[0].memory, planned(*overrides)[0].memory
    masters = 4 * (muon + rest) if layout == "zero1" else 0
    assert with_muon.optimizer == 4 * muon + 8 * rest + masters
    assert with_adamw.optimizer - with_muon.optimizer == 4 * muon
    assert dataclasses.replace(with_muon, optimizer=with_adamw.optimizer) == with_adamw


MUON_STEP = [
    *MODEL,
    "train.seq_len=2048",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "cluster.device=h100",
    "cluster.gpus_per_node=4",
]


def _newton_schulz_s(rows: int, cols: int, cluster) -> float:
    """One matrix's 5 Newton–Schulz steps in bf16 on an H100, by hand: the runtime's FLOPs
    (orthogonalize.newton_schulz_flops) at the GEMMs' fraction of peak, and HBM bytes: per step the
    three GEMMs' operands and outputs (2nm + n², 3n², n² + 2nm) and the elementwise kernels between
    them (7n² + 5nm), and one normalization (3nm); n the smaller side."""
    from composer3d.optim.orthogonalize import newton_schulz_flops

    n, m = sorted((rows, cols))
    moved = 5 * (9 * n * m + 12 * n * n) + 3 * n * m
    rate = cluster.peak_flops * cluster.achievable_fraction
    return newton_schulz_flops(rows, cols, 5) / rate + moved * 2 / cluster.hbm_bw


@pytest.mark.parametrize("parallel", ["fsdp4", "hsdp2x2"])
def test_a_muon_step_adds_newton_schulz_on_an_even_share_its_kernels_and_two_all_to_alls(parallel):
    """Muon's step on FSDP 4 (and HSDP 2 × 2) of the 4-layer model on one H100 node: the optimizer
    step takes longer than AdamW's by Newton–Schulz on the whole (unsharded) matrices, this rank's
    even share of the 28 (more than the largest one), plus Muon's eager kernels' bytes in place of
    AdamW's for each of its local elements (80 a bf16 element against 28); and the step waits, on
    the critical path, for its two all-to-alls over the 4 ranks in bf16: a rank sends 3/4 of its
    Muon elements in the gather (HSDP: each piece held twice is sent once, 1/2 − 1/4) and receives
    3/4 in the scatter (each result to every holder). Nothing else changes."""
    layouts = {
        "fsdp4": (["parallel.dp_shard=4"], 4, 1 - 1 / 4),
        "hsdp2x2": (["parallel.dp_replicate=2", "parallel.dp_shard=2"], 2, 1 / 2 - 1 / 4),
    }
    layout, shards, gathered = layouts[parallel]
    adamw, cluster = planned(*MUON_STEP, *layout)
    muon = planned(*MUON_STEP, *layout, *MUON)[0]
    matrices = [shape for shape, muon in _muon_shapes([*MUON_STEP, *MUON]) if muon]
    assert len(matrices) == 28 and all(len(s) == 2 for s in matrices)
    times = [_newton_schulz_s(*s, cluster) for s in matrices]
    share = sum(times) / 4
    assert share > max(times)  # the even share, not one matrix, is the rank's
    local = _muon_split([*MUON_STEP, *MUON], shards)[0]
    kernels = local * (80 - 28) / cluster.hbm_bw
    assert muon.compute_s - adamw.compute_s == pytest.approx(share + kernels, rel=1e-9)

    (col,) = [x for x in muon.collectives if x.dim == "muon"]
    assert (col.kind, col.group_size, col.overlapped) == ("all_to_all", 4, False)
    assert col.bytes == pytest.approx(local * (gathered + 3 / 4) * 2, rel=1e-12)
    # all on one node: each rank's tensor goes to the 3 others over NVLink
    assert muon.exposed_comm_s["muon"] == pytest.approx(col.bytes / cluster.intra_node_bw)
    assert {d: t for d, t in muon.exposed_comm_s.items() if d != "muon"} == adamw.exposed_comm_s
    assert [x for x in muon.collectives if x.dim != "muon"] == adamw.collectives
    assert muon.step_time_s - adamw.step_time_s == pytest.approx(
        share + kernels + col.bytes / cluster.intra_node_bw, rel=1e-9
    )


def test_muon_under_zero1_moves_each_ranks_slices_to_their_owners_and_back():
    """ZeRO-1 (FSDP off, every parameter cut in 4 flat slices): each rank sends 3/4 of its slices'
    Muon elements in the gather and receives 3/4 in the scatter, as FSDP's 4 shards do; its
    optimizer steps only its slices (this model's rows split evenly: as many elements as FSDP's
    shards, so the same compute)."""
    overrides = [*MUON_STEP, "parallel.dp_shard=4"]
    fsdp, cluster = planned(*overrides, *MUON)
    zero1 = planned(*overrides, "parallel.zero_stage=1", *MUON)[0]
    local = _muon_split([*overrides, *MUON], 4)[0]
    (col,) = [x for x in zero1.collectives if x.dim == "muon"]
    assert (col.kind, col.group_size) == ("all_to_all", 4)
    assert col.bytes == pytest.approx(local * 2 * (1 - 1 / 4) * 2, rel=1e-12)
    assert zero1.exposed_comm_s["muon"] == fsdp.exposed_comm_s["muon"]
    assert zero1.compute_s == pytest.approx(fsdp.compute_s, rel=1e-12)
    assert zero1.compute_s > planned(*overrides, "parallel.zero_stage=1")[0].compute_s


def test_muons_routed_experts_stay_with_a_rank_holding_two_of_each():
    """tiny_moe's 8 experts under ep 2 × FSDP 2 (4 ranks): the experts are a mesh of their own,
    each rank holds two experts of each stacked parameter, and optim/orthogonalize.py's dealing
    leaves them with it (a rank takes two before its load is a matrix ahead), so only the attention
    and shared-expert matrices travel: 3/4 of each rank's shards there and back, in bf16."""
    overrides = [*MOE, *BATCH, "cluster.device=h100", "parallel.ep=2", *MUON]
    muon = [shape for shape, stepped in _muon_shapes(overrides) if stepped]
    dense = sum(math.prod(s) for s in muon if len(s) == 2)
    experts = sum(math.prod(s) for s in muon if len(s) == 3)
    assert dense and experts

    e = planned(*overrides, "cluster.gpus_per_node=4", "parallel.dp_shard=4")[0]
    (col,) = [x for x in e.collectives if x.dim == "muon"]
    assert col.bytes == pytest.approx(dense / 4 * 2 * (3 / 4) * 2, rel=1e-12)


def test_the_planner_offers_muon_only_what_training_runs_it_under():
    """ZeRO-1 cuts each parameter in flat slices and parallel.offload=optimizer steps torch's AdamW
    on the host: the search leaves out exactly the ZeRO-1 layouts training refuses with
    optim.name=muon (and every ZeRO-1 layout with a low-bit AdamW), what fits offers Muon no
    offload (its all-to-alls run on the device) and a low-bit AdamW no offload=optimizer, and a
    config asking for them is refused by composer3d-plan in one line naming the key."""
    from composer3d.errors import ConfigError
    from composer3d.plan.fits import option_sets
    from composer3d.plan.layouts import enumerate_candidates
    from composer3d.plan.search import checked
    from composer3d.plan.validation import validate_plan

    base = [*MODEL, *BATCH]
    adamw = enumerate_candidates(plan_config(*base), 4, 4)
    muon_cfg = plan_config(*base, *MUON)
    muon = set(enumerate_candidates(muon_cfg, 4, 4))
    zero1 = [c for c in adamw if c.zero_stage == 1]
    assert zero1 and any(c.tp > 1 for c in zero1)

    def refused(c) -> bool:
        try:
            checked(muon_cfg, c, 4)
        except ConfigError:
            return True
        return False

    refused_zero1 = {c for c in zero1 if refused(c)}
    assert refused_zero1
    assert muon == set(adamw) - refused_zero1
    assert not any(
        c.zero_stage == 1
        for c in enumerate_candidates(plan_config(*base, "optim.name=adamw_8bit"), 4, 4)
    )

    c = next(c for c in adamw if c.zero_stage == 3)
    assert {o.offload for o in option_sets(c, False)} == {"none", "optimizer", "cpu"}
    assert {o.offload for o in option_sets(c, False, optimizer="muon")} == {"none"}
    assert {o.offload for o in option_sets(c, False, optimizer="adamw_8bit")} == {"none", "cpu"}
    for name, offload in (("muon", "optimizer"), ("adamw_8bit", "optimizer"), ("muon", "cpu")):
        with pytest.raises(ConfigError) as refused_plan:
            validate_plan(plan_config(*base, f"optim.name={name}", f"parallel.offload={offload}"))
        assert str(refused_plan.value).startswith("parallel.offload: "), refused_plan.value
    validate_plan(plan_config(*base, "parallel.offload=optimizer"))


def test_what_fits_answers_the_longest_sequence_and_the_largest_model():
    """plan.what_fits: every memory option lengthens the sequence that fits, or leaves it;
    offloading the model state holds a larger model; what the longest sequence takes is a
    configuration training accepts."""
    from composer3d.config.checks import validate
    from composer3d.plan.fits import what_fits

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose("train", overrides=[*ONE_H100_8B, "memory.activation_checkpointing=none"])
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
    sequences, models = what_fits(
        Workload.from_config(cfg), candidate_from_config(cfg, 1), cluster, False
    )
    longest = {f.options.label(): f.amount for f in sequences}
    assert longest["ac:none"] == 0  # 8B's model state alone does not fit one H100
    assert (
        0
        < longest["ac:none offload:cpu"]
        <= longest["ac:selective offload:cpu"]
        <= longest["ac:full offload:cpu"]
    )
    assert longest["ac:full offload:cpu"] <= longest["ac:full tiled mlp+loss offload:cpu"]
    assert (
        longest["ac:full tiled mlp+loss offload:cpu"]
        <= longest["ac:full tiled mlp+loss act-offload offload:cpu"]
    )
    assert sequences[0].amount == max(longest.values()) >= 128 * 1024
    layers = {f.options.label(): f.amount for f in models}
    assert (
        0 < layers["ac:full"] < layers["ac:full offload:optimizer"] < layers["ac:full offload:cpu"]
    )
    assert layers["ac:none offload:cpu"] <= layers["ac:full offload:cpu"]
    out = _plan(*ONE_H100_8B, "plan.what_fits=true")
    assert out.returncode == 0, out.stderr
    assert (
        "longest sequence on 1 × 1 h100" in out.stdout and "largest model at dim 4096" in out.stdout
    )
    assert f"{sequences[0].amount:,}" in out.stdout.splitlines()[2], out.stdout
    assert "parallel.offload=cpu" in out.stdout.split("longest sequence takes: ")[1].splitlines()[0]
    for line in out.stdout.splitlines():  # what each answer takes passes training's own checks
        if " takes: " in line:
            trial = copy.deepcopy(cfg)
            with open_dict(trial):
                for override in line.split(" takes: ")[1].split():
                    key, value = override.split("=", 1)
                    OmegaConf.update(trial, key, yaml_value(value))
            validate(trial, 1)


def test_what_fits_on_the_defaults_answers_at_a_micro_batch_the_search_would_weigh():
    """plan.what_fits on 8 GPUs of the defaults (global batch 16, micro-batch 4; 4 × 8 does not
    divide 16): the micro-batch is the layout's, as the search weighs it (a divisor of the 2
    sequences a rank gets), so it answers at 2 and says so. A micro-batch the command line gives and
    a global batch the ranks cannot share are refused in one line naming the key."""
    from composer3d.config.checks import validate
    from composer3d.plan.layouts import enumerate_candidates

    cfg = plan_config()
    assert (cfg.cluster.nodes * cfg.cluster.gpus_per_node, cfg.train.micro_batch_size) == (8, 4)
    searched = {c.micro_batch_size for c in enumerate_candidates(cfg, 8, 8) if c.dp == 8}
    assert searched == {1, 2}
    out = _plan("plan.what_fits=true")
    assert out.returncode == 0, out.stderr
    assert "dp8 tp1 z3 mb2 ac:none" in out.stdout.splitlines()[0], out.stdout
    assert out.stdout.rstrip().endswith(
        "note: train.micro_batch_size: 4 does not divide the 2 sequences each of the 8 "
        "data-parallel ranks gets (train.global_batch_size 16): answered at "
        "train.micro_batch_size=2"
    ), out.stdout
    takes = [line.split(" takes: ")[1] for line in out.stdout.splitlines() if " takes: " in line]
    assert len(takes) == 2
    for overrides in takes:  # each answer is a configuration training accepts on 8 ranks
        assert "train.micro_batch_size=2" in overrides.split()
        trial = copy.deepcopy(cfg)
        with open_dict(trial):
            for override in overrides.split():
                key, value = override.split("=", 1)
                OmegaConf.update(trial, key, yaml_value(value))
        validate(trial, 8)
    for override, key, would in [
        ("train.micro_batch_size=4", "train.micro_batch_size", "e.g. 2"),
        ("train.global_batch_size=12", "train.global_batch_size", "a multiple of 8"),
    ]:
        refused = _plan("plan.what_fits=true", override)
        assert refused.returncode == 2 and refused.stdout == "", refused
        line = refused.stderr.strip()
        assert "\n" not in line and f": {key}: " in line and would in line, line


def _measure(*overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "composer3d.commands.plan",
            *overrides,
            "cluster.device=cpu",
            "plan.measure=true",
            "plan.measure_steps=1",
            "plan.format=json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _measured(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_one_rank_of_an_8_rank_layout_measured_here_with_a_fake_process_group():
    """plan.measure runs rank 5 of FSDP 2 × cp 2 × TP 2 + SP alone (torch's fake backend:
    collectives complete without the other 7 ranks) with the real shapes, and its peak and
    model-state bytes meet the planner's for that rank (the bars the real multi-process measurements
    above are held to)."""
    layout = [
        *MODEL,
        *BATCH,
        "parallel.dp_shard=2",
        "parallel.cp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ]
    result = _measured(_measure(*layout, "cluster.gpus_per_node=8", "plan.measure_rank=5"))
    measured, predicted = result["measured"], result["predicted"]
    assert (measured["rank"], measured["world_size"], result["layout"]) == (
        5,
        8,
        "dp2 cp2:ring tp2+sp z3 mb2 ac:none",
    )
    assert _rel(measured["model_state_bytes"], predicted["model_state_bytes"]) < 0.02, result
    assert _rel(measured["peak_bytes"], predicted["peak_bytes"]) < 0.15, result
    assert measured["step_s"] and all(t > 0 for t in measured["step_s"])


def test_a_lora_rank_is_measured_its_frozen_base_without_gradients():
    """plan.measure of a LoRA layout (torch's MemTracker refuses a gradient hook on a frozen weight:
    it crashed): the rank's model state is the planner's (adapters trained, the base frozen) and its
    peak within the bar."""
    result = _measured(
        _measure(*MODEL, *BATCH, "peft=lora", "parallel.dp_shard=2", "cluster.gpus_per_node=2")
    )
    measured, predicted = result["measured"], result["predicted"]
    assert _rel(measured["model_state_bytes"], predicted["model_state_bytes"]) < 0.02, result
    assert _rel(measured["peak_bytes"], predicted["peak_bytes"]) < 0.15, result


def test_a_pipeline_rank_of_an_8_rank_layout_measured_here_runs_its_part_of_the_schedule():
    """FSDP 2 × TP 2 + SP × pp 2 under 1F1B (4 micro-batches a pipeline): rank 0 (the first stage)
    and rank 7 (the last) each run alone, their stages built with the shapes they exchange (no other
    stage to ask), their sends and receives the fake group's. Each meets the planner's peak and
    model state for its stage, and the first stage's peak is the higher: 1F1B keeps pp
    micro-batches' activations in flight there, one on the last stage."""
    layout = [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.pp_schedule=1f1b",
        "cluster.gpus_per_node=8",
    ]
    first, last = (
        _measured(proc)
        for proc in [_measure(*layout, f"plan.measure_rank={rank}") for rank in (0, 7)]
    )
    for rank, pp_rank, result in ((0, 0, first), (7, 1, last)):
        measured, predicted = result["measured"], result["predicted"]
        assert (measured["rank"], measured["pp_rank"], result["layout"]) == (
            rank,
            pp_rank,
            "pp2 dp2 tp2+sp z3 1f1b/v1/M4 mb1 ac:none",
        )
        assert _rel(measured["model_state_bytes"], predicted["model_state_bytes"]) < 0.02, result
        assert _rel(measured["peak_bytes"], predicted["peak_bytes"]) < 0.15, result
    assert first["measured"]["peak_bytes"] > 1.1 * last["measured"]["peak_bytes"], (first, last)
    assert first["predicted"]["peak_bytes"] > last["predicted"]["peak_bytes"]


def test_a_measured_pipeline_stage_sends_what_its_boundary_says_in_bf16():
    """In bf16 the residual stream a first stage sends is bf16 under FSDP's mixed precision and fp32
    under autocast (ZeRO-1: no FSDP); the measured stage checks each micro-batch it sends against
    the boundary it was built with (``stage_boundary``) and fails the step on a mismatch, so these
    runs finishing is that check passing. The model state meets the planner's under both (ZeRO-1's
    gradient buckets counted: without them it measured 57%)."""
    layout = [
        *MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.pp=2",
        "precision.param_dtype=bfloat16",
        "cluster.gpus_per_node=4",
    ]
    runs = [
        _measure(*layout, data_parallel)
        for data_parallel in ("parallel.dp_shard=2", "parallel.zero_stage=1")
    ]
    for result, zero_stage in zip(map(_measured, runs), ("z3", "z1")):
        assert result["layout"] == f"pp2 dp2 tp1 {zero_stage} 1f1b/v1/M4 mb1 ac:none", result
        assert result["measured"]["pp_rank"] == 0 and result["measured"]["peak_bytes"] > 0, result
        assert (
            _rel(result["measured"]["model_state_bytes"], result["predicted"]["model_state_bytes"])
            < 0.02
        ), result


def test_pipeline_stages_given_their_boundary_match_what_torch_infers(measured):
    """plan.measure builds a pipeline's stages with the shapes they exchange
    (``parallel.pipeline.stage_boundary``, from the config); in the real runs above torch inferred
    them by messages at the first step: every stage's input and sent output are the same shape,
    dtype and gradient flag (1F1B, GPipe, TP + SP, DDP, FSDP with a tied embedding, pp=4, MoE with
    expert parallel)."""
    pipelines = {name: ranks for name, (ranks, _) in measured.items() if "stage_shapes" in ranks[0]}
    assert len(pipelines) == len([name for name in measured if "pp" in name]), sorted(pipelines)
    bad = [
        (name, rank, index, shapes)
        for name, ranks in pipelines.items()
        for rank, r in enumerate(ranks)
        for index, shapes in r["stage_shapes"].items()
        if shapes["inferred"] != shapes["boundary"]
    ]
    assert not bad, bad


def test_measuring_a_zero_bubble_pipeline_is_refused_naming_the_key():
    proc = _plan(
        *MODEL,
        *PP_BATCH,
        "parallel.pp=2",
        "parallel.pp_schedule=zbv",
        "cluster.device=cpu",
        "cluster.gpus_per_node=2",
        "plan.measure=true",
    )
    assert (
        proc.returncode == 2 and "parallel.pp_schedule" in proc.stderr and "zbv" in proc.stderr
    ), proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
