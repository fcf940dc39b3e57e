"""A prepared corpus on disk (``composer3d-prepare`` writes it, ``data.prepared`` trains from it):
the format, its identity, and the training windows served straight from read-only memory maps of its
token shards.

The directory holds ``manifest.json`` and, per shard, ``<name>.tokens.npy`` (the shard's token
stream: uint16 where the tokenizer's ids fit, else uint32), ``<name>.starts.npy`` (int64 offsets of
its documents' first tokens) and, for ``data.format=chat``, ``<name>.mask.npy`` (uint8: 1 where a
token may be a target). Shards hold whole documents, in corpus order; their concatenation is the
token stream the in-memory path builds (:func:`~composer3d.data.streams.document_stream` /
``conversation_stream`` without ``data.max_tokens``), and window i is its tokens [i·seq_len,
i·seq_len + seq_len + 1), as :func:`~composer3d.data.packing.packed_sequences` cuts it: a window may
span two shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from composer3d.config.schema import DataConfig, ModelConfig
from composer3d.data.packing import Batch, rows_batch, rows_target_count
from composer3d.data.tokenizers import tokenizer_source
from composer3d.errors import ConfigError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The files of a Hugging Face tokenizer directory that define its ids (a model directory's weights
# are left out).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
# What the identity hashes: everything that decides the tokens (the manifest's own bookkeeping is
# left out).
IDENTITY_KEYS = (
    "format",
    "settings",
    "tokenizer",
    "sources",
    "dtype",
    "shards",
    "tokens",
    "documents",
)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def corpus_settings(data_cfg: DataConfig) -> dict:
    """The data settings that decide the token stream, besides the tokenizer and the sources."""
    chat = getattr(data_cfg, "format", "text") == "chat"
    return {
        "format": "chat" if chat else "text",
        "field": getattr(data_cfg, "messages_field", "messages") if chat else data_cfg.text_field,
    }


def tokenizer_identity(
    tokenizer, data_cfg: DataConfig, model_cfg: ModelConfig | None = None
) -> dict:
    """Which tokenizer made the ids: its directory, vocabulary size, eos id and
    :func:`tokenizer_digest`."""
    source = tokenizer_source(data_cfg, model_cfg)
    return {
        "path": "byte-level" if source is None else os.path.abspath(source[0]),
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": int(tokenizer.eos_id),
        "sha256": tokenizer_digest(data_cfg, model_cfg),
    }


def tokenizer_digest(data_cfg: DataConfig, model_cfg: ModelConfig | None = None) -> str:
    """sha256 of the files of the tokenizer the config names (the byte-level one: of its
    definition)."""
    source = tokenizer_source(data_cfg, model_cfg)
    digest = hashlib.sha256()
    if source is None:
        digest.update(b"composer3d byte-level tokenizer: UTF-8 bytes 0..255, eos 256")
    else:
        directory = Path(source[0])
        names = os.listdir(directory) if directory.is_dir() else []
        for name in sorted(n for n in names if n in TOKENIZER_FILES or n.endswith(".tiktoken")):
            digest.update(name.encode() + b"\0" + (directory / name).read_bytes() + b"\0")
    return digest.hexdigest()


def source_entries(files: list[str]) -> list[dict]:
    """The source files as the manifest records them: absolute path, size and modification time (not
    a content hash: hashing a 50 GB corpus would cost as much as reading it)."""
    entries = []
    for file in files:
        stat = os.stat(file)
        entries.append(
            {"path": os.path.abspath(file), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        )
    return entries


def corpus_identity(manifest: dict) -> str:
    """sha256 of what decides a prepared corpus's tokens: two directories with one identity train
    alike."""
    return hashlib.sha256(
        json.dumps({k: manifest.get(k) for k in IDENTITY_KEYS}, sort_keys=True).encode()
    ).hexdigest()


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a prepared corpus; ConfigError naming data.prepared when there is none of
    this format."""
    path = Path(directory) / MANIFEST
    prepare = (
        "Prepare it with composer3d-prepare and the same data.*/model overrides "
        "(data.prepared=<dir>)"
    )
    if not path.is_file():
        what = (
            "does not exist"
            if not Path(directory).exists()
            else f"holds no {MANIFEST} (not a prepared corpus, or its preparation did not finish)"
        )
        raise ConfigError(f"data.prepared: {directory} {what}. {prepare}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"data.prepared: {path} is unreadable ({error}). {prepare} again"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ConfigError(
            f"data.prepared: {path} is of format {found!r}; this composer3d reads format "
            f"{FORMAT_VERSION}. {prepare} again (into a new directory, or with "
            "data.prepare_overwrite=true)"
        )
    return manifest


