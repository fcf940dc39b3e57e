"""The ``composer3d-train`` entry point (also ``python -m composer3d.commands.train``): config,
launch, one run per rank.

Run alone it trains in this process; with ``launch.nproc_per_node > 1`` (or ``launch.max_restarts``)
it checks the config and the data once, then starts that many workers (``launcher``; each runs this
module under torchrun's environment variables). Under ``-m`` each job of the sweep does the same in
its own run directory (Hydra's basic launcher: one job after another in this process;
hydra/launcher=slurm: each a SLURM job whose tasks are its ranks). The step and its loop are the
Trainer (``training/``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from composer3d.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_dir,
    committed_checkpoints,
    resumes_from_a_checkpoint,
)
from composer3d.commands.processes import job_overrides
from composer3d.config.checks import resolve_model_config
from composer3d.data import PackedSequences, build_sequences, eval_windows
from composer3d.errors import ConfigError, Exit, StoppedBySignal, TrainingDiverged
from composer3d.launch import distributed, launcher
from composer3d.launch.preflight import preflight
from composer3d.launch.rank import prepare_rank
from composer3d.parallel.mesh import Layout, ParallelMesh
from composer3d.peft.base import base_meta, build_with_adapters
from composer3d.plan.auto import choose_layout
from composer3d.training import console
from composer3d.training.metrics import MetricsSink, local_bytes

log = logging.getLogger("composer3d")
# signals the workers stop for after saving (StopSignals), which the local launcher passes on to
# them
STOPPING = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def run(
    cfg: DictConfig, env: distributed.Env | None, run_dir: Path, plan: dict | None = None
) -> None:
    """Train in this process, as one rank of the job (or the only one). ``plan``: parallel=auto's
    choice."""
    console.setup_logging(env.rank if env else 0)
    if plan is not None:
        log.info(
            "parallel=auto chose %s (%s): %s; predicted %.0f tokens/s per device, %s per device; "
            "runner-up: %s",
            plan["chosen"],
            " ".join(plan["overrides"]),
            plan["why"],
            plan["prediction"]["tokens_per_s_per_gpu"],
            console.human_bytes(plan["prediction"]["memory_bytes_per_gpu"]),
            "none"
            if plan["runner_up"] is None
            else f"{plan['runner_up']['layout']} ({plan['runner_up']['why_slower']})",
        )
    layout, device = prepare_rank(cfg, env)
    # One job per run.dir, held by this process or by rank 0 of a torchrun/SLURM job (our workers:
    # the launcher).
    if env is None or (env.rank == 0 and not launcher.started_by_local_launcher()):
        launcher.lock_run_dir(run_dir)
    distributed.use_deterministic_algorithms(cfg.train.deterministic)
    torch.manual_seed(cfg.train.seed)
    # Built before any collective: a bad corpus or tokenizer fails on every rank alike instead of
    # hanging.
    sequences = build_sequences(
        cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model
    )
    if len(sequences) < cfg.train.global_batch_size and (env is None or env.rank == 0):
        log.warning(
            "the corpus packs into %d sequences of train.seq_len=%d tokens, fewer than one global "
            "batch (train.global_batch_size=%d): every step repeats sequences. Give more text "
            "(data.paths, data.max_tokens) or a smaller train.global_batch_size",
            len(sequences),
            cfg.train.seq_len,
            cfg.train.global_batch_size,
        )
    windows = (
        eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len)
        if cfg.train.eval_every
        else None
    )
    timeout = timedelta(minutes=cfg.launch.timeout_minutes)
    env = distributed.init_process_group(
        device, env, timeout, host_collectives=cfg.parallel.offload == "cpu"
    )
    finished = False
    try:
        _train_in_group(cfg, env, layout, device, sequences, windows, timeout, plan)
        finished = True
    except StoppedBySignal:
        finished = True  # every rank stopped at the same step: shut down as after the last one
        raise
    finally:
        distributed.shut_down(finished)


def _train_in_group(
    cfg: DictConfig,
    env: distributed.Env,
    layout: Layout,
    device: torch.device,
    sequences: PackedSequences,
    windows: torch.Tensor | None,
    timeout: timedelta,
    plan: dict | None = None,
) -> None:
    """The run once the process group exists; returning drops the trainer (and its pipeline's
    pending work)."""
    world_size = env.world_size
    run_dir = Path(distributed.agree_on(os.path.abspath(cfg.run.dir)))
    console.log_to_run_dir(env.rank, run_dir)
    if env.rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    mesh = ParallelMesh(layout, device.type, timeout)
    log.info(
        "layout %s on %d %s rank(s); run dir %s (%s)",
        mesh.layout.as_dict(),
        world_size,
        device.type,
        run_dir,
        _resume_hint(cfg, run_dir),
    )
    # imported here, not at the top: the launcher, which starts the workers, builds no trainer, and
    # the trainer's parallelisms import dynamo (torch.compile's, and pipelining's)
    from composer3d.training.trainer import Trainer

    from_checkpoint = cfg.checkpoint.enabled and resumes_from_a_checkpoint(cfg.checkpoint, run_dir)
    trainer = Trainer(cfg, mesh, device, sequences, windows, from_checkpoint)
    trainer.run_info_extra = {"parallel_auto": plan} if plan else {}
    log.info(
        "model: %s parameters (%s of them on this rank); %s tokens a step (%d sequences of %d); %d "
        "steps",
        f"{trainer.num_params:,}",
        console.human_bytes(sum(local_bytes(p) for p in trainer.model.parameters())),
        f"{cfg.train.global_batch_size * cfg.train.seq_len:,}",
        cfg.train.global_batch_size,
        cfg.train.seq_len,
        cfg.train.steps,
    )
    checkpointer = None
    if cfg.checkpoint.enabled:
        checkpointer = Checkpointer(
            cfg.checkpoint,
            run_dir,
            trainer,
            OmegaConf.to_container(cfg, resolve=True),
            whole_model=partial(build_with_adapters, cfg.model, cfg.peft),
            extra_meta=base_meta(cfg),
        )
        trainer.step = checkpointer.resume()
    sink = MetricsSink(
        run_dir, cfg, enabled=env.rank == 0, total_steps=cfg.train.steps, resume_step=trainer.step
    )
    try:
        trainer.fit(sink, checkpointer)
    finally:
        trainer.close()
        sink.close()


def task(cfg: DictConfig) -> None:
    env = distributed.job_env()
    ours = launcher.started_by_local_launcher()
    if ours:
        launcher.die_with_launcher()
    run_dir = _run_dir(cfg)
    try:
        resolve_model_config(cfg.model)
        plan = None
        # every process plans alike: the launcher (for preflight) and each worker
        if cfg.parallel.auto:
            plan = choose_layout(
                cfg,
                env.world_size if env else cfg.launch.nproc_per_node,
                int(os.environ.get("LOCAL_WORLD_SIZE", cfg.launch.nproc_per_node)),
                distributed.device_type(cfg.launch.device),
            )
        if env is not None and not ours and cfg.launch.max_restarts:
            raise ConfigError(
                "launch.max_restarts: restarts are the local launcher's; this job was started by "
                "torchrun, SLURM or submitit. Use torchrun's --max-restarts (or the scheduler's "
                "requeue) instead"
            )
        if not cfg.checkpoint.enabled and cfg.checkpoint.resume not in ("auto", "none"):
            raise ConfigError(
                f"checkpoint.resume: {cfg.checkpoint.resume} would not be read: "
                "checkpoint.enabled=false turns off loading as well as saving, so training would "
                "start from scratch. Use checkpoint.enabled=true to continue from it, or leave "
                "checkpoint.resume out"
            )
        if env is None and distributed.in_submitit_job() and cfg.launch.nproc_per_node > 1:
            raise ConfigError(
                f"launch.nproc_per_node: {cfg.launch.nproc_per_node} processes asked for, but a "
                "submitit job's ranks are its tasks, one per device, and this job has one. Use "
                f"hydra.launcher.tasks_per_node={cfg.launch.nproc_per_node} (hydra/launcher=slurm "
                "sets it from launch.nproc_per_node)"
            )
        if env is None:
            # Fail here, in seconds, before starting any worker (or, in one process, before
            # training).
            preflight(cfg, cfg.launch.nproc_per_node)
        if env is None and (cfg.launch.nproc_per_node > 1 or cfg.launch.max_restarts):
            _launch(cfg, run_dir)
            return
        run(cfg, env, run_dir, plan)
    except ConfigError as error:
        line = f"composer3d: invalid configuration: {error}"
        _tell(env, line, every_rank=error.rank_specific)
        raise Exit(2, line) from None
    # every rank alike (a save's verdict is rank 0's, a load's fails everywhere)
    except CheckpointError as error:
        line = f"composer3d: {error}"
        _tell(env, line)
        raise Exit(error.EXIT_CODE, line) from None
    except TrainingDiverged as error:  # every rank sees the same values and exits alike
        line = f"composer3d: training stopped: {error}"
        _tell(env, line)
        raise Exit(3, line) from None
    except StoppedBySignal as stop:  # rank 0 has logged it; all ranks stopped at the same step
        if env is None or env.rank == 0:
            log.info("%s", _resume_hint(cfg, run_dir))
        sys.exit(stop.exit_code)
    except (
        KeyboardInterrupt,
        launcher.Interrupted,
    ) as error:  # one line, not a traceback per process
        signum = getattr(error, "signum", signal.SIGINT)
        # The launcher passed the signal on to its workers: they saved at their next step boundary
        # (within the agent's shutdown grace period) and exited as the signal asks (75: requeue;
        # SIGINT 130), as this does.
        code = StoppedBySignal.exit_code_for(signum) if signum in STOPPING else 128 + signum
        if env is None or (env.rank == 0 and not ours):  # a worker's launcher tells
            how = signal.Signals(signum).name + (" (Ctrl-C)" if signum == signal.SIGINT else "")
            print(
                f"composer3d: stopped by {how}; the last checkpoint is "
                f"{_last_checkpoint(cfg, run_dir)}; {_resume_hint(cfg, run_dir)}; exit code {code}",
                file=sys.stderr,
            )
        sys.exit(code)
    except Exception as error:
        if not ours:
            # a process of its own (one process, torchrun, SLURM): its traceback is the user's to
            # see
            raise
        # One of the local launcher's workers: a peer's death fails the others' collectives too, and
        # the console would show each one's traceback before the launcher's line. The traceback goes
        # to the run's log; the launcher prints the first failed rank's line.
        line = _crash_report(run_dir, env, error)
        launcher.report_to_launcher(line)
        raise Exit(1, line) from None


def _crash_report(run_dir: Path, env: distributed.Env, error: Exception) -> str:
    """Append ``error``'s traceback to run.dir/logs/rank<N>.log; the line that names it and where it
    is."""
    path = run_dir / "logs" / f"rank{env.rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(
            f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {env.rank} of {env.world_size}, pid "
            f"{os.getpid()}\n"
        )
        f.write("".join(traceback.format_exception(error)))
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return (
        f"composer3d: rank {env.rank} crashed: {type(error).__name__}: {first} (traceback in "
        f"{path})"
    )


def _run_dir(cfg: DictConfig) -> Path:
    """run.dir, resolved once (it may hold ${now:...}). In a sweep (-m) run.dir is the sweep's
    directory (hydra.sweep.dir follows it) and each job trains in its own: hydra.sweep.subdir in it,
    the job's number."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        # what the job's config.yaml says, and its workers are given
        cfg.run.dir = hydra_cfg.runtime.output_dir
    return Path(os.path.abspath(cfg.run.dir))


