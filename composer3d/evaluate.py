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
import os
import signal
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from composer3d import distributed, launcher
from composer3d.checkpoint import load_model_weights
from composer3d.config import ConfigError, register_configs, resolve_model_config, validate
from composer3d.data import eval_windows
from composer3d.layout import ParallelMesh, layout_from_degrees
from composer3d.trainer import Trainer, prepare_rank


def run(cfg: DictConfig, env: distributed.Env | None) -> dict:
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
    mesh = ParallelMesh(layout_from_degrees(degrees), device.type)
    trainer = Trainer(cfg, mesh, device, sequences=None)
    if resume not in ("auto", "none"):
        load_model_weights(trainer.model, Path(resume))
    return trainer.evaluate(windows)


# pkg://, not "conf": the configs are the top-level conf/ mapped into the package (pyproject.toml), and under
# `python -m` Hydra would look for a relative config_path next to this file, where an editable install has none.
@hydra.main(config_path="pkg://composer3d.conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    env = distributed.job_env()
    if launcher.started_by_local_launcher():
        launcher.die_with_launcher()
    try:
        resolve_model_config(cfg.model)
        if env is None and cfg.launch.nproc_per_node > 1:
            validate(cfg, cfg.launch.nproc_per_node)
            eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len)
            overrides = list(HydraConfig.get().overrides.task) + list(HydraConfig.get().overrides.hydra)
            launcher.spawn_local_workers(cfg.launch.nproc_per_node, "composer3d.evaluate", overrides)
            return
        run(cfg, env)
    except ConfigError as error:
        print(f"composer3d-eval: invalid configuration: {error}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, launcher.Interrupted) as error:  # one line, not a traceback per process
        signum = getattr(error, "signum", signal.SIGINT)
        if env is None or env.rank == 0:
            print(f"composer3d-eval: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        sys.exit(128 + signum)


register_configs()

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
