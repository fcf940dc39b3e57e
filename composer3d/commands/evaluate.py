"""Evaluation: mean next-token loss and perplexity over a text file — ``composer3d-eval`` and
``train.eval_every``.

The definition (what ``composer3d-eval`` prints): the file is tokenized with the model's tokenizer,
no special tokens added; the tokens are cut into non-overlapping windows of ``train.seq_len``
tokens, the last partial window dropped; every position of a window but the first is predicted from
the ones before it, and the loss is the mean over all those predictions. Perplexity is exp(loss). It
runs under any layout the trainer runs (same config tree, same model assembly): windows are dealt to
data-parallel ranks, and under pipeline parallel they go through the schedule's forward-only pass.

    composer3d-eval model=hf model.path=/models/qwen eval.path=/data/valid.txt train.seq_len=2048 \
        launch.nproc_per_node=8 parallel.tp=2 [checkpoint.resume=<run>/checkpoints/step-N]

With ``eval.tasks``, lm-evaluation-harness tasks are scored instead (``eval_harness``; the ``eval``
extra), under the same layouts, and their metrics printed as one JSON line:

    composer3d-eval model=hf model.path=/models/qwen 'eval.tasks=[hellaswag,arc_easy]' \
        eval.num_fewshot=0 [eval.task_paths=[my_tasks/]] [eval.limit=100]

With ``checkpoint.resume``, the model and tokenizer are the checkpoint's (its recorded config names
them, as for ``composer3d-generate``); ``model.*`` or ``data.tokenizer`` overrides go on top of
them, and a model that then does not match the checkpoint's tensors is refused before any worker
starts.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from composer3d.checkpoint import META_FILE, check_same_model, load_model_weights, read_meta
from composer3d.commands.cli import EVALUATE
from composer3d.commands.processes import run_command
from composer3d.config.checks import resolve_model_config, validate
from composer3d.data import eval_windows
from composer3d.data.tokenizers import build_tokenizer
from composer3d.errors import ConfigError, require_eval_extra
from composer3d.launch import distributed
from composer3d.launch.rank import prepare_rank
from composer3d.models import MODEL_REGISTRY
from composer3d.parallel.mesh import Layout, ParallelMesh
from composer3d.parallel.pipeline.schedules import forward_only_problem
from composer3d.peft.base import build_with_adapters, checkpoint_base
from composer3d.training import console
from composer3d.training.trainer import Trainer


def check_weights_source(cfg: DictConfig, command: str = "composer3d-eval would evaluate") -> None:
    """The weights to evaluate (or, ``command``, generate from): a checkpoint (checkpoint.resume) or
    the model's own (model=hf's model.path). A random initialization measures nothing, so it is
    refused rather than reported as a loss."""
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none"):
        if not (Path(resume) / META_FILE).is_file():
            raise ConfigError(
                f"checkpoint.resume: {resume} is not a composer3d checkpoint (no {META_FILE}). "
                "Give a step-N directory (its model weights are evaluated), or leave it out to "
                "evaluate model.path's weights"
            )
        return
    if MODEL_REGISTRY[cfg.model.name].pretrained_weights(cfg.model) is None:
        raise ConfigError(
            f"checkpoint.resume: model={cfg.model.name} has no weights of its own here, so "
            f"{command} a random initialization. Give checkpoint.resume=<run>/"
            "checkpoints/step-N, or model=hf model.path=<dir> with model.pretrained=true"
        )


def adopt_checkpoint_model(cfg: DictConfig, typed_overrides: list[str]) -> None:
    """With checkpoint.resume: the model (with its LoRA adapters, ``peft``) and tokenizer of the run
    that saved it, from its recorded config, with the ``model.*`` and ``data.tokenizer`` overrides
    typed on top (a model group typed, ``model=...``, replaces it whole)."""
    resume = cfg.checkpoint.resume
    if resume in ("auto", "none") or not (Path(resume) / META_FILE).is_file():
        return  # check_weights_source says what is wrong
    keys = [o.split("=", 1)[0].lstrip("+~") for o in typed_overrides]
    recorded = read_meta(Path(resume))["config"]
    if "model" not in keys:
        typed = {key: OmegaConf.select(cfg, key) for key in keys if key.startswith("model.")}
        cfg.model = OmegaConf.merge(cfg.model, recorded["model"])
        for key, value in typed.items():
            OmegaConf.update(cfg, key, value, merge=False)
    if not any(key.startswith("data.tokenizer") for key in keys):
        cfg.data.tokenizer = (recorded.get("data") or {}).get("tokenizer")
    # its LoRA adapters: its model's
    if "peft" in recorded and not any(key.startswith("peft") for key in keys):
        cfg.peft = OmegaConf.merge(cfg.peft, recorded["peft"])


def check_checkpoint_model(cfg: DictConfig) -> None:
    """A model asked for that is not the checkpoint's: one line naming both shapes (not DCP's size
    mismatch)."""
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none"):
        check_same_model(
            Path(resume),
            build_with_adapters(cfg.model, cfg.peft),
            remedy="Leave out the model overrides: composer3d-eval takes the checkpoint's own "
            "model (see {meta})",
        )


def run(cfg: DictConfig, env: distributed.Env | None) -> dict | None:
    console.setup_logging(env.rank if env else 0, stream=sys.stderr)
    layout, device = prepare_rank(cfg, env)
    windows = (
        None if cfg.eval.tasks else eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len)
    )
    check_weights_source(cfg)
    resume = cfg.checkpoint.resume
    env = distributed.init_process_group(
        device,
        env,
        timedelta(minutes=cfg.launch.timeout_minutes),
        host_collectives=cfg.parallel.offload == "cpu",
    )
    finished = False
    try:
        metrics = _evaluate_in_group(cfg, layout, device, windows, resume)
        if env.rank == 0:
            print(json.dumps(metrics), flush=True)
        finished = True
        return metrics
    finally:
        distributed.shut_down(finished)


def _evaluate_in_group(
    cfg: DictConfig, layout: Layout, device: torch.device, windows: torch.Tensor | None, resume: str
) -> dict | None:
    mesh = ParallelMesh(layout, device.type, timedelta(minutes=cfg.launch.timeout_minutes))
    trainer = Trainer(
        cfg,
        mesh,
        device,
        sequences=None,
        from_checkpoint=resume not in ("auto", "none"),
        base=checkpoint_base(cfg.peft, resume),
    )
    if resume not in ("auto", "none"):
        load_model_weights(trainer.model, Path(resume))
    if windows is not None:
        return trainer.evaluate(windows)
    # lm-eval: the eval extra, imported only when asked for
    from composer3d.evaluation.harness import run_tasks

    return run_tasks(trainer, build_tokenizer(cfg.data, cfg.model), cfg.eval, cfg.train.seq_len)


def check_tasks_or_windows(cfg: DictConfig, layout: Layout) -> None:
    """What composer3d-eval scores: lm-eval tasks (eval.tasks), or the loss over eval.path's
    windows."""
    if not cfg.eval.tasks:
        eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len)
        return
    require_eval_extra("eval.tasks")
    from composer3d.evaluation.harness import check_tasks, generation_problem

    check_tasks(cfg.eval, generation=generation_problem(layout, cfg.parallel.sequence_parallel))


def _settle(cfg: DictConfig) -> None:
    adopt_checkpoint_model(cfg, list(HydraConfig.get().overrides.task))
    resolve_model_config(cfg.model)


def _check(cfg: DictConfig) -> None:
    layout = validate(cfg, cfg.launch.nproc_per_node)
    problem = forward_only_problem(cfg.parallel.pp_schedule, "composer3d-eval")
    if layout.pp > 1 and problem is not None:
        raise ConfigError(
            f"parallel.pp_schedule: {problem}. Use another schedule (1f1b, interleaved_1f1b, …): "
            "a checkpoint loads under any layout"
        )
    check_weights_source(cfg)
    check_checkpoint_model(cfg)
    MODEL_REGISTRY[cfg.model.name].check_forward(cfg.model, layout.tp)
    check_tasks_or_windows(cfg, layout)


def task(cfg: DictConfig) -> None:
    run_command(EVALUATE, cfg, run, settle=_settle, check=_check)


if __name__ == "__main__":  # the local workers' command line
    from composer3d.commands.cli import evaluate

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    evaluate()
