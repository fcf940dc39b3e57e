"""A corpus prepared once into token shards (composer3d-prepare, data.prepared) trains exactly as
the same corpus read in memory: the same windows and batches, the same losses; its maps are
file-backed; a bad, partial or changed prepared corpus is refused naming data.prepared."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from harness import train, train_in_one_group
from hf_models import make_tokenizer
from omegaconf import OmegaConf

from composer3d.data import (
    MANIFEST,
    GlobalBatchLoader,
    PreparedSequences,
    build_sequences,
    check_prepared,
    prepare_corpus,
    read_manifest,
    token_dtype,
)
from composer3d.errors import ConfigError

WORDS = (
    "the quick brown fox jumps over the lazy dog pipeline tensor data parallel shard rank "
    "checkpoint layout loss step"
).split()


def data_cfg(**kw):
    return OmegaConf.create(
        {
            "name": "text_files",
            "paths": [],
            "format": "text",
            "text_field": "text",
            "messages_field": "messages",
            "tokenizer": None,
            "document_masking": True,
            "max_tokens": 0,
            "synthetic_sequences": 16,
            "prepared": None,
            "prepare_workers": 1,
            "prepare_overwrite": False,
            **kw,
        }
    )


def _texts(n, seed=0):
    """Documents of 0 to 60 words (some empty: they add nothing, in both paths)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(0, 60))) for _ in range(n)]


def _conversations(n, seed=0):
    rng, rows = np.random.default_rng(seed), []
    for i in range(n):
        messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for _ in range(rng.integers(1, 4)):
            messages.append(
                {"role": "user", "content": " ".join(rng.choice(WORDS, size=rng.integers(1, 12)))}
            )
            if i % 7 != 5:  # some conversations have no reply: left out in both paths
                messages.append(
                    {
                        "role": "assistant",
                        "content": " ".join(rng.choice(WORDS, size=rng.integers(1, 20))),
                    }
                )
        rows.append({"messages": messages})
    return rows


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """Keep Hugging Face datasets' cache (the in-memory path's reader) out of the home directory."""
    import datasets

    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        for key, value in {
            "HF_DATASETS_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)  # 512 ids (the tiny model's vocabulary), with a chat template
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _texts(150, seed=1))
    )
    (root / "b.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _texts(150, seed=2))
    )
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _conversations(60)))
    (root / "txt").mkdir()
    # one document per file; \r\n read as \n by both paths
    for i, text in enumerate(_texts(12, seed=3)):
        (root / "txt" / f"{i:02d}.txt").write_bytes((text + "\r\nlast line\n").encode())
    return root


KINDS = {  # name → data settings (format, paths)
    "text": dict(paths=["a.jsonl", "b.jsonl"]),
    "chat": dict(format="chat", paths=["chat.jsonl"]),
    "txt": dict(paths=["txt"]),
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, hf_cache, corpus, tokenizer_dir):
    """Each kind of corpus prepared in small pieces (windows then span shards); the .txt files by a
    pool of 2 processes, with the byte-level tokenizer (the others with the BPE one)."""
    out = {}
    for kind, settings in KINDS.items():
        cfg = data_cfg(
            **{**settings, "paths": [str(corpus / p) for p in settings["paths"]]},
            tokenizer=None if kind == "txt" else str(tokenizer_dir),
            prepared=str(tmp_path_factory.mktemp(kind) / "prepared"),
            prepare_workers=2 if kind == "txt" else 1,
        )
        manifest = prepare_corpus(cfg, None, piece_bytes=1500)
        out[kind] = (cfg, manifest)
    return out


# ------------------------------------------------------------------------------------------- format


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(257) == np.uint16 and token_dtype(1 << 16) == np.uint16  # ids 0..65535
    assert token_dtype((1 << 16) + 1) == np.uint32 and token_dtype(152_064) == np.uint32


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path, hf_cache):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(tmp_path / "tok")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "w69999 w3 w65534 w65535"}) + "\n")
    cfg = data_cfg(
        paths=[str(tmp_path / "docs.jsonl")],
        tokenizer=str(tmp_path / "tok"),
        prepared=str(tmp_path / "prepared"),
    )
    manifest = prepare_corpus(cfg)
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["vocab_size"] == 70_002
    tokens = np.load(tmp_path / "prepared" / f"{manifest['shards'][0]['name']}.tokens.npy")
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [70_001, 5, 65_536, 65_537, 0], (
        "ids past 65535 kept whole, then the eos"
    )


