"""composer3d-generate: decoding rules, the cached decoders against the recompute path (a batch of
prompts of different lengths row by row against each alone), transformers' greedy output on an
exported model and on an HF model's own weights (its static and dynamic caches), the same text under
tensor parallel, stop strings, and the refusals before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composer3d.config.schema import GenerateConfig, ModelConfig, MoEConfig
from composer3d.generation import generate as generate_in_process
from composer3d.generation import next_tokens
from composer3d.models import build_model
from composer3d.models.init import materialize

transformers = pytest.importorskip("transformers")
from harness import FAST, command_job, convert, logged, run_command, train_job
from hf_models import make_model

PROMPT = "def main("


def generate(*overrides: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer3d.commands.generate",
            "launch.device=cpu",
            "generate.output=json",
            f"launch.nproc_per_node={nproc}",
            *overrides,
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"composer3d-generate {overrides} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return proc


def printed(*overrides: str, nproc: int = 1, cli: bool = False) -> list[str]:
    """The lines composer3d-generate prints (rank 0's; the other ranks print nothing): with ``cli``
    as a user runs it (``generate``), else what its ranks compute (``harness.command_job``)."""
    if cli:
        return generate(*overrides, nproc=nproc).stdout.strip().splitlines()
    outs = command_job(
        "composer3d.commands.generate",
        "launch.device=cpu",
        "generate.output=json",
        *overrides,
        nproc=nproc,
    )
    assert not any(out.strip() for out in outs[1:]), outs
    return outs[0].strip().splitlines()


def generated(*overrides: str, nproc: int = 1, cli: bool = False) -> dict:
    lines = printed(*overrides, nproc=nproc, cli=cli)
    assert len(lines) == 1, f"one JSON line expected on stdout (rank 0's), got {lines}"
    return json.loads(lines[0])


def next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator, top_k: int = 0
) -> int:
    return int(next_tokens(logits[None], temperature, top_k, top_p, generator)[0])


def test_decoding_rules():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, 1.0, gen) == 1  # greedy: the most likely
    # A nucleus smaller than the top token's probability leaves only that token, at any temperature.
    assert {next_token(logits, 1.5, 0.3, gen) for _ in range(50)} == {1}
    # top_p=0.9 keeps tokens 1 and 2 (0.63 + 0.23 < 0.9) and 0 (which crosses 0.9), never 3.
    draws = [next_token(logits, 1.0, 0.9, gen) for _ in range(400)]
    assert set(draws) == {0, 1, 2}
    # top_k=2 keeps the two most likely, whatever the nucleus; top_k=1 is greedy at any temperature.
    assert {next_token(logits, 1.0, 1.0, gen, top_k=2) for _ in range(200)} == {1, 2}
    assert {next_token(logits, 5.0, 1.0, gen, top_k=1) for _ in range(50)} == {1}
    # The same seed draws the same tokens; another seed other tokens.

    def sample(seed):
        generator = torch.Generator().manual_seed(seed)
        return [next_token(logits, 1.0, 1.0, generator) for _ in range(30)]

    assert sample(1) == sample(1) and sample(1) != sample(2)
    # Rows draw independently: a batch of logits gives a token per row.
    batch = torch.stack([logits, logits.flip(0)])
    assert next_tokens(batch, 0.0, 0, 1.0, gen).tolist() == [1, 2]


def random_native(**overrides) -> torch.nn.Module:
    """The tiny native model (grouped-query: 8 heads, 4 kv heads), fp32, random weights peaked
    enough that greedy choices are not near-ties."""
    cfg = ModelConfig(
        **{
            "name": "llama",
            "dim": 64,
            "n_layers": 2,
            "n_heads": 8,
            "n_kv_heads": 4,
            "vocab_size": 512,
            "multiple_of": 32,
            "max_seq_len": 1024,
            "init_std": 0.2,
            **overrides,
        }
    )
    model = build_model(cfg)
    materialize(model, torch.device("cpu"), seed=0)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_native() -> torch.nn.Module:
    return random_native()


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 31)), [100, 3]]  # different lengths: a left-padded batch


def decode_bytes(ids: list[int]) -> str:
    return bytes(i % 256 for i in ids).decode("latin-1")


def run_native(model, prompts, **settings):
    config = GenerateConfig(**{"max_new_tokens": 24, "stop_at_eos": False, **settings})
    return generate_in_process(model, prompts, config, None, decode_bytes, torch.device("cpu"))


def test_native_cached_decoding_equals_recompute_and_each_row_alone(tiny_native):
    # the tokens each forward embeds: the cached path feeds the prompt once, then a token a step
    seen = []
    hook = tiny_native.tok_embeddings.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[1])
    )
    try:
        cached = run_native(tiny_native, PROMPTS)
        fed_cached, seen[:] = list(seen), []
        recomputed = run_native(tiny_native, PROMPTS, cache="none")
        fed_recomputed = list(seen)
    finally:
        hook.remove()
    assert fed_cached == [11] + [1] * 23 and fed_recomputed == list(range(11, 11 + 24))
    assert [g.completion_ids for g in cached] == [g.completion_ids for g in recomputed]
    for prompt, row in zip(PROMPTS, cached):
        assert len(row.completion_ids) == 24 and row.finish_reason == "length"
        assert run_native(tiny_native, [prompt])[0].completion_ids == row.completion_ids
        assert (
            run_native(tiny_native, [prompt], cache="none")[0].completion_ids == row.completion_ids
        )
    # the rows differ: nothing mixed them up
    assert len({tuple(g.completion_ids) for g in cached}) == 3


def test_native_mixture_of_experts_decodes_cached_as_recomputed():
    model = random_native(
        n_layers=3,
        moe=MoEConfig(experts=8, top_k=2, shared_experts=1, expert_hidden_dim=64, dense_layers=1),
    )
    cached = [g.completion_ids for g in run_native(model, PROMPTS, max_new_tokens=12)]
    assert cached == [
        g.completion_ids for g in run_native(model, PROMPTS, max_new_tokens=12, cache="none")
    ]
    assert [run_native(model, [p], max_new_tokens=12)[0].completion_ids for p in PROMPTS] == cached


def test_native_kv_cache_is_static_written_in_place_and_exact(tiny_native):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    decoder = tiny_native.decoder(width + 4, "static")
    prefill = decoder(ids, mask)
    keys = decoder.keys["0"]
    assert keys.shape == (
        3,
        4,
        width + 4,
        8,
    )  # batch × kv heads × max_len × head dim: grouped-query, preallocated
    step = decoder(
        prefill.argmax(-1, keepdim=True), torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    )
    assert (
        decoder.keys["0"] is keys
        and keys[:, :, width].abs().sum() > 0
        and keys[:, :, width + 1 :].eq(0).all()
    )
    # Each row's logits are the plain forward's on that row alone (positions from 0 at its first
    # real token).
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            alone = tiny_native(torch.tensor([prompt + [int(prefill[row].argmax())]]))[0]
            torch.testing.assert_close(prefill[row], alone[-2], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step[row], alone[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 1], ids=["batch3", "batch1"])
def test_compiled_decode_steps_are_one_graph_and_decode_as_eager(tiny_native, rows):
    """generate.compile: every one-token step after the prompt runs one compiled graph (the shapes
    never change: attention reads the whole cache), in this generation and the next of the same
    shape, and the tokens are the eager cache's. A batch of one too: its slices count as contiguous
    whatever their strides (an H200 saw it recompile at every token)."""
    prompts = PROMPTS[:rows]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run_native(tiny_native, prompts, compile=True)
    # the same shapes: the graph (and its cache) reused
    again = run_native(tiny_native, prompts, compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(
        torch._dynamo.utils.counters["stats"]
    )
    assert [g.completion_ids for g in again] == [g.completion_ids for g in compiled]
    assert [g.completion_ids for g in compiled] == [
        g.completion_ids for g in run_native(tiny_native, prompts)
    ]


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_native):
    greedy = [g.completion_ids for g in run_native(tiny_native, PROMPTS)]
    top1 = [
        g.completion_ids for g in run_native(tiny_native, PROMPTS, temperature=1.0, top_k=1, seed=5)
    ]
    assert top1 == greedy
    sampled = [
        g.completion_ids
        for g in run_native(tiny_native, PROMPTS, temperature=1.0, top_p=0.9, seed=3)
    ]
    assert sampled != greedy  # the switch took effect
    assert [
        g.completion_ids
        for g in run_native(tiny_native, PROMPTS, temperature=1.0, top_p=0.9, seed=3)
    ] == sampled
    assert [
        g.completion_ids
        for g in run_native(tiny_native, PROMPTS, temperature=1.0, top_p=0.9, seed=4)
    ] != sampled


def test_a_stop_string_ends_its_row_and_is_cut_from_the_text(tiny_native):
    full = run_native(tiny_native, PROMPTS)
    text = full[1].completion
    stop = text[6:9]  # found first at index 6 or before
    cut = text.find(stop)
    stopped = run_native(tiny_native, PROMPTS, stop=[stop, "never there \x00"])
    row = stopped[1]
    assert row.finish_reason == "stop" and row.completion == text[:cut]
    # generation ended at the token that completed the stop string: the text up to it holds the
    # string, one less not
    assert stop in decode_bytes(row.completion_ids) and stop not in decode_bytes(
        row.completion_ids[:-1]
    )
    assert row.completion_ids == full[1].completion_ids[: len(row.completion_ids)]
    # the others stop where they hold it
    for other, whole in zip((stopped[0], stopped[2]), (full[0], full[2])):
        assert other.completion_ids == whole.completion_ids[: len(other.completion_ids)]


@pytest.fixture(scope="module")
def native_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny native model trained 40 steps (its checkpoint), exported in float32 to a Hugging Face
    directory."""
    root = tmp_path_factory.mktemp("generate")
    train_job(root / "run", *FAST, "train.steps=40", "optim.lr=3e-3")
    step = root / "run" / "checkpoints" / "step-00000040"
    out = root / "hf"
    convert("export", step, out, "--dtype", "float32")
    return step, out


def transformers_greedy(directory: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens
        )
    return out[0, len(prompt_ids) :].tolist()


def test_native_checkpoint_generates_what_transformers_generates_from_its_export(native_run):
    step, exported = native_run
    # The export carries the run's (byte-level) tokenizer: transformers encodes the prompt to the
    # same ids.
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    greedy = generated(
        f"checkpoint.resume={step}", f"generate.prompt='{PROMPT}'", "generate.max_new_tokens=24"
    )
    assert greedy["prompt_ids"] == tokenizer.encode(PROMPT) == list(PROMPT.encode())
    assert len(greedy["completion_ids"]) == 24 and greedy["finish_reason"] == "length"
    assert greedy["completion_ids"] == transformers_greedy(exported, greedy["prompt_ids"], 24)
    assert greedy["completion"] == tokenizer.decode(greedy["completion_ids"])

    # Tensor parallel over 2 ranks: the same greedy text, and the same sampled one (rank 0's draws,
    # same seed).
    common = [
        f"checkpoint.resume={step}",
        f"generate.prompt='{PROMPT}'",
        "generate.max_new_tokens=24",
    ]
    sampling = ["generate.temperature=1.0", "generate.top_p=0.95", "generate.seed=3"]
    # the command line: its launcher, its workers, rank 0's lines on stdout
    assert (
        generated(*common, "parallel.tp=2", nproc=2, cli=True)["completion_ids"]
        == greedy["completion_ids"]
    )
    sampled = generated(*common, *sampling)
    assert sampled["completion_ids"] != greedy["completion_ids"]  # the switch took effect
    assert (
        generated(*common, *sampling, "parallel.tp=2", nproc=2)["completion_ids"]
        == sampled["completion_ids"]
    )


HF_PROMPTS = ["the quick brown fox", "a b"]  # different lengths: a left-padded batch


def hf_generated_as_transformers_generates(path: Path, *overrides: str, nproc: int = 1) -> None:
    """composer3d-generate's rows for HF_PROMPTS: each prompt encoded as the tokenizer encodes it by
    default (its special tokens added, as transformers' pipelines do), continued with transformers'
    own greedy tokens, stopped at its eos or the limit."""
    prompts = ",".join(f"'{text}'" for text in HF_PROMPTS)
    out = printed(
        "model=hf",
        f"model.path={path}",
        f"generate.prompts=[{prompts}]",
        "generate.max_new_tokens=16",
        *overrides,
        nproc=nproc,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(out) == len(HF_PROMPTS), out
    for text, line in zip(HF_PROMPTS, out):
        result = json.loads(line)
        assert result["prompt_ids"] == tokenizer.encode(text)
        reference = transformers_greedy(path, result["prompt_ids"], 16)
        # transformers pads a finished row to the limit: ours ends there
        if tokenizer.eos_token_id in reference:
            reference = reference[: reference.index(tokenizer.eos_token_id) + 1]
        assert result["completion_ids"] == reference
        assert result["finish_reason"] == (
            "eos" if reference[-1] == tokenizer.eos_token_id else "length"
        )


def test_a_row_stops_at_its_eos_and_the_others_go_on(tiny_native):
    full = run_native(tiny_native, PROMPTS)
    ids = full[0].completion_ids
    # a token the first row makes first there
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stopped = run_native(tiny_native, PROMPTS, stop_at_eos=True)  # no eos id: never stops
    assert [g.finish_reason for g in stopped] == ["length"] * 3
    config = GenerateConfig(max_new_tokens=24, stop_at_eos=True)
    stopped = generate_in_process(
        tiny_native, PROMPTS, config, ids[at], decode_bytes, torch.device("cpu")
    )
    assert stopped[0].completion_ids == ids[: at + 1] and stopped[0].finish_reason == "eos"
    # the others run on, or stop at the same token where they make it
    for row, whole in zip(stopped[1:], full[1:]):
        expected = (
            whole.completion_ids[: whole.completion_ids.index(ids[at]) + 1]
            if ids[at] in whole.completion_ids
            else whole.completion_ids
        )
        assert row.completion_ids == expected


def test_hf_model_generates_what_transformers_generates(tmp_path):
    """model=hf with its own weights, decoded in transformers' StaticCache (every architecture the
    HF tests build, in both caches: test_hf_models)."""
    hf_generated_as_transformers_generates(make_model(tmp_path / "llama", "llama"))


# the HF caches (above) and tensor parallel generation (the native checkpoint's test) together
@pytest.mark.slow
def test_hf_model_under_tensor_parallel_generates_what_transformers_generates(tmp_path):
    hf_generated_as_transformers_generates(
        make_model(tmp_path / "llama", "llama"), "parallel.tp=2", nproc=2
    )


@pytest.mark.parametrize(
    "nproc, overrides, key",
    [
        (1, ["model.dim=128"], "model.dim"),  # the checkpoint fixes the model
        (2, ["parallel.pp=2"], "parallel"),  # one process or tensor parallel alone
        (2, [], "parallel"),  # two processes without parallel.tp=2: data parallel
        (
            1,
            ["generate.max_new_tokens=2000"],
            "generate.max_new_tokens",
        ),  # past model.max_seq_len (1024)
        (
            1,
            ["generate.chat=true"],
            "generate.chat",
        ),  # the byte-level tokenizer has no chat template
        (
            2,
            ["parallel.tp=2", "generate.cache=dynamic"],
            "generate.cache",
        ),  # the native model's cache is static
        (
            2,
            ["parallel.tp=2", "generate.compile=true"],
            "generate.compile",
        ),  # compiled decoding: one process
    ],
)
def test_refusals_before_any_worker_starts(monkeypatch, capfd, native_run, nproc, overrides, key):
    """In this process up to where the command would start workers (which fails the test)."""
    step, _ = native_run
    capfd.readouterr()
    code = run_command(
        monkeypatch,
        "composer3d.commands.generate",
        "launch.device=cpu",
        "generate.output=json",
        f"launch.nproc_per_node={nproc}",
        f"checkpoint.resume={step}",
        "generate.prompt=hello",
        *overrides,
    )
    out, err = capfd.readouterr()
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("composer3d-generate: invalid")]
    assert len(lines) == 1 and f": {key}:" in lines[0], err[-3000:]
    assert "failed first" not in err and not out.strip()


def test_without_weights_the_refusal_names_generate(monkeypatch, capfd):
    """No checkpoint and a model with no weights of its own: generate, not eval, is what refuses."""
    capfd.readouterr()
    code = run_command(
        monkeypatch, "composer3d.commands.generate", "launch.device=cpu", "generate.prompt=hello"
    )
    out, err = capfd.readouterr()
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        "composer3d-generate: invalid configuration: checkpoint.resume: model=llama has no weights "
        "of its own here, so composer3d-generate would generate from a random initialization. "
        "Give checkpoint.resume=<run>/checkpoints/step-N, or model=hf model.path=<dir> with "
        "model.pretrained=true"
    ], err


def test_a_whitespace_only_completion_is_said_not_only_printed(capsys):
    """A completion of only whitespace prints as nothing at all: the command says what it is and
    what would change it; a completion with text says nothing."""
    import logging

    from composer3d.commands.generate import _print
    from composer3d.data.tokenizers import ByteTokenizer
    from composer3d.generation.decoding import Generation

    tokenizer = ByteTokenizer()
    blank, text = (
        Generation(list(b"def main("), list(completion.encode()), completion, "length", 0.5)
        for completion in (" " * 16, "\n    return 0")
    )
    with logged(logging.WARNING) as said:
        _print([text, blank], tokenizer, "text")
    assert capsys.readouterr().out == "def main(\n    return 0\n" + "def main(" + " " * 16 + "\n"
    assert said == [
        "prompt 2: the completion is whitespace only (16 tokens, '        '...): the model "
        "predicts whitespace after this prompt, as a briefly trained one does under greedy "
        "decoding. Train it longer, or sample (generate.temperature>0)"
    ], said
