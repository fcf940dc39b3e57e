"""Corpora, tokenizers, packing with document boundaries, and the global batch order.

The global batch order is a function of the seed alone: step s uses sequences [s·B, (s+1)·B) of an endless
stream of seeded permutations of the packed corpus, and data-parallel rank r takes its contiguous slice of
that global batch. The loader's only state is how many sequences the whole job has consumed, so it does not
depend on the layout and a run can resume under a different number of data-parallel ranks. Each batch also carries
the whole global batch's count of trained targets (every rank knows all its rows), and :class:`BatchPrefetcher`
builds the batches ahead on a background thread.

Corpora: ``stdlib`` (the running interpreter's own standard library sources: nothing to download),
``text_files`` (local .txt/.jsonl/.parquet through Hugging Face datasets), ``synthetic`` (seeded random tokens).
``data.format=chat`` reads conversations (a ``messages`` list of {role, content}) from .jsonl/.parquet rows and
trains only on the assistant replies (supervised fine-tuning).

Packing: documents (or conversations) are tokenized, joined into one stream and cut into windows of
seq_len + 1 tokens. Next to the tokens the stream keeps, per token, whether it starts a document and whether it
may be a target (chat: assistant tokens only). A window becomes a :class:`Batch` row: inputs, targets (-100
where no loss is taken) and position_ids. With ``data.document_masking`` the positions restart at 0 at each
document's first token and no loss is taken on predicting a document's first token from the previous
document. Hugging Face models see the restarts in ``position_ids`` and, through transformers' mask utilities
(a position jump other than +1 starts a new packed sequence), attend only within each document; the native
Llama ignores ``position_ids`` (its attention stays causal over the whole window), so it gets the loss masking
only.
"""

from __future__ import annotations

import glob
import logging
import os
import queue
import sysconfig
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from composer3d.errors import ConfigError

log = logging.getLogger("composer3d")

IGNORE_INDEX = -100  # target value that takes no loss (F.cross_entropy's default ignore_index)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token."""

    vocab_size = 257
    eos_id = 256
    has_chat_template = False

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloaded).

    ``key`` is the config key the directory came from (``data.tokenizer``, or ``model.path`` when the tokenizer
    is the Hugging Face model's own), named in errors.
    """

    def __init__(self, path: str, key: str = "data.tokenizer"):
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ConfigError(f"{key}: {path!r} is not a directory. Point it at a local directory holding "
                              "tokenizer.json (or the files AutoTokenizer.save_pretrained writes)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}: no tokenizer could be loaded from {path!r} ({error}). Give a directory "
                              "holding tokenizer.json, or set data.tokenizer to one") from error
        # A model directory without tokenizer files still "loads" (an empty vocabulary that encodes text to
        # nothing): refuse it rather than train on end-of-document tokens alone.
        if not self.tokenizer.encode("The quick brown fox.", add_special_tokens=False):
            raise ConfigError(f"{key}: {path!r} holds no usable tokenizer (it encodes text to no tokens; "
                              "tokenizer.json or the vocabulary files are missing). Give a directory holding "
                              "tokenizer.json, or set data.tokenizer to one")
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ConfigError(f"{key}: the tokenizer in {path!r} has no eos token, needed to separate "
                              "packed documents. Set eos_token in its tokenizer_config.json")
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` without added special tokens (no bos/eos; those in the text itself are kept)."""
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as error:  # jinja's own errors (a template that raises, or expects other fields)
            raise ConfigError(f"data.format: the tokenizer's chat template failed on the messages "
                              f"{str(messages)[:300]} ({type(error).__name__}: {error}). Fix the rows or give "
                              "data.tokenizer a template that accepts them") from error

    def encode_chat(self, messages: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """A conversation through the chat template: (token ids, mask of the assistant replies' tokens).

        Each assistant message's span is found by rendering prefixes: the template of ``messages[:i]`` with the
        generation prompt ends where reply i starts, the template of ``messages[:i+1]`` ends where it stops (its
        end-of-turn tokens included, so the model learns to stop). Those renderings must be prefixes of the whole
        conversation's (ConfigError otherwise). The text is then tokenized piece by piece (prompt, reply,
        prompt, …), so every span boundary is a token boundary: tokenizing it whole could merge the generation
        prompt's last characters with the reply's first ones (a trailing space with the first word, in
        byte-level BPE), and the reply would then start mid-token.
        """
        full = self.render_chat(messages)
        spans, end = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, upto = self.render_chat(messages[:i], add_generation_prompt=True), self.render_chat(messages[:i + 1])
            if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= end):
                raise ConfigError(
                    "data.format: the tokenizer's chat template is not prefix-stable: rendering the first "
                    f"{i} message(s) with the generation prompt, then the first {i + 1}, does not give successive "
                    "prefixes of the whole conversation, so the assistant replies cannot be located (templates "
                    "that rewrite earlier turns, e.g. drop past reasoning, do this). Give data.tokenizer a "
                    "directory whose chat_template renders a conversation's first messages as a prefix of the "
                    f"whole.\nprefix: {prompt[-200:]!r}\nwhole: {full[:len(prompt) + 200][-400:]!r}")
            spans.append((len(prompt), len(upto)))
            end = len(upto)
        pieces, trainable, position = [], [], 0
        for start, stop in [*spans, (len(full), len(full))]:
            for text, train in ((full[position:start], False), (full[start:stop], True)):
                if text:
                    pieces.append(self.encode(text))
                    trainable.append(torch.full((pieces[-1].numel(),), train))
            position = stop
        if not pieces:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bool)
        return torch.cat(pieces), torch.cat(trainable)


