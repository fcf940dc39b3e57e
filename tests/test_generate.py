"""composer3d-generate: decoding rules, transformers' greedy output on an exported model and on an HF model's own
weights, the same text under tensor parallel, and the refusals before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composer3d.generate import next_token

transformers = pytest.importorskip("transformers")
from harness import FAST, train
from hf_models import make_model

PROMPT = "def main("


def generate(*overrides: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "composer3d.generate", "launch.device=cpu", "generate.output=json",
                           f"launch.nproc_per_node={nproc}", *overrides], check=False, capture_output=True, text=True,
                          env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"composer3d-generate {overrides} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def generated(*overrides: str, nproc: int = 1) -> dict:
    lines = generate(*overrides, nproc=nproc).stdout.strip().splitlines()
    assert len(lines) == 1, f"one JSON line expected on stdout (rank 0's), got {lines}"
    return json.loads(lines[0])


def test_decoding_rules():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, 1.0, gen) == 1  # greedy: the most likely
    # A nucleus smaller than the top token's probability leaves only that token, at any temperature.
    assert {next_token(logits, 1.5, 0.3, gen) for _ in range(50)} == {1}
    # top_p=0.9 keeps tokens 1 and 2 (0.63 + 0.23 < 0.9) and 0 (which crosses 0.9), never 3.
    draws = [next_token(logits, 1.0, 0.9, gen) for _ in range(400)]
    assert set(draws) == {0, 1, 2}
    # The same seed draws the same tokens; another seed other tokens.
    sample = lambda seed: [next_token(logits, 1.0, 1.0, g) for g in [torch.Generator().manual_seed(seed)] for _ in range(30)]
    assert sample(1) == sample(1) and sample(1) != sample(2)


@pytest.fixture(scope="module")
def native_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny native model trained 40 steps (its checkpoint), exported in float32 to a Hugging Face directory."""
    root = tmp_path_factory.mktemp("generate")
    train(root / "run", *FAST, "train.steps=40", "optim.lr=3e-3")
    step = root / "run" / "checkpoints" / "step-00000040"
    out = root / "hf"
    subprocess.run([sys.executable, "-m", "composer3d.convert", "export", str(step), str(out), "--dtype", "float32"],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return step, out


def transformers_greedy(directory: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def test_native_checkpoint_generates_what_transformers_generates_from_its_export(native_run):
    step, exported = native_run
    # The export carries the run's (byte-level) tokenizer: transformers encodes the prompt to the same ids.
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    greedy = generated(f"checkpoint.resume={step}", f"generate.prompt='{PROMPT}'", "generate.max_new_tokens=24")
    assert greedy["prompt_ids"] == tokenizer.encode(PROMPT) == list(PROMPT.encode())
    assert len(greedy["completion_ids"]) == 24 and greedy["finish_reason"] == "length"
    assert greedy["completion_ids"] == transformers_greedy(exported, greedy["prompt_ids"], 24)
    assert greedy["completion"] == tokenizer.decode(greedy["completion_ids"])

    # Tensor parallel over 2 ranks: the same greedy text, and the same sampled one (rank 0's draws, same seed).
    common = [f"checkpoint.resume={step}", f"generate.prompt='{PROMPT}'", "generate.max_new_tokens=24"]
    sampling = ["generate.temperature=1.0", "generate.top_p=0.95", "generate.seed=3"]
    assert generated(*common, "parallel.tp=2", nproc=2)["completion_ids"] == greedy["completion_ids"]
    sampled = generated(*common, *sampling)
    assert sampled["completion_ids"] != greedy["completion_ids"]  # the switch took effect
    assert generated(*common, *sampling, "parallel.tp=2", nproc=2)["completion_ids"] == sampled["completion_ids"]


def test_hf_model_generates_what_transformers_generates(tmp_path):
    """model=hf with its own weights: the prompt encoded as the tokenizer encodes it by default (its special tokens
    added, as transformers' pipelines do), stopped at its eos or the limit."""
    path = make_model(tmp_path / "llama", "llama")
    result = generated("model=hf", f"model.path={path}", "generate.prompt='the quick brown fox'",
                       "generate.max_new_tokens=16")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert result["prompt_ids"] == tokenizer.encode("the quick brown fox")
    reference = transformers_greedy(path, result["prompt_ids"], 16)
    assert result["completion_ids"] == reference
    assert result["finish_reason"] == ("eos" if reference[-1] == tokenizer.eos_token_id else "length")


@pytest.mark.parametrize("nproc, overrides, key", [
    (1, ["model.dim=128"], "model.dim"),  # the checkpoint fixes the model
    (2, ["parallel.pp=2"], "parallel"),  # one process or tensor parallel alone
    (2, [], "parallel"),  # two processes without parallel.tp=2: data parallel
    (1, ["generate.max_new_tokens=2000"], "generate.max_new_tokens"),  # past model.max_seq_len (1024)
    (1, ["generate.chat=true"], "generate.chat"),  # the byte-level tokenizer has no chat template
])
def test_refusals_before_any_worker_starts(native_run, nproc, overrides, key):
    step, _ = native_run
    proc = generate(f"checkpoint.resume={step}", "generate.prompt=hello", *overrides, nproc=nproc, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("composer3d-generate: invalid")]
    assert len(lines) == 1 and f": {key}:" in lines[0], proc.stderr[-3000:]
    assert "failed first" not in proc.stderr and not proc.stdout.strip()  # refused by the launcher: no worker started
