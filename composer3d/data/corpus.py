"""The training corpus from the data config: the sources checked up front, then read, tokenized and packed.

Synthetic data is seeded random windows; the other corpora go documents → token stream → packed sequences.
"""

from __future__ import annotations

import logging

import torch

from composer3d.data.packing import PackedSequences
from composer3d.data.sources import chat_conversations, check_files, stdlib_documents, text_file_documents
from composer3d.data.streams import conversation_stream, document_stream
from composer3d.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer, tokenizer_source
from composer3d.errors import ConfigError

log = logging.getLogger("composer3d")


def check_sources(data_cfg, model_vocab_size: int, model_cfg=None) -> ByteTokenizer | HFTokenizer | None:
    """Fail fast (ConfigError) on missing or unreadable files, or a tokenizer the model cannot embed; returns the
    tokenizer."""
    if data_cfg.name == "synthetic":
        return None
    if data_cfg.name == "text_files":
        if getattr(data_cfg, "format", "text") == "chat":
            check_files(list(data_cfg.paths), getattr(data_cfg, "messages_field", "messages"), "data.messages_field")
        else:
            check_files(list(data_cfg.paths), data_cfg.text_field, "data.text_field")
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
