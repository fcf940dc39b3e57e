"""The data: a known dataset and format, files where the dataset reads files, and what chat data
needs (a tokenizer with a chat template, the messages field) and preference data (packed documents,
read in memory)."""

from __future__ import annotations

from typing import Any

from composer3d.config.checks.common import _require

DATASETS = ("stdlib", "synthetic", "text_files")
DATA_FORMATS = ("text", "chat", "preference")


def _check_data(d: Any, m: Any) -> None:
    _require(
        d.name in DATASETS, "data.name", f"unknown dataset {d.name!r}", f"Choose one of {DATASETS}"
    )
    if d.prepared:
        _require(
            d.name == "text_files",
            "data.prepared",
            f"holds a corpus of files, and data.name={d.name} reads none",
            "Use data=text_files (or data=chat) with data.prepared",
        )
    _require(
        d.prepare_workers >= 0,
        "data.prepare_workers",
        f"must be >= 0, got {d.prepare_workers}",
        "Use 0 for one per CPU core",
    )
    if d.name == "text_files":
        _require(
            len(d.paths) > 0 or bool(d.prepared),
            "data.paths",
            "text_files needs at least one file, directory or glob",
            "Set data.paths=[/path/to/corpus/*.jsonl], or data.prepared=<prepared dir>",
        )
    else:
        _require(
            not d.paths,
            "data.paths",
            f"is set, but data.name={d.name} reads no files: the run would train on the {d.name} "
            "corpus instead",
            "Add data=text_files to train on these files",
        )
    _require(
        d.format in DATA_FORMATS,
        "data.format",
        f"unknown format {d.format!r}",
        f"Choose one of {DATA_FORMATS}",
    )
    if d.format == "chat":
        _require(
            d.name == "text_files",
            "data.format",
            f"chat reads conversations from .jsonl/.parquet files, and data.name={d.name} has none",
            "Use data=text_files data.paths=[chats.jsonl]",
        )
        _require(
            bool(d.tokenizer) or m.name == "hf",
            "data.tokenizer",
            "data.format=chat needs a Hugging Face tokenizer with a chat template, and the "
            "byte-level one (data.tokenizer=null) has none",
            "Set data.tokenizer=<tokenizer directory>, or use model=hf (its own tokenizer)",
        )
        _require(bool(d.messages_field), "data.messages_field", "is empty", "Use e.g. messages")
    elif d.format == "preference":
        _check_preference_data(d)
    else:
        _require(bool(d.text_field), "data.text_field", "is empty", "Use e.g. text")
    _require(
        d.max_tokens >= 0,
        "data.max_tokens",
        f"must be >= 0, got {d.max_tokens}",
        "Use 0 for no cap",
    )
    if d.name == "synthetic":
        _require(
            d.synthetic_sequences >= 1,
            "data.synthetic_sequences",
            f"must be >= 1, got {d.synthetic_sequences}",
            "Use e.g. 4096",
        )


def _check_preference_data(d: Any) -> None:
    """data.format=preference: pairs read from files and packed whole, each side a document."""
    _require(
        d.name == "text_files",
        "data.format",
        f"preference reads prompt/chosen/rejected rows from .jsonl/.parquet files, and "
        f"data.name={d.name} has none",
        "Use data=preference data.paths=[pairs.jsonl]",
    )
    _require(
        not d.prepared,
        "data.prepared",
        "composer3d-prepare does not prepare preference pairs yet (they are packed whole, in "
        "memory)",
        "Leave data.prepared out with data.format=preference",
    )
    _require(
        d.document_masking,
        "data.document_masking",
        "false would let a pair's rejected completion attend to its chosen one (both sides are "
        "documents of one row)",
        "Use data.document_masking=true with data.format=preference",
    )
