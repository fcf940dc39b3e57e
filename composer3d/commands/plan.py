"""``composer3d-plan``: the same config as composer3d-train, plus ``cluster.*`` and ``plan.*``.

    composer3d-plan model=llama3_8b train.seq_len=8192 train.global_batch_size=64 \
        cluster.nodes=8 cluster.device=h100
    # one layout, in detail
    composer3d-plan model=llama3_8b ... parallel.tp=2 parallel.dp_shard=-1
    # one JSON object per layout
    composer3d-plan ... plan.format=json
    # the longest sequence, the largest model, what they take
    composer3d-plan model=llama3_8b cluster.gpus_per_node=1 plan.what_fits=true
    # time the layout's kernels on this machine's device, then plan with their rates
    composer3d-plan model=llama3_8b parallel.dp_shard=8 plan.calibrate=h200.json
    composer3d-plan model=llama3_8b cluster.device=h200 plan.calibration=h200.json

With any ``parallel.*`` key on the command line it reports that layout; without one (or with
``parallel=auto``) it ranks every valid layout that fits. Nothing is started: it is arithmetic
(composer3d/plan/*) — except with ``plan.measure=true``, which runs one rank of the given layout
here with a fake process group (plan/measure.py), and ``plan.calibrate``, which times the layout's
kernels here (plan/calibrate.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from composer3d.config.checks import resolve_degrees, resolve_model_config, validate
from composer3d.errors import ConfigError
from composer3d.launch import launcher
from composer3d.plan import report
from composer3d.plan.estimate import Workload, estimate
from composer3d.plan.fits import micro_batch_size, what_fits
from composer3d.plan.hardware import cluster_from_config
from composer3d.plan.layouts import candidate_from_config
from composer3d.plan.search import ranked
from composer3d.plan.shapes import ModelShape
from composer3d.plan.validation import validate_plan


def _on_command_line(prefix: str) -> bool:
    return any(o.lstrip("+~").startswith(prefix) for o in HydraConfig.get().overrides.task)


def layout_given(cfg: DictConfig) -> bool:
    """A layout is given when the command line sets a ``parallel.*`` key (and parallel=auto is not
    asked for)."""
    return not cfg.parallel.auto and _on_command_line("parallel.")


def task(cfg: DictConfig) -> None:
    with launcher.exits_as_a_command("composer3d-plan", None):
        resolve_model_config(cfg.model)
        validate_plan(cfg)
        if cfg.plan.calibrate:
            _calibrate(cfg)
            return
        cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype, cfg.plan.calibration)
        if cfg.plan.what_fits:  # for the config's layout: the longest sequence, the largest model
            dp = resolve_degrees(cfg.parallel, cluster.world_size).dp
            # the micro-batch is the layout's, as in the search: the defaults' 4 on 8 ranks of a
            # global batch of 16 answers at 2 (one the command line gives is not replaced)
            cfg.train.micro_batch_size, note = micro_batch_size(
                cfg.train, dp, _on_command_line("train.micro_batch_size=")
            )
            validate(cfg, cluster.world_size)
            candidate = candidate_from_config(cfg, cluster.world_size)
            sequences, models = what_fits(
                Workload.from_config(cfg), candidate, cluster, cfg.compile.enabled
            )
            print(
                report.what_fits(
                    sequences,
                    models,
                    cluster,
                    candidate.short(),
                    cfg.train.seq_len,
                    cfg.model.dim,
                    cfg.model.max_seq_len,
                    [note] if note else [],
                ),
                flush=True,
            )
            return
        if layout_given(cfg):
            validate(cfg, cluster.world_size)
            e = estimate(
                Workload.from_config(cfg), candidate_from_config(cfg, cluster.world_size), cluster
            )
            if cfg.plan.measure:
                _measure(cfg, e, cluster)
                return
            print(
                report.json_lines([e]) if cfg.plan.format == "json" else report.detail(e, cluster),
                flush=True,
            )
            return
        if cfg.plan.measure:
            raise ConfigError(
                "plan.measure: measures one layout, and none is given. Add its parallel.* keys "
                "(e.g. parallel.tp=2 parallel.dp_shard=-1; composer3d-plan without plan.measure "
                "ranks them)"
            )
        fitting, tried = ranked(cfg, cluster)
        shown = fitting[: cfg.plan.top]
        print(
            report.json_lines(shown)
            if cfg.plan.format == "json"
            else report.table(fitting, tried, cfg.plan.top, cluster),
            flush=True,
        )


def _calibrate(cfg: DictConfig) -> None:
    from composer3d.launch.distributed import resolve_device
    from composer3d.plan.calibrate import calibrate  # torch's kernels: only when calibrating

    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    validate(cfg, world)
    rates = calibrate(
        ModelShape.from_config(cfg.model),
        candidate_from_config(cfg, world),
        cfg.train.seq_len,
        resolve_device(cfg.launch.device),
        cfg.precision.param_dtype,
        cfg.optim,
        cfg.train.grad_clip,
        cfg.plan.calibrate_repeats,
    )
    Path(cfg.plan.calibrate).write_text(json.dumps(rates.as_json(), indent=2) + "\n")
    print(report.calibrated(rates, cfg.plan.calibrate), flush=True)


def _measure(cfg: DictConfig, e, cluster) -> None:
    from composer3d.plan.measure import (  # the training stack: only when measuring
        comparison,
        measure_rank,
    )

    measured = measure_rank(cfg, cluster.world_size, cfg.plan.measure_rank, cfg.plan.measure_steps)
    result = comparison(measured, e, cluster)
    print(json.dumps(result) if cfg.plan.format == "json" else report.measured(result), flush=True)


if __name__ == "__main__":  # the local workers' command line
    from composer3d.commands.cli import plan

    plan()
