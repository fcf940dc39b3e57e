"""Corpora, tokenizers, packing, and the global batch order.

The global batch order is a function of the seed alone: step s uses sequences [s·B, (s+1)·B) of an endless
stream of seeded permutations of the packed corpus, and data-parallel rank r takes its contiguous slice of
that global batch. The loader's only state is how many sequences the whole job has consumed, so it does not
depend on the layout and a run can resume under a different number of data-parallel ranks.

Corpora: ``stdlib`` (the running interpreter's own standard library sources: nothing to download),
``text_files`` (local .txt/.jsonl through Hugging Face datasets), ``synthetic`` (seeded random tokens).
"""

from __future__ import annotations

import glob
import logging
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from composer3d.config import ConfigError

log = logging.getLogger("composer3d")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloaded)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ConfigError(f"data.tokenizer: {path!r} is not a directory. Point it at a local directory holding "
                              "tokenizer.json (or the files AutoTokenizer.save_pretrained writes)")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ConfigError(f"data.tokenizer: the tokenizer in {path!r} has no eos token, needed to separate "
                              "packed documents. Set eos_token in its tokenizer_config.json")

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def build_tokenizer(data_cfg) -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(data_cfg.tokenizer) if data_cfg.tokenizer else ByteTokenizer()


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


def _expand(paths: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in paths:
        if os.path.isdir(pattern):
            matches = [str(p) for p in sorted(Path(pattern).rglob("*")) if p.suffix in (".txt", ".jsonl", ".json")]
        else:
            matches = sorted(glob.glob(pattern))
        if not matches:
            raise ConfigError(f"data.paths: {pattern!r} matches no file. Give existing .txt/.jsonl files, "
                              "directories holding them, or globs")
        files.extend(matches)
    kinds = {Path(f).suffix == ".txt" for f in files}
    if len(kinds) > 1:
        raise ConfigError("data.paths: mixes .txt and .jsonl files. Use one kind per run")
    return files


def text_file_documents(paths: list[str], text_field: str) -> Iterator[str]:
    from datasets import load_dataset

    files = _expand(paths)
    builder = "text" if files[0].endswith(".txt") else "json"
    # A .txt file is one document (not one per line); a .jsonl line is one document.
    options = {"sample_by": "document"} if builder == "text" else {}
    dataset = load_dataset(builder, data_files=files, split="train", keep_in_memory=True, **options)
    field = "text" if builder == "text" else text_field
    if field not in dataset.column_names:
        raise ConfigError(f"data.text_field: {field!r} is not a field of {files[0]} (fields: {dataset.column_names})")
    yield from dataset[field]


def token_stream(documents: Iterator[str], tokenizer, max_tokens: int) -> torch.Tensor:
    """Non-empty documents tokenized and joined, each followed by the end-of-document token, up to ``max_tokens``."""
    pieces, total = [], 0
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int64)
    for doc in documents:
        if not doc:
            continue
        pieces += [tokenizer.encode(doc), eos]
        total += pieces[-2].numel() + 1
        if max_tokens and total >= max_tokens:
            break
    tokens = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    return tokens[:max_tokens] if max_tokens else tokens


def packed_sequences(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets), as rows."""
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ConfigError(f"train.seq_len: the corpus has {tokens.numel()} tokens, too few for one sequence of "
                          f"{seq_len}. Lower train.seq_len or give more data")
    return tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def check_sources(data_cfg, model_vocab_size: int) -> ByteTokenizer | HFTokenizer | None:
    """Fail fast (ConfigError) on missing files or a tokenizer the model cannot embed; returns the tokenizer."""
    if data_cfg.name == "synthetic":
        return None
    if data_cfg.name == "text_files":
        _expand(list(data_cfg.paths))
    tokenizer = build_tokenizer(data_cfg)
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model.vocab_size: {model_vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size}). Use model.vocab_size>={tokenizer.vocab_size}")
    return tokenizer


def build_sequences(data_cfg, model_vocab_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """All packed training sequences, shape (num_sequences, seq_len + 1), identical on every rank."""
    if data_cfg.name == "synthetic":
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, model_vocab_size, (data_cfg.synthetic_sequences, seq_len + 1), generator=generator)
    tokenizer = check_sources(data_cfg, model_vocab_size)
    if data_cfg.name == "stdlib":
        documents = stdlib_documents()
    else:
        documents = text_file_documents(list(data_cfg.paths), data_cfg.text_field)
    sequences = packed_sequences(token_stream(documents, tokenizer, data_cfg.max_tokens), seq_len)
    log.info("data: %s, %d sequences of %d tokens", data_cfg.name, sequences.shape[0], seq_len)
    return sequences


class GlobalBatchLoader:
    """Yields this data-parallel rank's slice of each global batch; resumable from a layout-free position."""

    def __init__(self, sequences: torch.Tensor, global_batch_size: int, dp_rank: int, dp_size: int, seed: int):
        self.sequences = sequences
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.consumed = 0  # sequences consumed by the whole job
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.sequences))
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.sequences), generator=generator)
        return int(self._order[offset])

    def next_batch(self) -> torch.Tensor:
        start = self.consumed + self.dp_rank * self.local_batch_size
        rows = [self._index(p) for p in range(start, start + self.local_batch_size)]
        self.consumed += self.global_batch_size
        return self.sequences[rows]

    def state_dict(self) -> dict:
        return {"consumed_sequences": self.consumed, "num_sequences": len(self.sequences), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_sequences"] != len(self.sequences) or state["seed"] != self.seed:
            raise ValueError(f"data loader state is for {state['num_sequences']} sequences with seed {state['seed']}, "
                             f"but this run has {len(self.sequences)} with seed {self.seed}: the corpus, "
                             "train.seq_len or train.seed changed")
        self.consumed = state["consumed_sequences"]