def test_manifest_records_tokenizer_sources_and_counts(prepared, corpus, tokenizer_dir):
    cfg, manifest = prepared["text"]
    on_disk = read_manifest(cfg.prepared)
    assert (
        on_disk["format"] == 1
        and on_disk["dtype"] == "uint16"
        and on_disk["identity"] == manifest["identity"]
    )
    assert (
        on_disk["tokenizer"]["path"] == str(tokenizer_dir)
        and len(on_disk["tokenizer"]["sha256"]) == 64
    )
    assert [s["path"] for s in on_disk["sources"]] == [
        str(corpus / "a.jsonl"),
        str(corpus / "b.jsonl"),
    ]
    assert all(s["bytes"] > 0 and s["mtime_ns"] > 0 for s in on_disk["sources"])
    assert len(on_disk["shards"]) > 4, "small pieces: several shards"
    assert on_disk["tokens"] == sum(s["tokens"] for s in on_disk["shards"])
    empty = sum(1 for t in _texts(150, seed=1) + _texts(150, seed=2) if not t)
    assert on_disk["documents"] == 300 - empty > 0, "one document per non-empty row"


# -------------------------------------------------------------------- the same windows as in memory


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("document_masking", [True, False])
def test_prepared_batches_equal_the_in_memory_ones(prepared, kind, document_masking):
    cfg, _ = prepared[kind]
    cfg = OmegaConf.merge(cfg, {"document_masking": document_masking})
    seq_len = 16
    in_memory = build_sequences(OmegaConf.merge(cfg, {"prepared": None}), 512, seq_len, 0)
    served = build_sequences(cfg, 512, seq_len, 0)
    assert isinstance(served, PreparedSequences) and len(served) == len(in_memory) > 30
    rows = list(range(len(in_memory)))
    want, got = in_memory.batch(rows), served.batch(rows)
    for name in ("inputs", "targets", "position_ids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{kind}: {name} differ"
    assert (want.targets == -100).any() == (document_masking or kind == "chat"), (
        "the masks are exercised"
    )
    shuffled = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:24].tolist()
    assert served.target_count(shuffled) == in_memory.target_count(shuffled)
    assert torch.equal(served.batch(shuffled).targets, in_memory.batch(shuffled).targets)
    # the loader's global batches, sliced over 2 data-parallel ranks
    loaders = [
        (GlobalBatchLoader(s, 8, r, 2, seed=3)) for s in (in_memory, served) for r in range(2)
    ]
    for _ in range(3):
        a, b, c, d = (loader.next_batch() for loader in loaders)
        assert torch.equal(a.targets, c.targets) and torch.equal(b.inputs, d.inputs)
        assert a.global_targets == c.global_targets


def test_prepared_tokens_are_file_backed_maps(prepared):
    cfg, manifest = prepared["chat"]
    served = PreparedSequences(cfg.prepared, 16)
    assert len(served.tokens) == len(manifest["shards"]) > 1
    for shard, tokens, mask in zip(manifest["shards"], served.tokens, served.trainable):
        for array, part in ((tokens, "tokens"), (mask, "mask")):
            assert isinstance(array, np.memmap) and array.mode == "r" and not array.flags.writeable
            assert str(array.filename) == os.path.join(cfg.prepared, f"{shard['name']}.{part}.npy")
            assert not array.flags.owndata, "a view of the mapped file, not a copy"
    assert served.tokens[0].dtype == np.uint16


# --------------------------------------------------------------------------- refusals and atomicity


def test_an_existing_prepared_dir_is_reused_or_refused(tmp_path, hf_cache, corpus):
    source = tmp_path / "docs.jsonl"
    source.write_text((corpus / "a.jsonl").read_text())
    cfg = data_cfg(paths=[str(source)], prepared=str(tmp_path / "prepared"))
    first = prepare_corpus(cfg)
    assert not first["reused"] and prepare_corpus(cfg)["reused"], (
        "same sources and tokenizer: kept as it is"
    )
    with open(source, "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(
        ConfigError,
        match=r"^data\.prepared: .* prepared with other sources .*prepare_overwrite=true",
    ):
        prepare_corpus(cfg)
    assert read_manifest(cfg.prepared)["identity"] == first["identity"], (
        "a refusal leaves it untouched"
    )
    second = prepare_corpus(OmegaConf.merge(cfg, {"prepare_overwrite": True}))
    assert second["identity"] != first["identity"] and second["tokens"] > first["tokens"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(
        ConfigError, match=r"^data\.prepared: .*other exists and is not a prepared corpus"
    ):
        prepare_corpus(OmegaConf.merge(cfg, {"prepared": str(tmp_path / "other")}))


def test_a_failed_prepare_leaves_no_manifest(tmp_path, hf_cache, corpus):
    rows = [json.dumps({"text": t}) for t in _texts(150)] + [
        json.dumps({"text": 7})
    ]  # past the up-front sniff
    (tmp_path / "docs.jsonl").write_text("\n".join(rows) + "\n")
    cfg = data_cfg(paths=[str(tmp_path / "docs.jsonl")], prepared=str(tmp_path / "prepared"))
    with pytest.raises(
        ConfigError, match=r"^data\.text_field: .*docs\.jsonl byte \d+ holds int '7', not text"
    ):
        prepare_corpus(cfg, piece_bytes=1000)
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "prepared.partial").exists()


