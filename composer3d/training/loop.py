"""The loop around the trainer's step (``Trainer.fit``): when to read the metrics back and log them,
evaluate, save a checkpoint, measure memory; and stopping early, at the same step on every rank, for
a scheduler's signal.

Metrics stay on the device between logging steps: one read-back (``readback``) per logging window,
not per step.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from composer3d.errors import StoppedBySignal, TrainingDiverged
from composer3d.launch.distributed import allocator_settings, is_accelerator
from composer3d.launch.stop_signals import StopSignals
from composer3d.training.console import human_bytes
from composer3d.training.garbage import StepGarbageCollection
from composer3d.training.metrics import MetricsSink, local_bytes, max_over_ranks, memory_breakdown

log = logging.getLogger("composer3d")


def train_loop(trainer, sink: MetricsSink, checkpointer) -> None:
    """Train from ``trainer.step`` to train.steps; SIGTERM/SIGUSR1/SIGUSR2/SIGINT stop it early at a
    step boundary (``StopSignals``), raising StoppedBySignal once that step's checkpoint is
    committed. ``checkpointer``: a ``checkpoint.Checkpointer`` (which holds the trainer; neither
    package imports the other), or None: nothing is saved."""
    if trainer.step == trainer.cfg.train.steps:
        log.info(
            "already finished: step %d of train.steps=%d; nothing to train",
            trainer.step,
            trainer.step,
        )
    signals = StopSignals(timedelta(minutes=trainer.cfg.launch.timeout_minutes))
    try:
        with StepGarbageCollection(trainer.cfg.train.gc_every) as garbage:
            _run(trainer, sink, checkpointer, signals, garbage)
    finally:
        signals.restore()


def _run(
    trainer, sink: MetricsSink, checkpointer, signals: StopSignals, garbage: StepGarbageCollection
) -> None:
    cfg = trainer.cfg
    run_info = {
        "layout": trainer.mesh.layout.as_dict(),
        "world_size": dist.get_world_size(),
        "zero_stage": cfg.parallel.zero_stage,
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "num_params": trainer.num_params,
        "trainable_params": trainer.trainable_params,
        "device": trainer.device.type,
        **(
            {"num_active_params": trainer.active_params}
            if trainer.active_params != trainer.num_params
            else {}
        ),
        "accumulation_steps": trainer.accumulation_steps,
        "flops_per_token": trainer.throughput.flops_per_token,
        "peak_flops_per_device": trainer.throughput.peak,
        **trainer.run_info_extra,
        **({"allocator_settings": allocator_settings()} if is_accelerator(trainer.device) else {}),
    }
    pending: list[tuple[int, dict]] = []  # steps whose metrics are still on the device
    window_start = began = time.perf_counter()
    first_step, final = trainer.step, None
    while trainer.step < cfg.train.steps:
        # The second step is the steady state (optimizer state exists): measure it when asked.
        measure = (
            cfg.logging.memory_breakdown
            and "model_state_bytes_per_rank" in run_info
            and "memory_breakdown_bytes_per_rank" not in run_info
        )
        with (
            memory_breakdown(trainer.model, trainer.optimizer)
            if measure
            else contextlib.nullcontext(({}, None)) as (breakdown, trainer.memory_tracker)
        ):
            metrics = trainer.train_step()
        trainer.memory_tracker = None
        if measure:
            run_info["memory_breakdown_bytes_per_rank"] = {
                k: int(max_over_ranks(v, trainer.device)) for k, v in sorted(breakdown.items())
            }
            sink.write_run_info(run_info)
        # grads and optimizer state exist now: measure them
        if "model_state_bytes_per_rank" not in run_info:
            run_info["model_state_bytes_per_rank"] = int(
                max_over_ranks(trainer.model_state_bytes(), trainer.device)
            )
            # the frozen base as stored (QLoRA: its NF4 blocks and scales), beside what bf16 would
            # take
            frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
            if frozen:
                run_info["frozen_param_bytes_per_rank"] = int(
                    max_over_ranks(sum(local_bytes(p) for p in frozen), trainer.device)
                )
                log.info(
                    "frozen parameters: %s per rank, as stored",
                    human_bytes(run_info["frozen_param_bytes_per_rank"]),
                )
            sink.write_run_info(run_info)
            log.info(
                "model state: %s per rank (parameters, gradients and optimizer state; the largest "
                "rank)",
                human_bytes(run_info["model_state_bytes_per_rank"]),
            )
        trainer.zero_grad()
        garbage.after_step(trainer.step)
        pending.append((trainer.step, metrics))
        last = trainer.step == cfg.train.steps
        stop = 0 if last else signals.agreed()  # the last step ends the run anyway
        every = cfg.train.eval_every
        evaluating = (
            bool(every) and trainer.eval_windows is not None and (trainer.step % every == 0 or last)
        )
        saving = checkpointer is not None and (checkpointer.due(trainer.step) or bool(stop))
        if checkpointer is not None:
            checkpointer.poll()
        if not (trainer.step % cfg.logging.log_every == 0 or last or evaluating or saving or stop):
            continue
        records = trainer.read_back(pending, window_start)
        pending = []
        diverged = next(
            (
                r
                for r in records
                if "update_skipped" not in r and (r["loss"] is None or r["grad_norm"] is None)
            ),
            None,
        )
        if diverged is not None:  # before any evaluation or checkpoint of this state
            sink.log(records, to_console=True)
            raise TrainingDiverged(
                f"step {diverged['step']}: the loss or gradient norm is not finite (NaN/inf) and "
                "train.on_nonfinite=stop: stopped without saving this state; the last checkpoint "
                "written before it is kept. Lower optim.lr or resume from that checkpoint, or set "
                "train.on_nonfinite=skip to drop such updates"
            )
        if evaluating:
            evaluated = trainer.evaluate(trainer.eval_windows)
            records[-1].update(eval_loss=evaluated["loss"], eval_perplexity=evaluated["perplexity"])
        if saving:
            started = time.perf_counter()
            checkpointer.save(trainer.step)
            # training waited this long
            records[-1]["checkpoint_blocked_s"] = time.perf_counter() - started
        sink.log(records, to_console=trainer.step % cfg.logging.log_every == 0 or last)
        final = records[-1]
        if stop:
            _stop(trainer, stop, checkpointer, signals)
        window_start = time.perf_counter()
    if checkpointer is not None:
        checkpointer.wait()
    signals.finish()
    if final is not None:
        _finished(trainer, first_step, final, time.perf_counter() - began, checkpointer)


def _finished(trainer, first_step: int, final: dict, seconds: float, checkpointer) -> None:
    """The run's last line: what it trained, how fast, where it ended up."""
    cfg = trainer.cfg
    tokens = (trainer.step - first_step) * cfg.train.global_batch_size * cfg.train.seq_len
    loss = "not finite" if final.get("loss") is None else f"{final['loss']:.4f}"
    log.info(
        "finished: step %d of train.steps=%d (%d this run: %s tokens in %.1f s, %s tokens/s); "
        "final loss %s; %s",
        trainer.step,
        cfg.train.steps,
        trainer.step - first_step,
        f"{tokens:,}",
        seconds,
        f"{tokens / seconds:,.0f}",
        loss,
        "nothing saved (checkpoint.enabled=false)"
        if checkpointer is None
        else f"last checkpoint {checkpointer.path(trainer.step)}",
    )


def _stop(trainer, signum: int, checkpointer, signals: StopSignals) -> None:
    """End the run at this step for a stop signal, its checkpoint (just started) committed first."""
    if checkpointer is not None:
        checkpointer.wait()
        saved = f"checkpoint step-{trainer.step:08d} saved"
    else:
        saved = f"step {trainer.step}, nothing saved (checkpoint.enabled=false)"
    signals.finish()
    code = StoppedBySignal.exit_code_for(signum)
    if signum == signal.SIGINT:
        message = f"received SIGINT (Ctrl-C): {saved}; exiting with code {code}"
    else:
        message = (
            f"received {signal.Signals(signum).name}: {saved}; exiting so the job can be requeued "
            f"(exit code {code})"
        )
    log.info("%s", message)
    raise StoppedBySignal(message, signum)
