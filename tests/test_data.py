"""Behaviour of composer3d.data: the layout-free global batch order, resume, packing, and the
corpora."""

import itertools
import json
import math

import pytest
import torch
from harness import logged, train, train_command
from omegaconf import OmegaConf

from composer3d.data import (
    ByteTokenizer,
    GlobalBatchLoader,
    HFTokenizer,
    build_sequences,
    packed_sequences,
    stdlib_documents,
    text_file_documents,
    token_stream,
)
from composer3d.errors import ConfigError

NUM_SEQ, SEQ_LEN, GLOBAL_BATCH = 10, 4, 4
# 32 sequences: three epoch boundaries, at positions 10, 20 and 30, two of them inside a batch
STEPS = 8


def make_sequences(n=NUM_SEQ, seq_len=SEQ_LEN):
    """Row i holds i*(seq_len+1) ... : every row is distinct and its first element names it."""
    return torch.arange(n * (seq_len + 1)).view(n, seq_len + 1)


def global_batches(sequences, dp_size, steps, seed=0, state=None):
    """Each step's batch as the concatenation of every data-parallel rank's slice, in rank order."""
    loaders = [
        GlobalBatchLoader(sequences, GLOBAL_BATCH, rank, dp_size, seed) for rank in range(dp_size)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    return [torch.cat([windows(loader.next_batch()) for loader in loaders]) for _ in range(steps)]


def windows(batch):
    """A Batch of bare token windows (no documents: nothing masked) back as its (b, seq_len + 1)
    windows."""
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1]) and (batch.targets >= 0).all()
    return torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)


def unpack(sequences):
    """The token stream the packed rows came from (each row's last token starts the next row)."""
    return torch.cat([sequences[:, :-1].flatten(), sequences[-1, -1:]])


def data_cfg(**kw):
    return OmegaConf.create(
        {
            "name": "stdlib",
            "paths": [],
            "format": "text",
            "text_field": "text",
            "messages_field": "messages",
            "tokenizer": None,
            "document_masking": True,
            "max_tokens": 0,
            "synthetic_sequences": 16,
            **kw,
        }
    )


# ------------------------------------------------------------------------------- global batch order


def test_global_batch_order_is_layout_independent():
    sequences = make_sequences()
    reference = global_batches(sequences, 1, STEPS)
    for batch in reference:
        assert batch.shape == (GLOBAL_BATCH, SEQ_LEN + 1)
    for dp_size in (2, 4):
        batches = global_batches(sequences, dp_size, STEPS)
        for step, (got, want) in enumerate(zip(batches, reference)):
            assert torch.equal(got, want), (
                f"dp_size={dp_size}, step {step}: {got[:, 0]} vs {want[:, 0]}"
            )


def test_each_epoch_is_a_fresh_permutation():
    sequences = make_sequences()
    # row ids in consumption order
    rows = torch.cat(global_batches(sequences, 2, STEPS))[:, 0] // (SEQ_LEN + 1)
    epochs = [rows[i * NUM_SEQ : (i + 1) * NUM_SEQ].tolist() for i in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(NUM_SEQ)), (
            f"an epoch must use every sequence once: {order}"
        )
    assert epochs[0] != epochs[1] != epochs[2], "each epoch should be shuffled anew"
    assert epochs[0] != list(range(NUM_SEQ)), "the order should be shuffled"
    other_seed = torch.cat(global_batches(sequences, 1, 3, seed=1))[:, 0] // (SEQ_LEN + 1)
    assert other_seed.tolist() != rows[:12].tolist(), "the seed should change the order"


def test_dp_rank_takes_its_contiguous_slice():
    sequences = make_sequences()
    whole = global_batches(sequences, 1, 1)[0]
    rank1 = GlobalBatchLoader(sequences, GLOBAL_BATCH, 1, 2, 0).next_batch()
    assert torch.equal(windows(rank1), whole[2:])
    assert torch.equal(rank1.position_ids, torch.arange(SEQ_LEN).expand(2, SEQ_LEN))


