"""The training corpus from the data config: the sources checked up front, then read, tokenized and
packed.

Synthetic data is seeded random windows; the other corpora go documents → token stream → packed
sequences, in memory on every rank; a corpus prepared once (``data.prepared``) is served from its
token shards instead; preference pairs are packed whole into rows (``preference``).
"""

from __future__ import annotations

import logging

import torch

from composer3d.config.schema import DataConfig, ModelConfig
from composer3d.data.packing import PackedSequences
from composer3d.data.preference import PreferenceSequences, tokenize_pairs
from composer3d.data.shards import (
    PreparedSequences,
    corpus_settings,
    source_entries,
    tokenizer_digest,
)
from composer3d.data.sources import (
    chat_conversations,
    check_files,
    check_preference_files,
    expand,
    preference_rows,
    stdlib_documents,
    text_file_documents,
)
from composer3d.data.streams import conversation_stream, document_stream
from composer3d.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    describe_tokenizer,
    tokenizer_source,
)
from composer3d.errors import ConfigError

log = logging.getLogger("composer3d")


def check_sources(
    data_cfg: DataConfig, model_vocab_size: int, model_cfg: ModelConfig | None = None
) -> ByteTokenizer | HFTokenizer | None:
    """Fail fast (ConfigError) on missing or unreadable files, or a tokenizer the model cannot
    embed; returns the tokenizer."""
    if data_cfg.name == "synthetic":
        return None
    templated = getattr(data_cfg, "format", "text") == "chat"  # rendered by the chat template
    if data_cfg.name == "text_files":
        if getattr(data_cfg, "format", "text") == "preference":
            templated = check_preference_files(list(data_cfg.paths))
        elif getattr(data_cfg, "format", "text") == "chat":
            check_files(
                list(data_cfg.paths),
                getattr(data_cfg, "messages_field", "messages"),
                "data.messages_field",
            )
        else:
            check_files(list(data_cfg.paths), data_cfg.text_field, "data.text_field")
    tokenizer = build_tokenizer(data_cfg, model_cfg)
    if templated and not tokenizer.has_chat_template:
        source = tokenizer_source(data_cfg, model_cfg)
        where = (
            f"the tokenizer in {source[1]}={source[0]!r} has none"
            if source
            else "the byte-level tokenizer has none"
        )
        raise ConfigError(
            f"data.tokenizer: data.format={data_cfg.format} renders conversations with the "
            f"tokenizer's chat template, and {where}. Set data.tokenizer to a Hugging Face "
            "tokenizer directory whose tokenizer_config.json has a chat_template"
        )
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size: {model_vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}). Use model.vocab_size>={tokenizer.vocab_size}"
        )
    return tokenizer


def check_prepared(
    data_cfg: DataConfig, model_vocab_size: int, seq_len: int, model_cfg: ModelConfig | None = None
) -> PreparedSequences:
    """The prepared corpus of ``data.prepared``, mapped and checked against this run (ConfigError):
    its format and field, a vocabulary the model embeds, and, where the config names them, the same
    tokenizer files and sources (path, size, mtime) it was prepared from. A run that names neither
    trains on the corpus as prepared."""
    sequences = PreparedSequences(
        data_cfg.prepared, seq_len, bool(getattr(data_cfg, "document_masking", True))
    )
    manifest, where = sequences.manifest, f"the corpus in data.prepared={data_cfg.prepared}"
    redo = (
        "Prepare it again with composer3d-prepare and this run's data overrides "
        "(data.prepare_overwrite=true)"
    )
    if manifest["settings"] != corpus_settings(data_cfg):
        raise ConfigError(
            f"data.format: {where} was prepared as {manifest['settings']}, and this run asks for "
            f"{corpus_settings(data_cfg)}. Use that data.format/field, or: {redo}"
        )
    vocab_size = manifest["tokenizer"]["vocab_size"]
    if vocab_size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size: {model_vocab_size} is smaller than the vocabulary {where} was "
            f"tokenized with ({vocab_size}). Use model.vocab_size>={vocab_size}"
        )
    if (
        tokenizer_source(data_cfg, model_cfg) is not None
        and tokenizer_digest(data_cfg, model_cfg) != manifest["tokenizer"]["sha256"]
    ):
        raise ConfigError(
            f"data.tokenizer: {where} was tokenized by another tokenizer "
            f"({manifest['tokenizer']['path']}). Name that one, leave data.tokenizer out to train "
            f"on the corpus as prepared, or: {redo}"
        )
    if data_cfg.paths and source_entries(expand(list(data_cfg.paths))) != manifest["sources"]:
        raise ConfigError(
            f"data.prepared: {where} was prepared from other sources than data.paths names now "
            "(files, sizes or modification times differ). Leave data.paths out to train on the "
            f"corpus as prepared, or: {redo}"
        )
    return sequences