def test_a_killed_prepare_leaves_no_manifest(tmp_path, hf_cache, corpus):
    """SIGKILL after the first shard is written: the partial directory has shards, the target
    nothing; the next prepare clears the leftovers and finishes."""
    cfg = data_cfg(paths=[str(corpus / "a.jsonl")], prepared=str(tmp_path / "prepared"))
    script = (
        "import os, signal, sys; from omegaconf import OmegaConf; from composer3d.data import "
        "preparation as p\n"
        "piece = p.prepare_piece\n"
        "def die_after(job):\n    piece(job); os.kill(os.getpid(), signal.SIGKILL)\n"
        "p.prepare_piece = die_after\n"
        "p.prepare_corpus(OmegaConf.create(sys.argv[1]), piece_bytes=1000)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(OmegaConf.to_container(cfg))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    assert list((tmp_path / "prepared.partial").glob("shard-*.tokens.npy")), "it was killed mid-way"
    assert (
        not (tmp_path / "prepared.partial" / MANIFEST).exists()
        and not (tmp_path / "prepared").exists()
    )
    with pytest.raises(
        ConfigError, match=r"^data\.prepared: .*prepared does not exist. Prepare it with"
    ):
        check_prepared(cfg, 512, 16)
    assert not prepare_corpus(cfg)["reused"]
    assert (tmp_path / "prepared" / MANIFEST).is_file() and not (
        tmp_path / "prepared.partial"
    ).exists()


def test_bad_prepared_dirs_are_refused_naming_the_key(tmp_path, prepared):
    cfg, manifest = prepared["text"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^data\.prepared: .*empty holds no manifest\.json"):
        check_prepared(OmegaConf.merge(cfg, {"prepared": str(tmp_path / "empty")}), 512, 16)
    with pytest.raises(
        ConfigError, match=r"^train\.seq_len: the prepared corpus .* has \d+ tokens, too few"
    ):
        check_prepared(cfg, 512, manifest["tokens"])
    with pytest.raises(
        ConfigError, match=r"^model\.vocab_size: 300 is smaller than the vocabulary .*\(\d+\)"
    ):
        check_prepared(cfg, 300, 16)
    with pytest.raises(ConfigError, match=r"^data\.format: .* was prepared as \{'format': 'text'"):
        check_prepared(OmegaConf.merge(cfg, {"format": "chat"}), 512, 16)
    copy = tmp_path / "copy"
    shutil.copytree(cfg.prepared, copy)
    changed = OmegaConf.merge(cfg, {"prepared": str(copy), "paths": [cfg.paths[0]]})
    with pytest.raises(
        ConfigError, match=r"^data\.prepared: .* prepared from other sources than data\.paths"
    ):
        check_prepared(changed, 512, 16)
    assert len(check_prepared(OmegaConf.merge(changed, {"paths": []}), 512, 16)) > 0, (
        "as prepared: fine"
    )
    first = manifest["shards"][0]["name"]
    np.save(copy / f"{first}.tokens.npy", np.zeros(3, dtype=np.uint16))  # cut short
    with pytest.raises(
        ConfigError,
        match=rf"^data\.prepared: .*{first}\.tokens\.npy holds \(3,\) uint16, the manifest",
    ):
        check_prepared(OmegaConf.merge(changed, {"paths": []}), 512, 16)
    (copy / MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(
        ConfigError, match=r"^data\.prepared: .* is of format 99; this composer3d reads format 1"
    ):
        check_prepared(OmegaConf.merge(changed, {"paths": []}), 512, 16)


def test_a_loader_state_from_another_prepared_corpus_is_refused(prepared):
    text, chat = (PreparedSequences(prepared[kind][0].prepared, 16) for kind in ("text", "chat"))
    source = GlobalBatchLoader(text, 8, 0, 1, 0)
    source.next_batch()
    state = json.loads(json.dumps(source.state_dict()))
    assert state["prepared_corpus"] == text.identity
    same = GlobalBatchLoader(PreparedSequences(prepared["text"][0].prepared, 16), 8, 0, 1, 0)
    same.load_state_dict(state)
    assert same.consumed == 8
    with pytest.raises(
        ConfigError, match=r"^data\.prepared: the checkpoint was trained on the prepared corpus"
    ):
        GlobalBatchLoader(chat, 8, 0, 1, 0).load_state_dict(state)


# ------------------------------------------------------------------------ real runs, real processes

RUN = [
    "model=tiny",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.deterministic=true",
    "launch.device=cpu",
    "logging.progress_bar=false",
]


def test_two_ranks_train_the_same_losses_and_a_changed_corpus_is_not_resumed(
    tmp_path, hf_cache, corpus, tokenizer_dir
):
    """composer3d-prepare's command, then 2 gloo ranks (dp_shard=2) trained on the prepared corpus
    and on the same corpus in memory: the same losses, bit for bit. Then the corpus changes and is
    prepared again into the same directory: resuming the checkpoint on it is refused (exit 2),
    naming data.prepared."""
    source = tmp_path / "docs.jsonl"
    source.write_text((corpus / "a.jsonl").read_text() + (corpus / "b.jsonl").read_text())
    data = ["data=text_files", f"data.paths=[{source}]", f"data.tokenizer={tokenizer_dir}"]
    prepared = f"data.prepared={tmp_path / 'prepared'}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer3d.commands.prepare",
            *data,
            prepared,
            "data.prepare_workers=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tokens"] > 1000 and summary["dtype"] == "uint16" and not summary["reused"], (
        summary
    )

    common = [*RUN, "train.steps=3", "parallel.dp_shard=2", *data]
    in_memory, served = train_in_one_group(
        [
            (tmp_path / "memory", [*common, "checkpoint.enabled=false"]),
            (tmp_path / "run", [*common, prepared]),
        ],
        2,
    )
    assert len(in_memory.losses) == 3 and all(np.isfinite(in_memory.losses))
    assert served.losses == in_memory.losses, "bit-exact: the same batches in the same order"

    with open(source, "a") as f:
        f.write(json.dumps({"text": "a document added after the checkpoint"}) + "\n")
    prepare_corpus(
        data_cfg(
            paths=[str(source)],
            tokenizer=str(tokenizer_dir),
            prepared=str(tmp_path / "prepared"),
            prepare_overwrite=True,
        )
    )
    resumed = train(
        tmp_path / "run",
        *RUN,
        "train.steps=5",
        "parallel.dp_shard=2",
        "data=text_files",
        prepared,
        nproc=2,
        check=False,
    )
    assert resumed.returncode == 2, resumed.output
    assert resumed.output.count("invalid configuration") == 1, resumed.output
    assert (
        "invalid configuration: data.prepared: the checkpoint was trained on the prepared corpus"
        in resumed.output
    )
    assert "checkpoint.resume=none" in resumed.output and len(resumed.losses) == 3, (
        "nothing trained on"
    )


@pytest.mark.parametrize(
    "command, overrides, message",
    [
        (
            "composer3d.commands.prepare",
            ["data=text_files", "data.paths=[{tmp}/nothing/*.jsonl]", "data.prepared={tmp}/p"],
            "composer3d-prepare: invalid configuration: data.paths: '{tmp}/nothing/*.jsonl' "
            "matches no file",
        ),
        (
            "composer3d.commands.train",
            [
                "data=text_files",
                "data.prepared={tmp}",
                "launch.nproc_per_node=2",
                "run.dir={tmp}/run",
            ],
            "composer3d: invalid configuration: data.prepared: {tmp} holds no manifest.json",
        ),
    ],
)
def test_cli_refuses_bad_input_before_any_worker(tmp_path, command, overrides, message):
    proc = subprocess.run(
        [sys.executable, "-m", command, *(o.format(tmp=tmp_path) for o in overrides)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr.count("invalid configuration") == 1
        and message.format(tmp=tmp_path) in proc.stderr
    ), proc.stderr
    assert (
        "Traceback" not in proc.stderr
        and not (tmp_path / "p").exists()
        and not (tmp_path / "run").exists()
    )