def tokenizer_source(data_cfg, model_cfg=None) -> tuple[str, str] | None:
    """(directory, config key) of the Hugging Face tokenizer to use; None for the byte-level one.

    ``data.tokenizer`` when set; otherwise, for ``model=hf``, the model's own directory (``model.path``).
    """
    if data_cfg.tokenizer:
        return str(data_cfg.tokenizer), "data.tokenizer"
    if model_cfg is not None and getattr(model_cfg, "name", None) == "hf" and getattr(model_cfg, "path", None):
        return str(model_cfg.path), "model.path"
    return None


def build_tokenizer(data_cfg, model_cfg=None) -> ByteTokenizer | HFTokenizer:
    source = tokenizer_source(data_cfg, model_cfg)
    return HFTokenizer(*source) if source else ByteTokenizer()


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


def _expand(paths: list[str]) -> list[str]:
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
    files = _expand(paths)
    if file_kind(files) == "text":
        yield from _load_rows(files, "text", "data.text_field")
    else:
        yield from _load_rows(files, text_field, "data.text_field")


def chat_conversations(paths: list[str], messages_field: str) -> Iterator[list[dict]]:
    """One conversation per .jsonl/.parquet row: its ``messages_field``, a list of {role, content} (checked)."""
    files = _expand(paths)
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


