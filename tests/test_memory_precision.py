"""Memory and precision switches: each trains under the parallelisms it composes with and matches its reference."""

import json

import pytest
import torch
from harness import FAST, train

STEPS = ["train.steps=6"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return {layers: train(tmp_path_factory.mktemp(f"ref{layers}"), *FAST, *STEPS, f"model.n_layers={layers}")
            for layers in (2, 4)}


def _max_diff(a, b):
    assert len(a.losses) == len(b.losses) == 6
    return max(abs(x - y) for x, y in zip(a.losses, b.losses))


# Same math, so the curve must match the plain run within 1e-4.
@pytest.mark.parametrize("switch, layout, nproc, layers", [
    (["memory.activation_checkpointing=full"], ["parallel.dp_shard=2"], 2, 2),
    (["memory.activation_checkpointing=selective"], ["parallel.tp=2", "parallel.sequence_parallel=true"], 2, 2),
    (["memory.activation_checkpointing=selective", "memory.ac_every=2"], ["parallel.pp=2"], 2, 4),
    (["memory.activation_checkpointing=full"], ["parallel.pp=2", "parallel.dp_shard=1"], 2, 4),
    (["parallel.offload=cpu"], ["parallel.dp_shard=2"], 2, 2),
    (["compile.enabled=true"], ["parallel.dp_shard=2"], 2, 2),
    (["compile.enabled=true", "memory.activation_checkpointing=full"], ["parallel.dp_shard=2"], 2, 2),
    (["compile.enabled=true"], ["parallel.pp=2"], 2, 4),
])
def test_switch_keeps_the_reference_curve(tmp_path, reference, switch, layout, nproc, layers):
    run = train(tmp_path, *FAST, *STEPS, f"model.n_layers={layers}", *switch, *layout, nproc=nproc)
    assert _max_diff(reference[layers], run) < 1e-4


@pytest.mark.parametrize("switch, layout, nproc, tolerance", [
    (["precision.float8.enabled=true"], ["parallel.dp_shard=2"], 2, 0.02),
    (["precision.float8.enabled=true"], ["parallel.tp=2", "parallel.sequence_parallel=true"], 2, 0.02),
    (["precision.param_dtype=bfloat16"], ["parallel.dp_shard=2"], 2, 0.05),
    (["precision.param_dtype=float16"], ["parallel.dp_shard=2"], 2, 0.05),
    (["optim.name=adamw_8bit"], ["parallel.dp_shard=2"], 2, 0.02),
    (["optim.name=adamw_4bit"], ["parallel.dp_shard=2"], 2, 0.05),
    (["optim.name=adamw_fp8"], ["parallel.dp_shard=2"], 2, 0.02),
])
def test_lower_precision_stays_close(tmp_path, reference, switch, layout, nproc, tolerance):
    run = train(tmp_path, *FAST, *STEPS, *switch, *layout, nproc=nproc)
    assert _max_diff(reference[2], run) < tolerance


@pytest.mark.parametrize("switch, layout, tolerance", [
    (["precision.param_dtype=float16"], ["parallel.tp=2", "parallel.sequence_parallel=true"], 0.05),
    (["precision.param_dtype=float16"], ["parallel.pp=2"], 0.05),
    (["precision.float8.enabled=true"], ["parallel.pp=2"], 0.02),
    (["optim.name=adamw_8bit"], ["parallel.tp=2"], 0.02),
    (["optim.name=adamw_8bit"], ["parallel.pp=2"], 0.02),
    (["parallel.offload=cpu"], ["parallel.pp=2"], 1e-4),
    (["parallel.offload=cpu"], ["parallel.tp=2"], 1e-4),
])
def test_switch_composes_with_tp_and_pp(tmp_path, reference, switch, layout, tolerance):
    run = train(tmp_path, *FAST, *STEPS, "model.n_layers=4", *switch, *layout, nproc=2)
    assert _max_diff(reference[4], run) < tolerance


def test_low_bit_optimizer_state_is_smaller_and_checkpoints(tmp_path):
    args = [*FAST, "train.steps=4", "checkpoint.interval=2", "parallel.dp_shard=2"]
    full = train(tmp_path / "adamw", *args, nproc=2)
    low = train(tmp_path / "8bit", *args, "optim.name=adamw_8bit", nproc=2)
    P = full.run_info["num_params"]
    adam_states = full.run_info["model_state_bytes_per_rank"] - 8 * P / 2
    low_states = low.run_info["model_state_bytes_per_rank"] - 8 * P / 2
    assert low_states < 0.4 * adam_states, (low_states, adam_states)  # 2 bytes/param + scales vs 8
    resumed = train(tmp_path / "resumed", *args, "optim.name=adamw_8bit", nproc=2,
                    *[f"checkpoint.resume={tmp_path / '8bit' / 'checkpoints' / 'step-00000002'}"])
    assert resumed.losses == low.losses[2:], "8-bit optimizer state saved and restored exactly"


def test_fp16_overflow_skips_the_step_on_every_rank(tmp_path):
    # 2**40 overflows fp16 gradients: the first steps must be skipped and the scale halved, on both ranks alike.
    run = train(tmp_path, *FAST, "train.steps=8", "precision.param_dtype=float16", "precision.loss_scale_init=1099511627776",
                "parallel.dp_shard=2", nproc=2)
    scales = [m["loss_scale"] for m in run.metrics]
    skipped = [m["skipped_steps"] for m in run.metrics]
    assert skipped[0] == 1 and skipped[-1] >= 1 and scales[1] == scales[0] / 2
    assert scales[-1] < scales[0]
    logs = [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    skips = [[line.split("step ")[1].split(":")[0] for line in log.splitlines() if "overflowed" in line] for log in logs]
    assert skips[0] == skips[1] and len(skips[0]) == skipped[-1], skips
    assert all(m["loss"] == m["loss"] for m in run.metrics), "no NaN loss reported"


@pytest.mark.skipif(torch.accelerator.is_available(), reason="CPU-only limitations")
@pytest.mark.parametrize("overrides, key", [
    (["parallel.tp=2", "compile.enabled=true"], "compile.enabled"),
])
def test_known_cpu_limitations_are_refused(tmp_path, overrides, key):
    run = train(tmp_path, *FAST, *overrides, nproc=2 if "parallel.tp=2" in overrides else 1, check=False, timeout=120)
    assert run.returncode != 0 and f"invalid configuration: {key}:" in run.output


def test_activation_checkpointing_with_zero_bubble_schedule_is_refused(tmp_path):
    run = train(tmp_path, *FAST, "model.n_layers=4", "parallel.pp=2", "parallel.pp_schedule=zbv",
                "memory.activation_checkpointing=full", nproc=2, check=False, timeout=120)
    assert run.returncode == 2 and "invalid configuration: memory.activation_checkpointing:" in run.output


def test_auto_precision_is_fp32_on_cpu(tmp_path):
    run = train(tmp_path, *FAST, "train.steps=1")
    assert "param_dtype: float32" in (tmp_path / "config.yaml").read_text()
    assert json.loads((tmp_path / "run.json").read_text())["device"] == "cpu"
    assert len(run.metrics) == 1


def test_memory_breakdown_shows_activation_checkpointing_effect(tmp_path):
    args = [*FAST, "train.steps=2", "parallel.dp_shard=2", "logging.memory_breakdown=true"]
    plain = train(tmp_path / "none", *args, nproc=2).run_info
    full = train(tmp_path / "full", *args, "memory.activation_checkpointing=full", nproc=2).run_info
    acts = plain["memory_breakdown_bytes_per_rank"]["ACT"], full["memory_breakdown_bytes_per_rank"]["ACT"]
    assert acts[1] < 0.6 * acts[0], acts
    # Adam's two fp32 moments of half the parameters (dp_shard=2), counted by the tracker as optimizer state.
    opt = plain["memory_breakdown_bytes_per_rank"]["OPT"]
    assert abs(opt - 8 * plain["num_params"] / 2) / opt < 0.05
