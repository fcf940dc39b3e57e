"""Evaluation windows: a text file cut into fixed windows of tokens, and dealt to data-parallel
ranks.

What ``composer3d-eval`` and ``train.eval_every`` evaluate on (the definition is in
``composer3d/commands/evaluate.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from composer3d.config.schema import DataConfig, EvalConfig, ModelConfig
from composer3d.data.packing import IGNORE_INDEX
from composer3d.data.tokenizers import build_tokenizer
from composer3d.errors import ConfigError


def eval_windows(
    eval_cfg: EvalConfig, data_cfg: DataConfig, model_cfg: ModelConfig, seq_len: int
) -> torch.Tensor:
    """(windows, seq_len) token ids of ``eval.path``; fails with a ConfigError before any process
    group exists."""
    path = Path(eval_cfg.path) if eval_cfg.path else None
    if path is None or not path.is_file():
        raise ConfigError(
            f"eval.path: {eval_cfg.path!r} is not a file. Point it at a UTF-8 text file to "
            "evaluate on"
        )
    tokens = build_tokenizer(data_cfg, model_cfg).encode(path.read_text(encoding="utf-8"))
    count = tokens.numel() // seq_len
    if eval_cfg.max_windows:
        count = min(count, eval_cfg.max_windows)
    if count < 1:
        raise ConfigError(
            f"eval.path: {path} has {tokens.numel()} tokens, fewer than one window of "
            f"train.seq_len={seq_len}. Lower train.seq_len or give a longer file"
        )
    return tokens[: count * seq_len].view(count, seq_len)


def window_batches(windows: torch.Tensor, dp_rank: int, dp: int, per_forward: int):
    """This data-parallel rank's (inputs, targets) batches of ``per_forward`` windows (each one span
    of the file: plain causal attention, no position_ids).

    A window is fed whole (seq_len tokens, so sequence-parallel divisibility holds) and its last
    position takes no loss: it has no next token in the window. Every rank runs the same number of
    batches — the window count is padded with windows that take no loss — so collectives stay
    matched.
    """
    per_round = dp * per_forward
    padded = -(-windows.shape[0] // per_round) * per_round
    targets = torch.full_like(windows, IGNORE_INDEX)
    targets[:, :-1] = windows[:, 1:]
    pad = padded - windows.shape[0]
    inputs = torch.cat([windows, windows.new_zeros((pad, windows.shape[1]))])
    targets = torch.cat([targets, targets.new_full((pad, windows.shape[1]), IGNORE_INDEX)])
    for start in range(dp_rank * per_forward, padded, per_round):
        yield inputs[start : start + per_forward], targets[start : start + per_forward]


def eval_result(loss_sum: float, count: int) -> dict:
    """What an evaluation reports: mean loss over the predicted tokens, its perplexity, and their
    count."""
    loss = loss_sum / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
