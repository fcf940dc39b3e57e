"""Tokenization: documents (or conversations) tokenized and joined into one :class:`TokenStream`.

Next to the tokens the stream keeps, per token, whether it starts a document and whether it may be a
target (chat: assistant tokens only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from composer3d.data.tokenizers import HFTokenizer

log = logging.getLogger("composer3d")


@dataclass
class TokenStream:
    """Documents joined into one stream of token ids, with per-token flags.

    ``starts[i]``: token i is the first of a document (or conversation). ``trainable[i]``: token i
    may be a target (chat: it belongs to an assistant reply); None means every token may.
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    trainable: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.numel()


def _join(
    pieces: Iterable[tuple[torch.Tensor, torch.Tensor | None]], max_tokens: int, chat: bool
) -> TokenStream:
    """Non-empty pieces (ids, trainable mask or None) joined, each starting a document, up to
    ``max_tokens``."""
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
    return TokenStream(
        torch.cat(tokens)[:cap],
        torch.cat(starts)[:cap],
        torch.cat(trainable)[:cap] if chat else None,
    )


def document_stream(documents: Iterator[str], tokenizer, max_tokens: int) -> TokenStream:
    """Non-empty documents tokenized and joined, each followed by the end-of-document token, up to
    ``max_tokens``."""
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int64)
    return _join(
        ((torch.cat([tokenizer.encode(doc), eos]), None) for doc in documents if doc),
        max_tokens,
        chat=False,
    )


def token_stream(documents: Iterator[str], tokenizer, max_tokens: int) -> torch.Tensor:
    """The token ids of :func:`document_stream`."""
    return document_stream(documents, tokenizer, max_tokens).tokens


def conversation_stream(
    conversations: Iterator[list[dict]], tokenizer: HFTokenizer, max_tokens: int
) -> TokenStream:
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