def _tell(env, line: str, every_rank: bool = False) -> None:
    """One line on stderr for the job. Under the local launcher, it prints the first failed rank's;
    under torchrun or SLURM, rank 0 prints what every rank found alike (one config, one corpus) and
    each rank what is its own."""
    if launcher.report_to_launcher(line):
        return
    if env is None or env.rank == 0 or every_rank:
        print(line, file=sys.stderr)


def _launch(cfg: DictConfig, run_dir: Path) -> None:
    """Start the local workers (the config and the data were checked by ``preflight``), holding
    run.dir's lock."""
    launcher.lock_run_dir(run_dir)
    overrides = [o for o in job_overrides() if not o.startswith("run.dir=")]
    overrides.append(f"run.dir={run_dir}")  # one run directory for all workers
    launcher.spawn_local_workers(
        cfg.launch.nproc_per_node,
        "composer3d.commands.train",
        overrides,
        max_restarts=cfg.launch.max_restarts,
        log_dir=run_dir / "logs",
        resume_hint=_resume_hint(cfg, run_dir),
    )


def _resume_hint(cfg: DictConfig, run_dir: Path) -> str:
    """What resumes this run; for a job of a sweep, the job alone in its own directory."""
    # a local launcher's worker: the launcher knows the sweep
    if os.environ.get(launcher.RESUME_HINT):
        return os.environ[launcher.RESUME_HINT]
    sweep = None
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        hydra_cfg = HydraConfig.get()
        sweep = (list(hydra_cfg.overrides.task), os.path.abspath(hydra_cfg.sweep.dir))
    return console.resume_hint(cfg.run.name, run_dir, sweep)


def _last_checkpoint(cfg: DictConfig, run_dir: Path) -> str:
    if not cfg.checkpoint.enabled:
        return "none (checkpoint.enabled=false)"
    found = committed_checkpoints(checkpoint_dir(cfg.checkpoint, run_dir))
    return str(found[0]) if found else "none"


if __name__ == "__main__":  # the local workers' command line (launcher.spawn_local_workers)
    from composer3d.commands.cli import train

    train()
