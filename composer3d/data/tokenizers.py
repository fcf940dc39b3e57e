"""Tokenizers: UTF-8 bytes (the default), or a Hugging Face tokenizer from a local directory.

The Hugging Face one also renders conversations through its chat template and locates the assistant
replies' tokens (:meth:`HFTokenizer.encode_chat`), for ``data.format=chat``.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from composer3d.config.schema import DataConfig, ModelConfig
from composer3d.errors import ConfigError, require_hf_extra


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token."""

    vocab_size = 257
    eos_id = 256
    has_chat_template = False

    def encode(self, text: str) -> torch.Tensor:
        # from the bytes' buffer: a list of Python ints per byte is most of a small run's data time
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return torch.from_numpy(ids.astype(np.int64))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode` of each text, as numpy arrays (preparing a large corpus: no per-byte
        Python ints)."""
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def to_transformers(self):
        """The same ids as a transformers tokenizer, for an exported model: byte-level BPE without
        merges (each byte one token, its id the byte's value, spelled by GPT-2's byte-to-character
        table) and eos as id 256."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_level = Tokenizer(
            models.BPE(vocab={char: byte for byte, char in bytes_to_unicode().items()}, merges=[])
        )
        byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        byte_level.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=byte_level, eos_token="<|end_of_document|>")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloaded).

    ``key`` is the config key the directory came from (``data.tokenizer``, or ``model.path`` when
    the tokenizer is the Hugging Face model's own), named in errors.
    """

    def __init__(self, path: str, key: str = "data.tokenizer"):
        require_hf_extra(key, "a Hugging Face tokenizer")
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ConfigError(
                f"{key}: {path!r} is not a directory. Point it at a local directory holding "
                "tokenizer.json (or the files AutoTokenizer.save_pretrained writes)"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"{key}: no tokenizer could be loaded from {path!r} ({error}). Give a directory "
                "holding tokenizer.json, or set data.tokenizer to one"
            ) from error
        # A model directory without tokenizer files still "loads" (an empty vocabulary that encodes
        # text to nothing): refuse it rather than train on end-of-document tokens alone.
        if not self.tokenizer.encode("The quick brown fox.", add_special_tokens=False):
            raise ConfigError(
                f"{key}: {path!r} holds no usable tokenizer (it encodes text to no tokens; "
                "tokenizer.json or the vocabulary files are missing). Give a directory holding "
                "tokenizer.json, or set data.tokenizer to one"
            )
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ConfigError(
                f"{key}: the tokenizer in {path!r} has no eos token, needed to separate packed "
                "documents. Set eos_token in its tokenizer_config.json"
            )
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` without added special tokens (no bos/eos; those in the text itself
        are kept)."""
        return torch.tensor(
            self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64
        )

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode` of each text, as numpy arrays, in one call (the Rust tokenizer's batch
        path)."""
        return [
            np.asarray(ids, dtype=np.int64)
            for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        ]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        # jinja's own errors (a template that raises, or expects other fields)
        except Exception as error:
            raise ConfigError(
                "data.format: the tokenizer's chat template failed on the messages "
                f"{str(messages)[:300]} ({type(error).__name__}: {error}). Fix the rows or give "
                "data.tokenizer a template that accepts them"
            ) from error

    def encode_chat(self, messages: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """A conversation through the chat template: (token ids, mask of the assistant replies'
        tokens).

        Each assistant message's span is found by rendering prefixes: the template of
        ``messages[:i]`` with the generation prompt ends where reply i starts, the template of
        ``messages[:i+1]`` ends where it stops (its end-of-turn tokens included, so the model learns
        to stop). Those renderings must be prefixes of the whole conversation's (ConfigError
        otherwise). The text is then tokenized piece by piece (prompt, reply, prompt, …), so every
        span boundary is a token boundary: tokenizing it whole could merge the generation prompt's
        last characters with the reply's first ones (a trailing space with the first word, in
        byte-level BPE), and the reply would then start mid-token.
        """
        full = self.render_chat(messages)
        spans, end = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, upto = (
                self.render_chat(messages[:i], add_generation_prompt=True),
                self.render_chat(messages[: i + 1]),
            )
            if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= end):
                raise ConfigError(
                    "data.format: the tokenizer's chat template is not prefix-stable: rendering "
                    f"the first {i} message(s) with the generation prompt, then the first {i + 1}, "
                    "does not give successive prefixes of the whole conversation, so the assistant "
                    "replies cannot be located (templates that rewrite earlier turns, e.g. drop "
                    "past reasoning, do this). Give data.tokenizer a directory whose chat_template "
                    "renders a conversation's first messages as a prefix of the whole.\nprefix: "
                    f"{prompt[-200:]!r}\nwhole: {full[: len(prompt) + 200][-400:]!r}"
                )
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


def tokenizer_source(
    data_cfg: DataConfig, model_cfg: ModelConfig | None = None
) -> tuple[str, str] | None:
    """(directory, config key) of the Hugging Face tokenizer to use; None for the byte-level one.

    ``data.tokenizer`` when set; otherwise, for ``model=hf``, the model's own directory
    (``model.path``).
    """
    if data_cfg.tokenizer:
        return str(data_cfg.tokenizer), "data.tokenizer"
    if (
        model_cfg is not None
        and getattr(model_cfg, "name", None) == "hf"
        and getattr(model_cfg, "path", None)
    ):
        return str(model_cfg.path), "model.path"
    return None


def describe_tokenizer(
    tokenizer: ByteTokenizer | HFTokenizer,
    data_cfg: DataConfig,
    model_cfg: ModelConfig | None = None,
) -> str:
    """The tokenizer as the run's data line names it: the byte-level default says so, since a run
    meant for a model's own tokenizer would otherwise train on bytes without a word."""
    source = tokenizer_source(data_cfg, model_cfg)
    if source is None:
        return (
            f"tokenizer: byte-level (UTF-8 bytes, eos {tokenizer.eos_id}; data.tokenizer names a "
            "Hugging Face one)"
        )
    directory, key = source
    return f"tokenizer: {os.path.abspath(directory)} ({key}, {tokenizer.vocab_size:,} ids)"


def build_tokenizer(
    data_cfg: DataConfig, model_cfg: ModelConfig | None = None
) -> ByteTokenizer | HFTokenizer:
    source = tokenizer_source(data_cfg, model_cfg)
    return HFTokenizer(*source) if source else ByteTokenizer()
