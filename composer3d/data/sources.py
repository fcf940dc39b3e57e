"""Corpora: where the documents come from and how each file format is read.

``stdlib`` (the running interpreter's own standard library sources: nothing to download),
``text_files`` (local .txt/.jsonl/.parquet through Hugging Face datasets); ``synthetic`` (seeded random tokens)
needs no source (see :mod:`composer3d.data.corpus`). ``data.format=chat`` reads conversations (a ``messages``
list of {role, content}) from .jsonl/.parquet rows and trains only on the assistant replies (supervised
fine-tuning).
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path
from typing import Iterator

from composer3d.errors import ConfigError


def stdlib_documents() -> Iterator[str]:
    """Source files of the running interpreter's standard library, in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "__pycache__" in path.parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


# file suffix → kind of corpus file (the Hugging Face datasets builder that reads it)
FILE_KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
KIND_NAMES = {"text": ".txt", "json": ".jsonl", "parquet": ".parquet"}


def expand(paths: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in paths:
        if os.path.isdir(pattern):
            matches = [str(p) for p in sorted(Path(pattern).rglob("*")) if p.suffix in FILE_KINDS and p.is_file()]
        else:
            matches = sorted(glob.glob(pattern))
        if not matches:
            raise ConfigError(f"data.paths: {pattern!r} matches no file. Give existing .txt/.jsonl/.parquet files, "
                              "directories holding them, or globs")
        for match in matches:
            if Path(match).suffix not in FILE_KINDS:
                raise ConfigError(f"data.paths: {match!r} is not a .txt, .jsonl/.json or .parquet file. Give only "
                                  "those (a directory contributes only those)")
        files.extend(matches)
    kinds = [name for kind, name in KIND_NAMES.items() if any(FILE_KINDS[Path(f).suffix] == kind for f in files)]
    if len(kinds) > 1:
        raise ConfigError(f"data.paths: mixes {' and '.join(kinds)} files. Use one kind per run")
    return files


def file_kind(files: list[str]) -> str:
    return FILE_KINDS[Path(files[0]).suffix]


def _load_rows(files: list[str], field: str, key: str):
    """The column ``field`` of every row of ``files`` (one kind), in file order; ConfigError naming ``key``."""
    from datasets import load_dataset

    builder = file_kind(files)
    # A .txt file is one document (not one per line); a .jsonl line or a parquet row is one document.
    options = {"sample_by": "document"} if builder == "text" else {}
    dataset = load_dataset(builder, data_files=files, split="train", keep_in_memory=True, **options)
    if field not in dataset.column_names:
        raise ConfigError(f"{key}: {field!r} is not a field of {files[0]} (fields: {dataset.column_names}). "
                          f"Set {key} to the field that holds it")
    return dataset[field]


def text_file_documents(paths: list[str], text_field: str) -> Iterator[str]:
    """One document per .txt file, or per .jsonl/.parquet row (its ``text_field``)."""
    files = expand(paths)
    if file_kind(files) == "text":
        yield from _load_rows(files, "text", "data.text_field")
    else:
        yield from _load_rows(files, text_field, "data.text_field")


def chat_conversations(paths: list[str], messages_field: str) -> Iterator[list[dict]]:
    """One conversation per .jsonl/.parquet row: its ``messages_field``, a list of {role, content} (checked)."""
    files = expand(paths)
    if file_kind(files) == "text":
        raise ConfigError("data.format: chat reads a list of messages from each .jsonl or .parquet row, but "
                          f"data.paths gives .txt files ({files[0]}). Give .jsonl/.parquet files, or use "
                          "data.format=text")
    for row, messages in enumerate(_load_rows(files, messages_field, "data.messages_field")):
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in messages):
            raise ConfigError(f"data.messages_field: row {row} of {paths} holds {str(messages)[:200]!r}, not a list "
                              "of {role, content} messages. Point data.messages_field at such a list")
        # Rows of one file share a schema: drop the keys another message filled and this one lacks (None), so
        # the template's `is defined` tests see each message as it was written.
        yield [{k: v for k, v in m.items() if v is not None} for m in messages]