@dataclass
class TokenStream:
    """Documents joined into one stream of token ids, with per-token flags.

    ``starts[i]``: token i is the first of a document (or conversation). ``trainable[i]``: token i may be a
    target (chat: it belongs to an assistant reply); None means every token may.
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    trainable: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.numel()


def _join(pieces: Iterable[tuple[torch.Tensor, torch.Tensor | None]], max_tokens: int, chat: bool) -> TokenStream:
    """Non-empty pieces (ids, trainable mask or None) joined, each starting a document, up to ``max_tokens``."""
    tokens, starts, trainable, total = [], [], [], 0
    for ids, mask in pieces:
        if ids.numel() == 0:
            continue
        tokens.append(ids)
        first = torch.zeros(ids.numel(), dtype=torch.bool)
        first[0] = True
        starts.append(first)
        if chat:
            trainable.append(mask)
        total += ids.numel()
        if max_tokens and total >= max_tokens:
            break
    cap = max_tokens or None
    if not tokens:
        empty = torch.empty(0, dtype=torch.int64)
        return TokenStream(empty, empty.bool(), empty.bool() if chat else None)
    return TokenStream(torch.cat(tokens)[:cap], torch.cat(starts)[:cap], torch.cat(trainable)[:cap] if chat else None)


def document_stream(documents: Iterator[str], tokenizer, max_tokens: int) -> TokenStream:
    """Non-empty documents tokenized and joined, each followed by the end-of-document token, up to ``max_tokens``."""
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int64)
    return _join(((torch.cat([tokenizer.encode(doc), eos]), None) for doc in documents if doc), max_tokens, chat=False)


def token_stream(documents: Iterator[str], tokenizer, max_tokens: int) -> torch.Tensor:
    """The token ids of :func:`document_stream`."""
    return document_stream(documents, tokenizer, max_tokens).tokens


def conversation_stream(conversations: Iterator[list[dict]], tokenizer: HFTokenizer, max_tokens: int) -> TokenStream:
    """Conversations through the chat template, joined; only assistant reply tokens are trainable.

    No end-of-document token is added: the template ends each turn itself. Conversations without any
    assistant token would add nothing to learn, and are left out.
    """
    skipped = 0

    def encoded():
        nonlocal skipped
        for messages in conversations:
            ids, mask = tokenizer.encode_chat(messages)
            if not mask.any():
                skipped += 1
                continue
            yield ids, mask

    stream = _join(encoded(), max_tokens, chat=True)
    if skipped:
        log.info("data: %d conversation(s) without assistant tokens left out", skipped)
    return stream


def _windows(values: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    return values[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def packed_sequences(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets), as rows."""
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ConfigError(f"train.seq_len: the corpus has {tokens.numel()} tokens, too few for one sequence of "
                          f"{seq_len}. Lower train.seq_len or give more data")
    return _windows(tokens, n, seq_len)


@dataclass
class Batch:
    """Model inputs and loss targets for a batch of packed windows, all (batch, seq_len) int64.

    ``targets`` holds the next token, or IGNORE_INDEX (-100) where no loss is taken. ``position_ids`` restart at 0
    at each document start when document masking is on (HF models then attend within documents only; the native
    Llama ignores them), else they count 0..seq_len-1 along each row. ``global_targets``: targets that take a loss
    in the whole global batch (every data-parallel rank's rows), when the loader filled it in.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    global_targets: int | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in (self.inputs, self.targets, self.position_ids)),
                     self.global_targets)

    def pin_memory(self) -> Batch:
        return Batch(self.inputs.pin_memory(), self.targets.pin_memory(), self.position_ids.pin_memory(),
                     self.global_targets)


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Positions that count from 0 at the row start and at every True of ``starts`` (batch, seq_len)."""
    index = torch.arange(starts.shape[1]).expand(starts.shape)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values
    return index - last_start


@dataclass
class PackedSequences:
    """All packed training windows, identical on every rank: ``tokens`` is (num_sequences, seq_len + 1).

    ``starts`` / ``trainable`` are the stream's flags cut into the same windows (None: no document boundaries
    known, e.g. synthetic data / every token is a target).
    """

    tokens: torch.Tensor
    starts: torch.Tensor | None = None
    trainable: torch.Tensor | None = None
    document_masking: bool = True

    @classmethod
    def from_stream(cls, stream: TokenStream, seq_len: int, document_masking: bool) -> PackedSequences:
        tokens = packed_sequences(stream.tokens, seq_len)
        n = tokens.shape[0]
        trainable = None if stream.trainable is None else _windows(stream.trainable, n, seq_len)
        return cls(tokens, _windows(stream.starts, n, seq_len), trainable, document_masking)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def _trained(self, rows: list[int]) -> torch.Tensor | None:
        """Which targets (tokens[1:]) of the rows take a loss, (len(rows), seq_len) bool; None: all of them."""
        trained = None
        if self.trainable is not None:  # chat: only the assistant replies' tokens are targets
            trained = self.trainable[rows][:, 1:]
        if self.document_masking and self.starts is not None:
            # the previous document's last token (its eos) predicts nothing
            not_first = ~self.starts[rows][:, 1:]
            trained = not_first if trained is None else trained & not_first
        return trained

    def target_count(self, rows: list[int]) -> int:
        """How many targets of :meth:`batch` (rows) take a loss, from the masks alone (no Batch built)."""
        trained = self._trained(rows)
        return len(rows) * (self.tokens.shape[1] - 1) if trained is None else int(trained.sum())

    def batch(self, rows: list[int]) -> Batch:
        """The rows as a Batch: inputs are tokens[:-1], targets tokens[1:] with IGNORE_INDEX where masked."""
        tokens = self.tokens[rows]
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        trained = self._trained(rows)
        if trained is not None:
            targets[~trained] = IGNORE_INDEX
        if self.document_masking and self.starts is not None:
            positions = document_positions(self.starts[rows][:, :-1])
        else:
            positions = torch.arange(inputs.shape[1]).expand(inputs.shape).clone()
        return Batch(inputs, targets, positions)


