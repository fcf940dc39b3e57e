"""Evaluation: mean next-token loss and perplexity over a text file — ``composer3d-eval`` and ``train.eval_every``.

The definition (what ``composer3d-eval`` prints): the file is tokenized with the model's tokenizer, no special
tokens added; the tokens are cut into non-overlapping windows of ``train.seq_len`` tokens, the last partial window
dropped; every position of a window but the first is predicted from the ones before it, and the loss is the mean
over all those predictions. Perplexity is exp(loss). It runs under any layout the trainer runs (same config tree,
same model assembly): windows are dealt to data-parallel ranks, and under pipeline parallel they go through the
schedule's forward-only pass.

    composer3d-eval model=hf model.path=/models/qwen eval.path=/data/valid.txt train.seq_len=2048 \
        launch.nproc_per_node=8 parallel.tp=2 [checkpoint.resume=<run>/checkpoints/step-N]
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from composer3d import distributed
from composer3d.config import ConfigError, register_configs, resolve_model_config, validate
from composer3d.data import IGNORE_INDEX, build_tokenizer


def eval_windows(eval_cfg, data_cfg, model_cfg, seq_len: int) -> torch.Tensor:
    """(windows, seq_len) token ids of ``eval.path``; fails with a ConfigError before any process group exists."""
    path = Path(eval_cfg.path) if eval_cfg.path else None
    if path is None or not path.is_file():
        raise ConfigError(f"eval.path: {eval_cfg.path!r} is not a file. Point it at a UTF-8 text file to evaluate on")
    tokens = build_tokenizer(data_cfg, model_cfg).encode(path.read_text(encoding="utf-8"))
    count = tokens.numel() // seq_len
    if eval_cfg.max_windows:
        count = min(count, eval_cfg.max_windows)
    if count < 1:
        raise ConfigError(f"eval.path: {path} has {tokens.numel()} tokens, fewer than one window of "
                          f"train.seq_len={seq_len}. Lower train.seq_len or give a longer file")
    return tokens[: count * seq_len].view(count, seq_len)


def window_batches(windows: torch.Tensor, dp_rank: int, dp: int, per_forward: int):
    """This data-parallel rank's (inputs, targets, position_ids) batches of ``per_forward`` windows.

    A window is fed whole (seq_len tokens, so sequence-parallel divisibility holds) and its last position takes no
    loss: it has no next token in the window. Every rank runs the same number of batches — the window count is
    padded with windows that take no loss — so collectives stay matched.
    """
    per_round = dp * per_forward
    padded = -(-windows.shape[0] // per_round) * per_round
    targets = torch.full_like(windows, IGNORE_INDEX)
    targets[:, :-1] = windows[:, 1:]
    pad = padded - windows.shape[0]
    inputs = torch.cat([windows, windows.new_zeros((pad, windows.shape[1]))])
    targets = torch.cat([targets, targets.new_full((pad, windows.shape[1]), IGNORE_INDEX)])
    positions = torch.arange(windows.shape[1]).expand(per_forward, -1)
    for start in range(dp_rank * per_forward, padded, per_round):
        yield inputs[start:start + per_forward], targets[start:start + per_forward], positions


def result(loss_sum: float, count: int) -> dict:
    loss = loss_sum / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}


def run(cfg: DictConfig, env: distributed.Env | None) -> dict:
    from composer3d.train import prepare_rank

    distributed.setup_logging(env.rank if env else 0, stream=sys.stderr)
    degrees, device = prepare_rank(cfg, env)
    windows = eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len)
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).is_dir():
        raise ConfigError(f"checkpoint.resume: {resume} is not a checkpoint directory. Give a step-N directory "
                          "(its model weights are evaluated), or leave it out to evaluate model.path's weights")
    env = distributed.init_process_group(device, env)
    finished = False
    try:
        metrics = _evaluate_in_group(cfg, degrees, device, windows, resume)
        if env.rank == 0:
            print(json.dumps(metrics), flush=True)
        finished = True
        return metrics
    finally:
        distributed.shut_down(finished)


def _evaluate_in_group(cfg: DictConfig, degrees: dict, device: torch.device, windows: torch.Tensor,
                       resume: str) -> dict:
    from composer3d.checkpoint import load_model_weights
    from composer3d.layout import ParallelMesh, layout_from_degrees
    from composer3d.train import Trainer

    mesh = ParallelMesh(layout_from_degrees(degrees), device.type)
    trainer = Trainer(cfg, mesh, device, sequences=None)
    if resume not in ("auto", "none"):
        load_model_weights(trainer.model, Path(resume))
    return trainer.evaluate(windows)


# pkg://, not "conf": the configs are the top-level conf/ mapped into the package (pyproject.toml), and under
# `python -m` Hydra would look for a relative config_path next to this file, where an editable install has none.
@hydra.main(config_path="pkg://composer3d.conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    env = distributed.job_env()
    try:
        resolve_model_config(cfg.model)
        if env is None and cfg.launch.nproc_per_node > 1:
            validate(cfg, cfg.launch.nproc_per_node)
            eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len)
            overrides = list(HydraConfig.get().overrides.task) + list(HydraConfig.get().overrides.hydra)
            distributed.spawn_local_workers(cfg.launch.nproc_per_node, "composer3d.evaluate", overrides)
            return
        run(cfg, env)
    except ConfigError as error:
        print(f"composer3d-eval: invalid configuration: {error}", file=sys.stderr)
        sys.exit(2)


register_configs()

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
