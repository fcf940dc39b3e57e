"""composer3d-eval against a plain transformers computation of the same definition, under several
layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
from harness import FAST, command_job, command_output, convert, train_job
from hf_models import make_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SEQ = 32


def reference(model_dir, text: str) -> dict:
    """The definition, with transformers alone: model tokenizer, no special tokens, non-overlapping
    windows of SEQ tokens (the partial tail dropped), mean loss over every predicted position."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
    n = len(ids) // SEQ
    windows = torch.tensor(ids[: n * SEQ]).view(n, SEQ)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(windows).logits[:, :-1]
    loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="mean").item()
    return {"loss": loss, "tokens": n * (SEQ - 1)}


EVAL = [
    "launch.device=cpu",
    f"train.seq_len={SEQ}",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "logging.progress_bar=false",
]


def run_eval(*overrides: str, nproc: int) -> subprocess.CompletedProcess:
    """composer3d-eval as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "composer3d.commands.evaluate",
            f"launch.nproc_per_node={nproc}",
            *EVAL,
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def evaluated(*overrides: str, nproc: int) -> dict:
    """What composer3d-eval computes on ``nproc`` ranks (``harness.command_job``): rank 0's one
    JSON line; the other ranks print nothing."""
    printed = command_job("composer3d.commands.evaluate", *EVAL, *overrides, nproc=nproc)
    lines = [line for line in printed[0].splitlines() if line.startswith("{")]
    assert len(lines) == 1 and not any(out.strip() for out in printed[1:]), printed
    return json.loads(lines[0])


@pytest.mark.parametrize(
    "nproc,layout",
    [
        (1, []),
        (4, ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        (4, ["parallel.pp=2", "parallel.dp_shard=2"]),
    ],
)
def test_eval_matches_transformers(nproc, layout, tmp_path):
    model_dir = make_model(tmp_path / "model", "qwen2")
    text = (
        "Pipeline stages pass activations forward; tensor parallel splits each matmul. " * 40
        + "A tail that does not fill a window"
    )
    (tmp_path / "valid.txt").write_text(text)
    got = evaluated(
        "model=hf",
        f"model.path={model_dir}",
        f"eval.path={tmp_path / 'valid.txt'}",
        *layout,
        nproc=nproc,
    )
    want = reference(model_dir, text)
    assert got["tokens"] == want["tokens"]
    assert abs(got["loss"] - want["loss"]) < 1e-5, (got, want)
    assert abs(got["perplexity"] - torch.tensor(want["loss"]).exp().item()) < 1e-3


def test_eval_file_too_short_is_a_config_error(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama")
    (tmp_path / "short.txt").write_text("too short")
    proc = command_output(
        "composer3d.commands.evaluate",
        *EVAL,
        "model=hf",
        f"model.path={model_dir}",
        f"eval.path={tmp_path / 'short.txt'}",
        "launch.nproc_per_node=2",
    )
    assert (
        proc.returncode == 2
        and "eval.path" in proc.stderr
        and "fewer than one window" in proc.stderr
    )


def test_a_v_shaped_pipeline_schedule_is_refused_before_any_worker(tmp_path):
    """torch's V-shaped schedules run nothing forward only, which evaluation under PP is."""
    (tmp_path / "held_out.txt").write_text("def f(x):\n    return x + 1\n" * 60)
    proc = command_output(
        "composer3d.commands.evaluate",
        *EVAL,
        "parallel.pp=2",
        "parallel.pp_schedule=zbv",
        "model.n_layers=4",
        f"eval.path={tmp_path / 'held_out.txt'}",
        "launch.nproc_per_node=2",
    )
    assert proc.returncode == 2 and proc.stderr.count("invalid configuration") == 1
    assert "parallel.pp_schedule: composer3d-eval runs the pipeline forward only" in proc.stderr


def test_eval_every_during_training_and_eval_of_its_checkpoint(tmp_path):
    valid = tmp_path / "valid.txt"
    valid.write_text("def f(x):\n    return x + 1\n" * 60)
    # A model other than model=tiny's default shape: composer3d-eval must take it from the
    # checkpoint.
    run = train_job(
        tmp_path / "run",
        *FAST,
        "model.n_layers=1",
        "train.steps=4",
        "train.eval_every=2",
        f"eval.path={valid}",
        "parallel.dp_shard=2",
        nproc=2,
    )
    evaluated = {m["step"]: m["eval_loss"] for m in run.metrics if "eval_loss" in m}
    assert sorted(evaluated) == [2, 4]
    assert evaluated[4] < evaluated[2]  # training on Python source helps on Python source

    step = run.run_dir / "checkpoints" / "step-00000004"
    common = [
        sys.executable,
        "-m",
        "composer3d.commands.evaluate",
        "launch.device=cpu",
        "train.seq_len=64",
        "logging.progress_bar=false",
        f"eval.path={valid}",
        f"checkpoint.resume={step}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # No model overrides: the checkpoint's one-layer model, and the loss the run measured at that
    # step.
    proc = subprocess.run(common, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][0])
    assert abs(got["loss"] - evaluated[4]) < 1e-5, (got, evaluated[4])
    # A model the checkpoint is not: one line naming a parameter and both its shapes, before any
    # worker starts.
    proc = subprocess.run(
        [*common, "model.dim=32", "launch.nproc_per_node=2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "size mismatch" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    line = next(line for line in proc.stderr.splitlines() if "another shape" in line)
    assert (
        "layers.0.attention.wk.weight: (32, 64) in the checkpoint, (16, 32) in this config" in line
    ), line


def test_eval_of_a_trained_checkpoint_matches_transformers_on_its_export(tmp_path):
    """composer3d-eval's command line on 2 workers (TP), over a Hugging Face model's checkpoint."""
    model_dir = make_model(tmp_path / "model", "mistral")
    text = "def add(a, b):\n    return a + b\n" * 80
    (tmp_path / "valid.txt").write_text(text)
    run = train_job(
        tmp_path / "run",
        *[o for o in FAST if not o.startswith("model=")],
        "model=hf",
        f"model.path={model_dir}",
        "train.steps=3",
        "train.seq_len=32",
        "optim.lr=1e-2",
        "data.max_tokens=20000",
        "parallel.dp_shard=2",
        nproc=2,
    )
    step = run.run_dir / "checkpoints" / "step-00000003"
    convert("export", step, tmp_path / "out", "--dtype", "float32")
    proc = run_eval(
        "model=hf",
        f"model.path={model_dir}",
        f"eval.path={tmp_path / 'valid.txt'}",
        f"checkpoint.resume={step}",
        "parallel.tp=2",
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][0])
    trained, untouched = reference(tmp_path / "out", text), reference(model_dir, text)
    assert abs(got["loss"] - trained["loss"]) < 1e-5, (got, trained)
    # the checkpoint's weights were evaluated, not model.path's
    assert abs(got["loss"] - untouched["loss"]) > 1e-3