def check_sources(data_cfg, model_vocab_size: int, model_cfg=None) -> ByteTokenizer | HFTokenizer | None:
    """Fail fast (ConfigError) on missing files or a tokenizer the model cannot embed; returns the tokenizer."""
    if data_cfg.name == "synthetic":
        return None
    if data_cfg.name == "text_files":
        _expand(list(data_cfg.paths))
    tokenizer = build_tokenizer(data_cfg, model_cfg)
    if getattr(data_cfg, "format", "text") == "chat" and not tokenizer.has_chat_template:
        source = tokenizer_source(data_cfg, model_cfg)
        where = f"the tokenizer in {source[1]}={source[0]!r} has none" if source else "the byte-level tokenizer has none"
        raise ConfigError(f"data.tokenizer: data.format=chat renders conversations with the tokenizer's chat "
                          f"template, and {where}. Set data.tokenizer to a Hugging Face tokenizer directory whose "
                          "tokenizer_config.json has a chat_template")
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model.vocab_size: {model_vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size}). Use model.vocab_size>={tokenizer.vocab_size}")
    return tokenizer


def build_sequences(data_cfg, model_vocab_size: int, seq_len: int, seed: int, model_cfg=None) -> PackedSequences:
    """All packed training sequences, (num_sequences, seq_len + 1) windows, identical on every rank.

    ``model_cfg``: the run's model config; a ``model=hf`` run without ``data.tokenizer`` uses its tokenizer.
    """
    document_masking = bool(getattr(data_cfg, "document_masking", True))
    if data_cfg.name == "synthetic":
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, model_vocab_size, (data_cfg.synthetic_sequences, seq_len + 1), generator=generator)
        return PackedSequences(tokens, document_masking=document_masking)
    tokenizer = check_sources(data_cfg, model_vocab_size, model_cfg)
    if getattr(data_cfg, "format", "text") == "chat":
        conversations = chat_conversations(list(data_cfg.paths), getattr(data_cfg, "messages_field", "messages"))
        stream = conversation_stream(conversations, tokenizer, data_cfg.max_tokens)
    else:
        if data_cfg.name == "stdlib":
            documents = stdlib_documents()
        else:
            documents = text_file_documents(list(data_cfg.paths), data_cfg.text_field)
        stream = document_stream(documents, tokenizer, data_cfg.max_tokens)
    sequences = PackedSequences.from_stream(stream, seq_len, document_masking)
    log.info("data: %s (%s), %d sequences of %d tokens, %d documents", data_cfg.name, getattr(data_cfg, "format", "text"),
             len(sequences), seq_len, int(stream.starts.sum()))
    return sequences


