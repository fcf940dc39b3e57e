"""Preparing a corpus once (``composer3d-prepare``): read, tokenized in parallel, written as token
shards.

The corpus is cut into pieces of about ``PIECE_BYTES`` (whole .txt files, line ranges of .jsonl
files, row groups of parquet files); a process pool tokenizes them, each piece into one shard
(format: :mod:`~composer3d.data.shards`), in the temporary directory ``<data.prepared>.partial``.
The manifest is written last and the directory renamed into place only then, so a prepare that is
killed or fails leaves no manifest behind (the next one clears the partial directory). Every check a
bad input fails is made before the first worker starts.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from composer3d.config.schema import DataConfig, ModelConfig
from composer3d.data.corpus import check_sources
from composer3d.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    corpus_identity,
    corpus_settings,
    source_entries,
    token_dtype,
    tokenizer_identity,
)
from composer3d.data.sources import Piece, conversation, corpus_pieces, document, expand, piece_rows
from composer3d.data.tokenizers import ByteTokenizer, HFTokenizer, tokenizer_source
from composer3d.errors import ConfigError

log = logging.getLogger("composer3d")

# of source text per piece: a worker holds about 10x that while it tokenizes one
PIECE_BYTES = 64 << 20
ENCODE_BATCH = 1024  # documents per tokenizer call


def prepare_corpus(
    data_cfg: DataConfig, model_cfg: ModelConfig | None = None, piece_bytes: int = PIECE_BYTES
) -> dict:
    """Prepare ``data.paths`` into ``data.prepared``; returns its manifest, with ``seconds`` and
    ``reused``.

    An existing directory prepared from the same sources (paths, sizes, mtimes), settings and
    tokenizer is kept as it is; any other is refused unless ``data.prepare_overwrite``.
    """
    directory = Path(data_cfg.prepared)
    if not data_cfg.paths:
        raise ConfigError(
            "data.paths: composer3d-prepare reads the corpus from data.paths, which names nothing. "
            "Set data.paths=[/path/to/corpus/*.jsonl]"
        )
    settings = corpus_settings(data_cfg)
    tokenizer = check_sources(
        data_cfg, model_cfg.vocab_size if model_cfg is not None else 1 << 32, model_cfg
    )
    files = expand(list(data_cfg.paths))
    fingerprint = {
        "format": FORMAT_VERSION,
        "settings": settings,
        "tokenizer": tokenizer_identity(tokenizer, data_cfg, model_cfg),
        "sources": source_entries(files),
        "dtype": token_dtype(tokenizer.vocab_size).name,
    }
    existing = _existing(
        directory, fingerprint, bool(getattr(data_cfg, "prepare_overwrite", False))
    )
    if existing is not None:
        log.info(
            "data.prepared: %s already holds this corpus (%d tokens); nothing to do",
            directory,
            existing["tokens"],
        )
        return {**existing, "seconds": 0.0, "reused": True}

    began = time.monotonic()
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a killed prepare's leftovers
    partial.mkdir(parents=True)
    pieces = corpus_pieces(files, piece_bytes)
    jobs = [
        (
            index,
            piece,
            settings,
            tokenizer_source(data_cfg, model_cfg),
            fingerprint["dtype"],
            str(partial),
        )
        for index, piece in enumerate(pieces)
    ]
    workers = min(int(getattr(data_cfg, "prepare_workers", 0)) or os.cpu_count() or 1, len(jobs))
    log.info(
        "data.prepared: tokenizing %d file(s) in %d piece(s) with %d worker(s) into %s",
        len(files),
        len(jobs),
        workers,
        directory,
    )
    try:
        if workers == 1:
            shards = [prepare_piece(job) for job in jobs]
        else:
            # spawn, not fork: this process has loaded torch and the tokenizer, whose thread pools a
            # fork would copy mid-state (a known source of deadlocks in the children)
            with ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")
            ) as pool:
                shards = list(pool.map(prepare_piece, jobs))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shards = [shard for shard in shards if shard["tokens"]]
    manifest = {
        **fingerprint,
        "shards": shards,
        "tokens": sum(s["tokens"] for s in shards),
        "documents": sum(s["documents"] for s in shards),
    }
    if manifest["tokens"] == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(
            f"data.paths: the corpus holds no text to train on ({', '.join(files[:3])}). Give "
            "files whose documents are not empty"
        )
    manifest["identity"] = corpus_identity(manifest)
    _write_json(partial / MANIFEST, manifest)
    _swap_into_place(partial, directory)
    seconds = time.monotonic() - began
    log.info(
        "data.prepared: %s: %d tokens (%s), %d documents, %d shards in %.1f s (%.0f tokens/s)",
        directory,
        manifest["tokens"],
        manifest["dtype"],
        manifest["documents"],
        len(shards),
        seconds,
        manifest["tokens"] / max(seconds, 1e-9),
    )
    return {**manifest, "seconds": seconds, "reused": False}


def _existing(directory: Path, fingerprint: dict, overwrite: bool) -> dict | None:
    """The manifest of ``directory`` when it already holds this corpus; None when it may be
    (over)written."""
    if not directory.exists() or (directory.is_dir() and not any(directory.iterdir())):
        return None
    manifest = None
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        pass
    if isinstance(manifest, dict) and all(manifest.get(k) == v for k, v in fingerprint.items()):
        return manifest
    if overwrite:
        return None
    if not isinstance(manifest, dict):
        raise ConfigError(
            f"data.prepared: {directory} exists and is not a prepared corpus (no readable "
            f"{MANIFEST}). Choose a new directory, or set data.prepare_overwrite=true to replace "
            "what it holds"
        )
    differing = [k for k, v in fingerprint.items() if manifest.get(k) != v]
    raise ConfigError(
        f"data.prepared: {directory} holds a corpus prepared with other {', '.join(differing)} "
        "than this config's (sources are compared by path, size and modification time). Choose a "
        "new directory, or set data.prepare_overwrite=true to prepare it again"
    )


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _swap_into_place(partial: Path, directory: Path) -> None:
    """``partial`` becomes ``directory`` by renames (the old one, if any, removed after)."""
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        os.replace(directory, old)
    os.replace(partial, directory)
    shutil.rmtree(old, ignore_errors=True)


@functools.lru_cache(maxsize=2)
def _tokenizer(source: tuple[str, str] | None) -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(*source) if source else ByteTokenizer()  # once per worker process


def prepare_piece(job: tuple) -> dict:
    """One piece into one shard (in a pool worker): its tokens, documents' starts and (chat)
    trainable mask."""
    index, piece, settings, source, dtype, directory = job
    tokenizer = _tokenizer(source)
    if settings["format"] == "chat":
        parts = _conversations(piece, settings["field"], tokenizer)
    else:
        parts = _documents(piece, settings["field"], tokenizer)
    name = f"shard-{index:06d}"
    tokens, masks, lengths = [], [], []
    for ids, mask in parts:
        tokens.append(ids)
        lengths.append(ids.size)
        if mask is not None:
            masks.append(mask)
    if not tokens:
        return {"name": name, "tokens": 0, "documents": 0}
    stream = np.concatenate(tokens)
    # never silently wrapped into other ids
    if stream.min() < 0 or stream.max() >= np.iinfo(dtype).max + 1:
        raise ConfigError(
            f"data.tokenizer: it gave id {int(stream.max())} (or a negative one), which {dtype} "
            "cannot hold though its vocabulary size says it would. Give a tokenizer whose ids stay "
            "below its vocabulary size"
        )
    out = Path(directory)
    np.save(out / f"{name}.tokens.npy", stream.astype(dtype))
    np.save(out / f"{name}.starts.npy", np.cumsum([0] + lengths[:-1], dtype=np.int64))
    if settings["format"] == "chat":
        np.save(out / f"{name}.mask.npy", np.concatenate(masks).astype(np.uint8))
    return {"name": name, "tokens": int(stream.size), "documents": len(lengths)}


def _documents(piece: Piece, field: str, tokenizer):
    """(ids + eos, None) for each non-empty document of the piece, as :func:`document_stream` builds
    them."""
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    batch = []
    for value, where in piece_rows(piece, field, "data.text_field"):
        text = document(value, where)
        if text:
            batch.append(text)
        if len(batch) == ENCODE_BATCH:
            yield from (
                (np.concatenate([ids.astype(np.int64), eos]), None)
                for ids in tokenizer.encode_batch(batch)
            )
            batch = []
    if batch:
        yield from (
            (np.concatenate([ids.astype(np.int64), eos]), None)
            for ids in tokenizer.encode_batch(batch)
        )


def _conversations(piece: Piece, field: str, tokenizer):
    """(ids, trainable mask) for each conversation with an assistant reply, as
    :func:`conversation_stream` keeps."""
    for value, where in piece_rows(piece, field, "data.messages_field"):
        ids, mask = tokenizer.encode_chat(conversation(value, where))
        if ids.numel() and mask.any():
            yield ids.numpy(), mask.numpy()