def build_sequences(
    data_cfg: DataConfig,
    model_vocab_size: int,
    seq_len: int,
    seed: int,
    model_cfg: ModelConfig | None = None,
) -> PackedSequences | PreparedSequences | PreferenceSequences:
    """All packed training sequences, (num_sequences, seq_len + 1) windows, identical on every rank.

    ``model_cfg``: the run's model config; a ``model=hf`` run without ``data.tokenizer`` uses its
    tokenizer. With ``data.prepared`` the windows are served from its shards
    (:func:`check_prepared`), uncapped.
    """
    document_masking = bool(getattr(data_cfg, "document_masking", True))
    if getattr(data_cfg, "prepared", None):
        sequences = check_prepared(data_cfg, model_vocab_size, seq_len, model_cfg)
        log.info(
            "data: prepared corpus %s (%s), %d sequences of %d tokens, %d documents; tokenizer: "
            "%s (as prepared)",
            data_cfg.prepared,
            sequences.manifest["settings"]["format"],
            len(sequences),
            seq_len,
            sequences.manifest["documents"],
            sequences.manifest["tokenizer"]["path"],
        )
        return sequences
    if data_cfg.name == "synthetic":
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(
            0, model_vocab_size, (data_cfg.synthetic_sequences, seq_len + 1), generator=generator
        )
        return PackedSequences(tokens, document_masking=document_masking)
    tokenizer = check_sources(data_cfg, model_vocab_size, model_cfg)
    if getattr(data_cfg, "format", "text") == "preference":
        return _preference_sequences(data_cfg, tokenizer, seq_len, model_cfg)
    if getattr(data_cfg, "format", "text") == "chat":
        conversations = chat_conversations(
            list(data_cfg.paths), getattr(data_cfg, "messages_field", "messages")
        )
        stream = conversation_stream(conversations, tokenizer, data_cfg.max_tokens)
    else:
        if data_cfg.name == "stdlib":
            documents = stdlib_documents()
        else:
            documents = text_file_documents(list(data_cfg.paths), data_cfg.text_field)
        stream = document_stream(documents, tokenizer, data_cfg.max_tokens)
    sequences = PackedSequences.from_stream(stream, seq_len, document_masking)
    log.info(
        "data: %s (%s), %d sequences of %d tokens, %d documents; %s",
        data_cfg.name,
        getattr(data_cfg, "format", "text"),
        len(sequences),
        seq_len,
        int(stream.starts.sum()),
        describe_tokenizer(tokenizer, data_cfg, model_cfg),
    )
    return sequences


def _preference_sequences(
    data_cfg: DataConfig, tokenizer, seq_len: int, model_cfg: ModelConfig | None
) -> PreferenceSequences:
    """data.format=preference: the pairs packed whole into rows (``preference``)."""
    pairs = tokenize_pairs(preference_rows(list(data_cfg.paths)), tokenizer, data_cfg.max_tokens)
    sequences = PreferenceSequences.pack(pairs, seq_len, tokenizer.eos_id)
    log.info(
        "data: %d preference pairs packed into %d rows of %d tokens (%.0f%% of their tokens "
        "filled); %s",
        len(pairs),
        len(sequences),
        seq_len,
        100 * sum(pair.tokens for pair in pairs) / sequences.tokens.numel(),
        describe_tokenizer(tokenizer, data_cfg, model_cfg),
    )
    return sequences