class GlobalBatchLoader:
    """Yields this data-parallel rank's slice of each global batch; resumable from a layout-free position."""

    def __init__(self, sequences: PackedSequences | torch.Tensor, global_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int):
        if isinstance(sequences, torch.Tensor):  # bare token windows: no documents known, every target counts
            sequences = PackedSequences(sequences)
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

    def next_batch(self) -> Batch:
        """This rank's slice of the next global batch, with the global batch's count of trained targets.

        Every rank knows the whole global batch's rows, so the count needs no collective (nor a host sync).
        """
        rows = [self._index(p) for p in range(self.consumed, self.consumed + self.global_batch_size)]
        self.consumed += self.global_batch_size
        start = self.dp_rank * self.local_batch_size
        batch = self.sequences.batch(rows[start:start + self.local_batch_size])
        batch.global_targets = self.sequences.target_count(rows)
        return batch

    def state_dict(self) -> dict:
        return {"consumed_sequences": self.consumed, "num_sequences": len(self.sequences), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_sequences"] != len(self.sequences) or state["seed"] != self.seed:
            raise ValueError(f"data loader state is for {state['num_sequences']} sequences with seed {state['seed']}, "
                             f"but this run has {len(self.sequences)} with seed {self.seed}: the corpus, "
                             "train.seq_len or train.seed changed")
        self.consumed = state["consumed_sequences"]


class BatchPrefetcher:
    """A GlobalBatchLoader whose next batches are built ahead on a background thread, off the step's critical path.

    Same interface as the loader. On an accelerator the thread also pins each batch, so that next_batch()'s copy to
    the device is asynchronous (from pageable memory the host would wait for it). The thread starts at the first
    next_batch() and is from then on the only caller of the inner loader (whose epoch order cache is not
    thread-safe); state_dict() is the position after the batches handed out, not after those built ahead.
    """

    def __init__(self, loader: GlobalBatchLoader, device: torch.device | str, depth: int = 2):
        self.loader, self.device, self.depth = loader, torch.device(device), depth
        self._state = loader.state_dict()
        self._batches: queue.Queue | None = None
        self._stop: weakref.finalize | None = None

    def _start(self) -> None:
        # pin_memory() allocates through the thread's current device: give it the one the main thread uses
        device_index = None
        if self.device.type != "cpu":
            device_index = self.device.index if self.device.index is not None else torch.accelerator.current_device_index()
        self._batches, stop = queue.Queue(self.depth), threading.Event()
        thread = threading.Thread(target=_prefetch, args=(self.loader, self._batches, stop, device_index),
                                  name="composer3d-prefetch", daemon=True)
        thread.start()
        # also runs when the prefetcher is garbage-collected or the interpreter exits; a second call does nothing
        self._stop = weakref.finalize(self, _stop_prefetch, thread, self._batches, stop)

    def next_batch(self) -> Batch:
        if self._batches is None:
            self._start()
        batch, state = self._batches.get()
        if isinstance(batch, BaseException):
            self.close()  # the thread has ended; a later call starts again after the batches handed out
            raise batch
        self._state = state
        return batch if self.device.type == "cpu" else batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stops the thread (if running); the inner loader is left at the position of the batches handed out."""
        if self._stop is not None:
            self._stop()
        self._batches = None
        self.loader.load_state_dict(self._state)

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()  # a running thread has built batches from the old position
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()


def _prefetch(loader: GlobalBatchLoader, batches: queue.Queue, stop: threading.Event, device_index: int | None):
    """The prefetch thread: queues (batch, loader state after it) until stopped; an error is queued and ends it."""
    try:
        if device_index is not None:
            torch.accelerator.set_device_index(device_index)
        while not stop.is_set():
            batch = loader.next_batch()
            batches.put((batch if device_index is None else batch.pin_memory(), loader.state_dict()))
    except BaseException as error:  # re-raised in the main thread by next_batch()
        batches.put((error, None))


def _stop_prefetch(thread: threading.Thread, batches: queue.Queue, stop: threading.Event) -> None:
    stop.set()
    while True:  # emptying the queue frees a put() blocked on it; the thread then sees stop and ends
        try:
            batches.get_nowait()
        except queue.Empty:
            break
    if thread is not threading.current_thread():  # (a garbage collection may run on the thread itself)
        thread.join()