def check_same_corpus(saved: dict, identity: str | None) -> None:
    """Refuse a loader state saved on another prepared corpus (other sources, tokenizer or token
    counts): its position would point into other windows. A state saved without one (the in-memory
    path) is not checked here."""
    recorded = saved.get("prepared_corpus")
    if recorded is not None and recorded != identity:
        now = (
            f"the prepared corpus of identity {identity[:16]}"
            if identity
            else "a corpus read in memory"
        )
        raise ConfigError(
            "data.prepared: the checkpoint was trained on the prepared corpus of identity "
            f"{recorded[:16]}, and this run reads {now}: its sources, tokenizer or token counts "
            "changed since. Resume with data.prepared pointing at the corpus it was saved with "
            "(composer3d-prepare of the same sources with the same tokenizer gives the same "
            "identity), or start afresh with checkpoint.resume=none"
        )


class PreparedSequences:
    """The packed training windows of a prepared corpus, served from read-only memory maps of its
    shards.

    The interface :class:`~composer3d.data.loader.GlobalBatchLoader` uses (``__len__``,
    ``target_count``, ``batch``), with the batches :class:`~composer3d.data.packing.PackedSequences`
    builds from the same token stream. Nothing is copied into memory but the rows asked for: each
    rank maps the same files, and the page cache holds them once per machine. ``identity``:
    :func:`corpus_identity`, recorded in the loader's state.
    """

    def __init__(self, directory: str | Path, seq_len: int, document_masking: bool = True):
        self.directory = Path(directory)
        self.manifest = read_manifest(directory)
        self.identity = corpus_identity(self.manifest)
        self.seq_len, self.document_masking = seq_len, document_masking
        chat = self.manifest["settings"]["format"] == "chat"
        self.tokens, self.starts, self.trainable = [], [], [] if chat else None
        for shard in self.manifest["shards"]:
            self.tokens.append(
                self._map(shard["name"], "tokens", shard["tokens"], self.manifest["dtype"])
            )
            self.starts.append(self._map(shard["name"], "starts", shard["documents"], "int64"))
            if chat:
                self.trainable.append(self._map(shard["name"], "mask", shard["tokens"], "uint8"))
        # each shard's first token
        self.offsets = np.cumsum([0] + [s["tokens"] for s in self.manifest["shards"]])
        self.num_tokens = int(self.offsets[-1])
        self.num_sequences = (self.num_tokens - 1) // seq_len
        if self.num_sequences < 1:
            raise ConfigError(
                f"train.seq_len: the prepared corpus {directory} has {self.num_tokens} tokens, too "
                f"few for one sequence of {seq_len}. Lower train.seq_len or prepare more data"
            )

    def _map(self, name: str, part: str, length: int, dtype: str) -> np.memmap:
        path = self.directory / f"{name}.{part}.npy"
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"data.prepared: {path} is missing or unreadable ({error}). Prepare the corpus "
                "again with composer3d-prepare (data.prepare_overwrite=true)"
            ) from None
        if array.shape != (length,) or array.dtype != np.dtype(dtype):
            raise ConfigError(
                f"data.prepared: {path} holds {array.shape} {array.dtype}, the manifest says "
                f"({length},) {dtype}. Prepare the corpus again with composer3d-prepare "
                "(data.prepare_overwrite=true)"
            )
        return array

    def __len__(self) -> int:
        return self.num_sequences

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_sequences, self.seq_len + 1)

    def _pieces(self, row: int):
        """(shard, first, last, column) for each shard the window ``row`` reads: its tokens [first,
        last) go to the window's columns from ``column`` on."""
        begin = row * self.seq_len
        end = begin + self.seq_len + 1
        shard = int(np.searchsorted(self.offsets, begin, side="right")) - 1
        while begin < end:
            first = begin - int(self.offsets[shard])
            last = min(end, int(self.offsets[shard + 1])) - int(self.offsets[shard])
            yield shard, first, last, begin - row * self.seq_len
            begin += last - first
            shard += 1

    def _rows(self, rows: list[int], with_tokens: bool):
        """(tokens int64, starts, trainable) of the windows, each (len(rows), seq_len + 1)."""
        width = self.seq_len + 1
        tokens = np.empty((len(rows), width), dtype=np.int64) if with_tokens else None
        starts = np.zeros((len(rows), width), dtype=bool)
        trainable = None if self.trainable is None else np.empty((len(rows), width), dtype=bool)
        for i, row in enumerate(rows):
            for shard, first, last, column in self._pieces(row):
                span = slice(column, column + last - first)
                if with_tokens:
                    tokens[i, span] = self.tokens[shard][first:last]
                documents = self.starts[shard]
                lo, hi = np.searchsorted(documents, first), np.searchsorted(documents, last)
                starts[i, documents[lo:hi] - first + column] = True
                if trainable is not None:
                    trainable[i, span] = self.trainable[shard][first:last]
        return tuple(
            None if a is None else torch.from_numpy(a) for a in (tokens, starts, trainable)
        )

    def target_count(self, rows: list[int]) -> int:
        if self.trainable is None and not self.document_masking:
            return len(rows) * self.seq_len  # every target counts: no need to read the flags
        _, starts, trainable = self._rows(rows, with_tokens=False)
        return rows_target_count(starts, trainable, len(rows), self.seq_len, self.document_masking)

    def batch(self, rows: list[int]) -> Batch:
        return rows_batch(*self._rows(rows, with_tokens=True), self.document_masking)
