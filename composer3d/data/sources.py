"""Corpora: where the documents come from and how each file format is read.

``stdlib`` (the running interpreter's own standard library sources: nothing to download),
``text_files`` (local .txt/.jsonl/.parquet through Hugging Face datasets); ``synthetic`` (seeded
random tokens) needs no source (see :mod:`composer3d.data.corpus`). ``data.format=chat`` reads
conversations (a ``messages`` list of {role, content}) from .jsonl/.parquet rows and trains only on
the assistant replies (supervised fine-tuning); ``data.format=preference`` reads prompt, chosen
and rejected text from each row (preference tuning, packed in :mod:`composer3d.data.preference`).
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from composer3d.errors import ConfigError


def stdlib_documents() -> Iterator[str]:
    """Source files of the running interpreter's standard library, in a fixed (sorted by path)
    order."""
    for path in _python_files(Path(sysconfig.get_paths()["stdlib"])):
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _python_files(directory: Path) -> Iterator[Path]:
    """The ``*.py`` files under ``directory`` in sorted path order, found as they are read: depth
    first, each directory's entries by name. A run reads only the first few (``data.max_tokens``),
    and sorting every path first walked all of site-packages too (23,000 files with torch installed:
    2–4 s on every rank of every run)."""
    for entry in sorted(os.scandir(directory), key=lambda entry: entry.name):
        if entry.is_dir():
            if entry.name not in (
                "site-packages",
                "__pycache__",
            ):  # installed packages are not the stdlib
                yield from _python_files(Path(entry.path))
        elif entry.name.endswith(".py"):
            yield Path(entry.path)


# file suffix → kind of corpus file (the Hugging Face datasets builder that reads it)
FILE_KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
KIND_NAMES = {"text": ".txt", "json": ".jsonl", "parquet": ".parquet"}


def expand(paths: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in paths:
        if os.path.isdir(pattern):
            matches = [
                str(p)
                for p in sorted(Path(pattern).rglob("*"))
                if p.suffix in FILE_KINDS and p.is_file()
            ]
        else:
            matches = sorted(glob.glob(pattern))
        if not matches:
            raise ConfigError(
                f"data.paths: {pattern!r} matches no file. Give existing .txt/.jsonl/.parquet "
                "files, directories holding them, or globs"
            )
        for match in matches:
            if Path(match).suffix not in FILE_KINDS:
                raise ConfigError(
                    f"data.paths: {match!r} is not a .txt, .jsonl/.json or .parquet file. Give "
                    "only those (a directory contributes only those)"
                )
        files.extend(matches)
    kinds = [
        name
        for kind, name in KIND_NAMES.items()
        if any(FILE_KINDS[Path(f).suffix] == kind for f in files)
    ]
    if len(kinds) > 1:
        raise ConfigError(f"data.paths: mixes {' and '.join(kinds)} files. Use one kind per run")
    return files


def file_kind(files: list[str]) -> str:
    return FILE_KINDS[Path(files[0]).suffix]


# How much of each file the up-front check reads: enough to catch a wrong format or field in
# seconds; what lies beyond is checked as the run reads it (the same errors, raised on every rank
# alike before any collective).
SNIFF_BYTES = 1 << 16
SNIFF_ROWS = 100


def check_files(paths: list[str], field: str, key: str) -> None:
    """Refuse, before any worker starts, corpus files that cannot be read as their kind or lack
    ``field``: empty corpora, non-UTF-8 text, malformed JSON lines, unreadable parquet, a missing or
    non-text field."""
    files = expand(paths)
    if all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError(
            f"data.paths: every file is empty ({', '.join(files[:3])}). Give files that hold text"
        )
    kind = file_kind(files)
    wanted = "text" if key == "data.text_field" else "list of messages"
    for file in files:
        if kind == "text":
            _check_utf8(file)
        elif kind == "json":
            _check_json_rows(file, field, key, wanted)
        else:
            _check_parquet_schema(file, field, key, wanted)


def _check_utf8(file: str) -> None:
    with open(file, "rb") as f:
        head = f.read(SNIFF_BYTES)
    try:
        # a character cut at the end is fine
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"data.paths: {file} is not UTF-8 text (byte {error.start}: {error.reason}). Give "
            "UTF-8 text files (re-encode with iconv), or leave binary files out"
        ) from None


def _json_row(line: bytes, where: str) -> dict:
    """One JSON Lines row, or the ConfigError saying what is wrong with it at ``where``."""
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"data.paths: {where} is not valid JSON ({error}). Give JSON Lines: one JSON object "
            "per line"
        ) from None
    if not isinstance(row, dict):
        raise ConfigError(
            f"data.paths: {where} holds {type(row).__name__}, not a JSON object. Give JSON Lines: "
            "one JSON object per line"
        )
    return row


def _json_lines(file: str, limit: int | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, row) of a JSON Lines file, the first ``limit`` lines (all: None), blank lines
    skipped; a line that is not a JSON object is a ConfigError naming its number."""
    with open(file, "rb") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and number > limit:
                return
            if line.strip():
                yield number, _json_row(line, f"{file} line {number}")


