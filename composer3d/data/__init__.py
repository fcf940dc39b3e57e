"""Corpora, tokenizers, packing with document boundaries, and the global batch order.

One concern per module, each importing only those listed after it (no cycles):

- :mod:`~composer3d.data.loader`: the global batch order (:class:`GlobalBatchLoader`) and its
  background prefetch (:class:`BatchPrefetcher`).
- :mod:`~composer3d.data.preparation`: ``composer3d-prepare``: a corpus tokenized once, by a process
  pool, into token shards with a manifest (:func:`prepare_corpus`), written atomically.
- :mod:`~composer3d.data.corpus`: the data config → packed sequences (:func:`build_sequences`), with
  the fail-fast checks of the sources and tokenizer (:func:`check_sources`) or of a prepared corpus
  (:func:`check_prepared`).
- :mod:`~composer3d.data.shards`: a prepared corpus on disk: its manifest and identity, and the
  packed windows served from read-only memory maps of its shards (:class:`PreparedSequences`).
- :mod:`~composer3d.data.windows`: an evaluation file cut into fixed token windows, dealt to
  data-parallel ranks.
- :mod:`~composer3d.data.preference`: preference pairs tokenized and packed whole into rows, each
  target marked with its pair and side (:class:`PreferenceSequences`).
- :mod:`~composer3d.data.packing`: a token stream cut into windows, and windows into :class:`Batch`
  rows (targets, loss masks, document positions).
- :mod:`~composer3d.data.streams`: documents or conversations tokenized into one
  :class:`TokenStream` with per-token document-start and trainable flags.
- :mod:`~composer3d.data.sources`: the corpora: file discovery and reading (.txt/.jsonl/.parquet,
  chat and preference rows), whole or in pieces.
- :mod:`~composer3d.data.tokenizers`: the byte-level and Hugging Face tokenizers (chat template
  spans).

Every public name is re-exported here: ``from composer3d.data import X``.
"""

from composer3d.data.corpus import build_sequences, check_prepared, check_sources
from composer3d.data.loader import BatchPrefetcher, GlobalBatchLoader
from composer3d.data.packing import (
    IGNORE_INDEX,
    Batch,
    PackedSequences,
    document_positions,
    packed_sequences,
)
from composer3d.data.preference import (
    PreferenceSequences,
    max_pairs_per_row,
    tokenize_pairs,
)
from composer3d.data.preparation import prepare_corpus
from composer3d.data.shards import (
    MANIFEST,
    PreparedSequences,
    check_same_corpus,
    corpus_identity,
    read_manifest,
    token_dtype,
)
from composer3d.data.sources import (
    FILE_KINDS,
    KIND_NAMES,
    chat_conversations,
    file_kind,
    preference_rows,
    stdlib_documents,
    text_file_documents,
)
from composer3d.data.streams import TokenStream, conversation_stream, document_stream, token_stream
from composer3d.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer, tokenizer_source
from composer3d.data.windows import eval_result, eval_windows, window_batches

__all__ = [
    "FILE_KINDS",
    "IGNORE_INDEX",
    "KIND_NAMES",
    "MANIFEST",
    "Batch",
    "BatchPrefetcher",
    "ByteTokenizer",
    "GlobalBatchLoader",
    "HFTokenizer",
    "PackedSequences",
    "PreferenceSequences",
    "PreparedSequences",
    "TokenStream",
    "build_sequences",
    "build_tokenizer",
    "chat_conversations",
    "check_prepared",
    "check_same_corpus",
    "check_sources",
    "conversation_stream",
    "corpus_identity",
    "document_positions",
    "document_stream",
    "eval_result",
    "eval_windows",
    "file_kind",
    "max_pairs_per_row",
    "packed_sequences",
    "preference_rows",
    "prepare_corpus",
    "read_manifest",
    "stdlib_documents",
    "text_file_documents",
    "token_dtype",
    "token_stream",
    "tokenize_pairs",
    "tokenizer_source",
    "window_batches",
]