# ------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("dp_before, dp_after", [(1, 1), (1, 4), (4, 2), (2, 1)])
def test_resume_continues_the_same_global_batches(dp_before, dp_after):
    sequences = make_sequences()
    uninterrupted = global_batches(sequences, 1, STEPS)
    first = [
        GlobalBatchLoader(sequences, GLOBAL_BATCH, rank, dp_before, 0) for rank in range(dp_before)
    ]
    for _ in range(3):
        for loader in first:
            loader.next_batch()
    state = first[0].state_dict()
    assert all(loader.state_dict() == state for loader in first), (
        "the state must not depend on the rank"
    )
    assert state["consumed_sequences"] == 3 * GLOBAL_BATCH
    resumed = global_batches(sequences, dp_after, STEPS - 3, state=json.loads(json.dumps(state)))
    for step, (got, want) in enumerate(zip(resumed, uninterrupted[3:]), start=3):
        assert torch.equal(got, want), f"step {step} after resuming {dp_before}->{dp_after} ranks"
    # Without the state, a loader starts over: the comparison above would have caught a lost
    # position.
    assert not torch.equal(global_batches(sequences, dp_after, 1)[0], uninterrupted[3])


@pytest.mark.parametrize(
    "change, match",
    [
        ({"n": NUM_SEQ - 1}, f"state is for {NUM_SEQ} sequences"),
        ({"seed": 7}, "with seed 0, but this run has .* with seed 7"),
    ],
)
def test_resume_refuses_state_from_another_corpus_or_seed(change, match):
    source = GlobalBatchLoader(make_sequences(), GLOBAL_BATCH, 0, 1, 0)
    source.next_batch()
    target = GlobalBatchLoader(
        make_sequences(n=change.get("n", NUM_SEQ)), GLOBAL_BATCH, 0, 1, change.get("seed", 0)
    )
    with pytest.raises(ValueError, match=match) as error:
        target.load_state_dict(source.state_dict())
    assert "train.seed" in str(error.value)  # says what may have changed
    assert target.state_dict()["consumed_sequences"] == 0, (
        "a refused state must not be half-applied"
    )


# ------------------------------------------------------------------------------------------ packing


def test_packed_windows_overlap_by_one_token():
    # 23 tokens, seq_len 5: (23 - 1) // 5 = 4 windows, 2 tokens left over
    tokens = torch.arange(100, 123)
    rows = packed_sequences(tokens, 5)
    assert rows.shape == (4, 6)
    for a, b in zip(rows[:-1], rows[1:]):
        assert a[-1] == b[0], "each window's last token (a target) is the next window's first input"
    inputs, targets = rows[:, :-1], rows[:, 1:]
    assert torch.equal(inputs.flatten(), tokens[:20]), "inputs cover the stream once, without gaps"
    assert torch.equal(targets.flatten(), tokens[1:21]), (
        "targets are the inputs shifted by one token"
    )


def test_packing_needs_one_full_sequence():
    assert packed_sequences(torch.arange(6), 5).shape == (1, 6)
    with pytest.raises(ConfigError, match=r"^train\.seq_len: the corpus has 5 tokens"):
        packed_sequences(torch.arange(5), 5)


def test_documents_are_separated_by_eos_and_max_tokens_caps():
    tok = ByteTokenizer()
    stream = token_stream(iter(["ab", "", "c"]), tok, 0)
    assert stream.tolist() == [97, 98, tok.eos_id, 99, tok.eos_id], "an empty document adds nothing"
    capped = token_stream(iter(["abcdef", "ghij"] + ["never read"] * 1000), tok, 8)
    assert capped.tolist() == list(b"abcdef") + [tok.eos_id, ord("g")]


def test_stdlib_corpus_is_deterministic_and_capped():
    cfg = data_cfg(max_tokens=20_000)
    first, second = (build_sequences(cfg, 512, 64, seed=0).tokens for _ in range(2))
    assert torch.equal(first, second)
    assert first.shape == ((20_000 - 1) // 64, 65), (
        "exactly max_tokens tokens read, packed into full windows"
    )
    assert first.max() < 512 and first.min() >= 0
    # The stream is the first stdlib sources in sorted order, each followed by the end-of-document
    # token.
    stream, tok = unpack(first), ByteTokenizer()
    expected = token_stream(itertools.islice(stdlib_documents(), 3), tok, 0)
    assert torch.equal(stream[: expected.numel()], expected)
    assert (stream == tok.eos_id).sum() >= 3, "several documents, each ended by the eos token"
    first_doc = next(stdlib_documents())
    first_eos = int((stream == tok.eos_id).nonzero()[0])
    assert tok.decode(stream[:first_eos]) == first_doc