def _check_json_rows(file: str, field: str, key: str, wanted: str) -> None:
    for number, row in _json_lines(file, SNIFF_ROWS):
        if field not in row:
            raise ConfigError(
                f"{key}: {field!r} is not a field of {file} line {number} (fields: {sorted(row)}). "
                f"Set {key} to the field that holds the {wanted}"
            )
        _check_value_type(row[field], file, f"line {number}", key, wanted)


def _parquet_schema(file: str):
    """The file's parquet schema, or one line saying it cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(file)
    except (OSError, pa.ArrowException) as error:
        raise ConfigError(
            f"data.paths: {file} is not a readable parquet file ({_first_line(error)}). Give "
            "intact .parquet files"
        ) from None


def _check_parquet_schema(file: str, field: str, key: str, wanted: str) -> None:
    import pyarrow as pa

    schema = _parquet_schema(file)
    if field not in schema.names:
        raise ConfigError(
            f"{key}: {field!r} is not a field of {file} (fields: {schema.names}). Set {key} to the "
            f"field that holds the {wanted}"
        )
    column = schema.field(field).type
    is_text = pa.types.is_string(column) or pa.types.is_large_string(column)
    is_list = pa.types.is_list(column) or pa.types.is_large_list(column)
    if (wanted == "text" and not is_text) or (wanted != "text" and not is_list):
        raise ConfigError(
            f"{key}: the column {field!r} of {file} holds {column}, not {wanted}. Set {key} to the "
            f"column that holds the {wanted}"
        )


def _check_value_type(value, file: str, where: str, key: str, wanted: str) -> None:
    if (wanted == "text" and not isinstance(value, str)) or (
        wanted != "text" and not isinstance(value, list)
    ):
        raise ConfigError(
            f"{key}: {file} {where} holds {type(value).__name__} {str(value)[:80]!r}, not "
            f"{wanted}. Set {key} to the field that holds the {wanted}"
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


@contextlib.contextmanager
def _datasets_quiet(datasets):
    verbosity, bars = datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars:
            datasets.enable_progress_bars()


def _load_rows(files: list[str], field: str, key: str):
    """The column ``field`` of every row of ``files`` (one kind), in file order; ConfigError naming
    ``key``."""
    import datasets

    builder = file_kind(files)
    # A .txt file is one document (not one per line); a .jsonl line or a parquet row is one
    # document.
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        # its progress bars and its own log of a failure we report in one line
        with _datasets_quiet(datasets):
            dataset = datasets.load_dataset(
                builder, data_files=files, split="train", keep_in_memory=True, **options
            )
    # datasets wraps the reader's error (arrow, JSON, UTF-8) in its own types
    except Exception as error:
        # arrow's row count and cause mislead: the first line Python's JSON refuses, named
        if builder == "json":
            for file in files:
                for _ in _json_lines(file):
                    pass
        cause = error.__cause__ or error.__context__ or error
        raise ConfigError(
            f"data.paths: reading {', '.join(files[:3])}{' …' if len(files) > 3 else ''} failed "
            f"({type(cause).__name__}: {_first_line(cause)}). Give intact UTF-8 text, JSON Lines "
            "or parquet files"
        ) from None
    if field not in dataset.column_names:
        raise ConfigError(
            f"{key}: {field!r} is not a field of {files[0]} (fields: {dataset.column_names}). Set "
            f"{key} to the field that holds it"
        )
    return dataset[field]


def text_file_documents(paths: list[str], text_field: str) -> Iterator[str]:
    """One document per .txt file, or per .jsonl/.parquet row (its ``text_field``)."""
    files = expand(paths)
    field = "text" if file_kind(files) == "text" else text_field
    for row, text in enumerate(_load_rows(files, field, "data.text_field")):
        yield document(text, f"row {row} of {paths}")


def chat_conversations(paths: list[str], messages_field: str) -> Iterator[list[dict]]:
    """One conversation per .jsonl/.parquet row: its ``messages_field``, a list of {role, content}
    (checked)."""
    files = expand(paths)
    if file_kind(files) == "text":
        raise ConfigError(
            "data.format: chat reads a list of messages from each .jsonl or .parquet row, but "
            f"data.paths gives .txt files ({files[0]}). Give .jsonl/.parquet files, or use "
            "data.format=text"
        )
    for row, messages in enumerate(_load_rows(files, messages_field, "data.messages_field")):
        yield conversation(messages, f"row {row} of {paths}")


PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
_FORMATS = (
    "rows in TRL's preference format: text in each of prompt, chosen and rejected, or "
    "conversations (lists of {role, content} messages: the prompt's, and each reply's)"
)


def check_preference_files(paths: list[str]) -> bool:
    """Refuse, before any worker starts, files that are not .jsonl/.parquet or whose first rows do
    not hold TRL's standard or conversational preference format; returns whether they hold
    conversations (rendered by the tokenizer's chat template)."""
    files = expand(paths)
    kind = file_kind(files)
    if kind == "text":
        raise ConfigError(
            "data.format: preference reads prompt, chosen and rejected from each .jsonl or "
            f".parquet row, and data.paths gives .txt files ({files[0]}). Give .jsonl/.parquet "
            "files"
        )
    forms = set()
    for file in files:
        if kind == "json":
            for number, row in _json_lines(file, SNIFF_ROWS):
                forms.add(_preference_form(row, f"{file} line {number}"))
        else:
            forms.add(_preference_columns_form(file))
    if len(forms) > 1:
        raise ConfigError(
            f"data.paths: {paths} mix text and conversational preference rows. Give files of one "
            "form"
        )
    return forms == {"conversational"}


# TRL's columns that change how a row renders, which composer3d does not read yet
_UNREAD_COLUMNS = ("tools", "chat_template_kwargs", "images")


def _refuse_unread(columns, where: str) -> None:
    unread = [c for c in _UNREAD_COLUMNS if c in columns]
    if unread:
        raise ConfigError(
            f"data.format: {where} has {unread}, which would change how TRL renders its rows and "
            "which composer3d does not read yet. Drop those columns (or render the rows to text "
            "first)"
        )


def _preference_form(row: dict, where: str) -> str:
    """``row``'s form, text or conversational (ConfigError if neither, or mixed)."""
    _refuse_unread([k for k, v in row.items() if v is not None], where)
    values = [row.get(column) for column in PREFERENCE_COLUMNS]
    if all(isinstance(v, str) for v in values):
        return "text"
    if all(isinstance(v, list) for v in values):
        for column, messages in zip(PREFERENCE_COLUMNS, values):
            conversation(messages, f"{where} ({column!r})", "data.format")
        return "conversational"
    raise ConfigError(
        f"data.format: {where} does not hold {_FORMATS} (fields: {sorted(row)}, "
        f"{', '.join(f'{c}: {type(v).__name__}' for c, v in zip(PREFERENCE_COLUMNS, values))})"
    )


def _preference_columns_form(file: str) -> str:
    import pyarrow as pa

    schema = _parquet_schema(file)
    _refuse_unread(schema.names, file)
    kinds = [schema.field(c).type if c in schema.names else None for c in PREFERENCE_COLUMNS]
    if all(k is not None and (pa.types.is_string(k) or pa.types.is_large_string(k)) for k in kinds):
        return "text"
    if all(k is not None and (pa.types.is_list(k) or pa.types.is_large_list(k)) for k in kinds):
        return "conversational"
    raise ConfigError(f"data.format: {file} does not hold {_FORMATS} (columns: {schema.names})")


def preference_rows(paths: list[str]) -> Iterator[tuple]:
    """(prompt, chosen, rejected) of every row of ``paths``, in file order (each value checked):
    texts, or conversations."""
    files = expand(paths)
    columns = [_load_rows(files, column, "data.format") for column in PREFERENCE_COLUMNS]
    for number, row in enumerate(zip(*columns)):
        where = f"row {number} of {paths}"
        if _preference_form(dict(zip(PREFERENCE_COLUMNS, row)), where) == "text":
            yield row
        else:
            yield tuple(
                conversation(m, f"{where} ({c!r})", "data.format")
                for c, m in zip(PREFERENCE_COLUMNS, row)
            )


def conversation(messages, where: str, key: str = "data.messages_field") -> list[dict]:
    """A row's messages, checked to be a list of {role, content}, without the keys it does not
    fill; ConfigError naming ``key``."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        fix = (
            "Point data.messages_field at such a list"
            if key == "data.messages_field"
            else "Give lists of such messages"
        )
        raise ConfigError(
            f"{key}: {where} holds {str(messages)[:200]!r}, not a list of {{role, content}} "
            f"messages. {fix}"
        )
    # Rows of one file share a schema: drop the keys another message filled and this one lacks
    # (None), so the template's `is defined` tests see each message as it was written.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def document(text, where: str) -> str:
    if not isinstance(text, str):
        raise ConfigError(
            f"data.text_field: {where} holds {type(text).__name__} {str(text)[:80]!r}, not text. "
            "Set data.text_field to the field that holds the text"
        )
    return text


# -------------------------------------------------------- the corpus in pieces (composer3d-prepare)


@dataclass(frozen=True)
class Piece:
    """A part of the corpus that one worker reads, in corpus order: whole .txt files, the lines of a
    .jsonl file that start in the byte range [start, stop), or row groups of a parquet file."""

    files: tuple[str, ...]
    start: int = 0
    stop: int = 0
    row_groups: tuple[int, ...] = ()


def corpus_pieces(files: list[str], piece_bytes: int) -> list[Piece]:
    """``files`` (one kind, from :func:`expand`) cut into pieces of about ``piece_bytes``, never
    inside a row."""
    kind, pieces = file_kind(files), []
    if kind == "text":  # one document per file: group whole files
        group, size = [], 0
        for file in files:
            group.append(file)
            size += os.path.getsize(file)
            if size >= piece_bytes:
                pieces.append(Piece(tuple(group)))
                group, size = [], 0
        return pieces + ([Piece(tuple(group))] if group else [])
    for file in files:
        if kind == "json":
            cuts = _line_starts(file, piece_bytes)
            pieces += [Piece((file,), a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        else:
            import pyarrow.parquet as pq

            metadata = pq.ParquetFile(file).metadata
            group, size = [], 0
            for index in range(metadata.num_row_groups):
                group.append(index)
                size += metadata.row_group(index).total_byte_size
                if size >= piece_bytes:
                    pieces.append(Piece((file,), row_groups=tuple(group)))
                    group, size = [], 0
            if group:
                pieces.append(Piece((file,), row_groups=tuple(group)))
    return pieces


def _line_starts(file: str, piece_bytes: int) -> list[int]:
    """Byte offsets at which to cut ``file``: 0, a line start after every ``piece_bytes``, and its
    size."""
    size, cuts = os.path.getsize(file), [0]
    with open(file, "rb") as f:
        while cuts[-1] + piece_bytes < size:
            f.seek(cuts[-1] + piece_bytes)
            f.readline()  # to the start of the next line
            cuts.append(min(f.tell(), size))
    return cuts + [size] if cuts[-1] < size else cuts


def piece_rows(piece: Piece, field: str, key: str) -> Iterator[tuple[object, str]]:
    """(value of ``field``, where it was read) for each row of the piece, read as :func:`_load_rows`
    reads it: a .txt file whole (universal newlines), a .jsonl line's field, a parquet row's
    column."""
    kind = file_kind(list(piece.files))
    if kind == "text":
        for file in piece.files:
            try:
                with open(file, encoding="utf-8") as f:
                    yield f.read(), file
            except UnicodeDecodeError as error:
                raise ConfigError(
                    f"data.paths: {file} is not UTF-8 text (byte {error.start}: {error.reason}). "
                    "Give UTF-8 text files (re-encode with iconv), or leave binary files out"
                ) from None
    elif kind == "json":
        file = piece.files[0]
        with open(file, "rb") as f:
            f.seek(piece.start)
            position = piece.start
            while position < piece.stop:
                line = f.readline()
                where = f"{file} byte {position}"
                position += len(line)
                if not line.strip():
                    continue
                yield _json_row(line, where).get(field), where
    else:
        import pyarrow.parquet as pq

        file = piece.files[0]
        parquet = pq.ParquetFile(file)
        if field not in parquet.schema_arrow.names:
            raise ConfigError(
                f"{key}: {field!r} is not a field of {file} (fields: "
                f"{parquet.schema_arrow.names}). Set {key} to the field that holds it"
            )
        row = sum(parquet.metadata.row_group(i).num_rows for i in range(piece.row_groups[0]))
        for batch in parquet.iter_batches(row_groups=list(piece.row_groups), columns=[field]):
            for value in batch.column(0).to_pylist():
                yield value, f"{file} row {row}"
                row += 1