def test_corpus_larger_than_model_vocabulary_is_refused():
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 200 is smaller .*\(257\)"):
        build_sequences(data_cfg(max_tokens=1000), 200, 16, seed=0)


def test_synthetic_sequences_follow_the_seed():
    cfg = data_cfg(name="synthetic")
    a, b, c = (build_sequences(cfg, 50, 8, seed).tokens for seed in (0, 0, 1))
    assert a.shape == (16, 9) and a.max() < 50
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------- text_files with a Hugging Face tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "How vexingly quick daft zebras jump.",
    "Sphinx of black quartz, judge my vow.",
    "Café naïve — déjà vu, 42 times.",
    "Jackdaws love my big sphinx of quartz.",
]


def _save_tokenizer(tokenizer, directory):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """Keep Hugging Face datasets' cache out of the home directory, here and in the CLI's
    processes."""
    import datasets

    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        yield {"HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE tokenizer of 300 tokens (smaller than the tiny model's 512): exact round
    trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS, trainer)
    return _save_tokenizer(tokenizer, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "docs.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS * 2))
    )
    (root / "body.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    (root / "txt").mkdir()
    for i, text in enumerate(TEXTS):  # one document per .txt file, spanning several lines
        (root / "txt" / f"{i:02d}.txt").write_text(text + "\nsecond line\n", encoding="utf-8")
    return root


def _documents(stream, eos_id):
    """Split a token stream at the end-of-document tokens (a trailing partial document is
    dropped)."""
    docs, current = [], []
    for token in stream.tolist():
        if token == eos_id:
            docs.append(current)
            current = []
        else:
            current.append(token)
    return docs


def test_the_data_line_names_the_tokenizer(hf_cache, bpe_dir, corpus):
    """The run's data line says which tokenizer made the ids: the byte-level default says so (a run
    meant for a model's own tokenizer would otherwise train on bytes without a word), a Hugging Face
    one its directory, the key that named it and its vocabulary."""
    with logged() as lines:
        build_sequences(data_cfg(max_tokens=2000), 512, 8, seed=0)
        bpe = data_cfg(
            name="text_files", paths=[str(corpus / "docs.jsonl")], tokenizer=str(bpe_dir)
        )
        build_sequences(bpe, 512, 8, seed=0)
    byte, hf = (line for line in lines if line.startswith("data: "))
    assert byte.endswith(
        "; tokenizer: byte-level (UTF-8 bytes, eos 256; data.tokenizer names a Hugging Face one)"
    ), byte
    assert hf.endswith(f"; tokenizer: {bpe_dir} (data.tokenizer, 300 ids)"), hf


@pytest.mark.parametrize(
    "name, field, texts",
    [
        ("docs.jsonl", "text", TEXTS * 2),
        ("txt/*.txt", "text", [t + "\nsecond line\n" for t in TEXTS]),
        ("body.jsonl", "body", TEXTS),
    ],
)
def test_text_files_are_tokenized_and_round_trip(hf_cache, bpe_dir, corpus, name, field, texts):
    tokenizer = HFTokenizer(str(bpe_dir))
    assert tokenizer.vocab_size == 300 and tokenizer.eos_id is not None
    cfg = data_cfg(
        name="text_files", paths=[str(corpus / name)], text_field=field, tokenizer=str(bpe_dir)
    )
    sequences = build_sequences(cfg, 512, 8, seed=0).tokens
    stream = unpack(sequences)
    full = token_stream(iter(texts), tokenizer, 0)
    assert sequences.shape == ((full.numel() - 1) // 8, 9)
    assert torch.equal(stream, full[: stream.numel()]), (
        "the packed corpus is the documents' token stream"
    )
    assert full.numel() < sum(len(t.encode()) for t in texts), (
        "BPE should merge bytes, not be byte-level"
    )
    docs = _documents(full, tokenizer.eos_id)
    assert [tokenizer.decode(d) for d in docs] == texts, (
        "documents decode back to the corpus text, in order"
    )


def test_text_files_directory_and_glob(hf_cache, corpus):
    texts = list(text_file_documents([str(corpus / "txt")], "text"))
    assert texts == [t + "\nsecond line\n" for t in TEXTS], (
        "a directory: its files in sorted order, one document each"
    )
    with pytest.raises(ConfigError, match=r"^data\.paths: mixes \.txt and \.jsonl"):
        list(text_file_documents([str(corpus)], "text"))


def test_text_files_missing_field_names_text_field(hf_cache, corpus):
    with pytest.raises(ConfigError, match=r"^data\.text_field: 'content' is not a field"):
        list(text_file_documents([str(corpus / "docs.jsonl")], "content"))


def test_text_files_trains_through_the_cli(tmp_path, hf_cache, bpe_dir, corpus):
    run = train(
        tmp_path / "run",
        "data=text_files",
        f"data.paths=['{corpus / 'docs.jsonl'}']",
        f"data.tokenizer='{bpe_dir}'",
        "train.steps=3",
        "train.seq_len=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "logging.progress_bar=false",
        "launch.device=cpu",
        nproc=2,
        env=hf_cache,
        timeout=300,
    )
    assert [m["step"] for m in run.metrics] == [1, 2, 3], run.output
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in run.metrics), run.metrics
    assert run.run_info["world_size"] == 2
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert saved.data.name == "text_files" and saved.data.tokenizer == str(bpe_dir)


def test_a_corpus_smaller_than_one_global_batch_is_named_once(tmp_path):
    """Before, a corpus that packs into fewer sequences than a global batch was repeated within each
    step silently."""
    corpus = tmp_path / "small.jsonl"
    corpus.write_text(json.dumps({"text": "a corpus of one short sentence."}) + "\n")
    run = train(
        tmp_path / "run",
        "data=text_files",
        f"data.paths=['{corpus}']",
        "train.steps=1",
        "train.seq_len=16",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "logging.progress_bar=false",
        "launch.device=cpu",
        nproc=2,
        timeout=300,
    )
    assert run.output.count("fewer than one global batch (train.global_batch_size=4)") == 1, (
        run.output
    )


@pytest.fixture(scope="module")
def big_vocab_dir(tmp_path_factory):
    """A word-level tokenizer of 602 tokens: more than the tiny model's vocab_size of 512."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1, **{f"word{i}": i + 2 for i in range(600)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return _save_tokenizer(tokenizer, tmp_path_factory.mktemp("wordlevel"))


def test_cli_refuses_tokenizer_larger_than_model_vocab(
    monkeypatch, capfd, tmp_path, hf_cache, big_vocab_dir, corpus
):
    # Two workers asked for: the launcher checks the data sources first and starts none (exit 2, one
    # message). In this process up to where the command would start workers (which fails the test).
    for key, value in hf_cache.items():
        monkeypatch.setenv(key, value)
    run = train_command(
        monkeypatch,
        capfd,
        tmp_path / "run",
        "data=text_files",
        f"data.paths=['{corpus / 'docs.jsonl'}']",
        f"data.tokenizer='{big_vocab_dir}'",
        "logging.progress_bar=false",
        "launch.device=cpu",
        nproc=2,
    )
    assert run.returncode == 2, run.output
    assert run.output.count("invalid configuration") == 1, run.output
    assert (
        "invalid configuration: model.vocab_size: 512 is smaller than the tokenizer's vocabulary "
        "(602)" in run.output
    ), run.output
    assert run.metrics == []
    assert run.seconds < 60


def test_cli_refuses_path_matching_no_file(monkeypatch, capfd, tmp_path, hf_cache, corpus):
    missing = corpus / "no_such_dir" / "*.jsonl"
    for key, value in hf_cache.items():
        monkeypatch.setenv(key, value)
    run = train_command(
        monkeypatch,
        capfd,
        tmp_path / "run",
        "data=text_files",
        f"data.paths=['{missing}']",
        "logging.progress_bar=false",
        "launch.device=cpu",
        nproc=2,
    )
    assert run.returncode == 2, run.output
    assert f"invalid configuration: data.paths: '{missing}' matches no file" in run.output, (
        run.output
    )
    assert run.seconds < 60
