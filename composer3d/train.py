"""The ``composer3d-train`` entry point (also ``python -m composer3d.train``): config, launch, one run per rank.

Run alone it trains in this process; with ``launch.nproc_per_node > 1`` (or ``launch.max_restarts``) it checks the
config and the data once, then starts that many workers (``launcher``; each runs this module under torchrun's
environment variables). The step loop itself is the Trainer (``trainer.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from composer3d import console, distributed, launcher
from composer3d.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_dir,
    committed_checkpoints,
    resumes_from_a_checkpoint,
)
from composer3d.config import ConfigError, register_configs, resolve_model_config
from composer3d.data import PackedSequences, build_sequences, eval_windows
from composer3d.errors import StoppedBySignal, TrainingDiverged
from composer3d.hydra_entry import hydra_entry_point
from composer3d.layout import ParallelMesh, layout_from_degrees
from composer3d.metrics import MetricsSink, local_bytes
from composer3d.preflight import preflight
from composer3d.trainer import Trainer, prepare_rank

log = logging.getLogger("composer3d")


def run(cfg: DictConfig, env: distributed.Env | None, run_dir: Path) -> None:
    """Train in this process, as one rank of the job (or the only one)."""
    console.setup_logging(env.rank if env else 0)
    degrees, device = prepare_rank(cfg, env)
    # One job per run.dir, held by this process or by rank 0 of a torchrun/SLURM job (our workers: the launcher).
    if env is None or (env.rank == 0 and not launcher.started_by_local_launcher()):
        launcher.lock_run_dir(run_dir)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(cfg.train.seed)
    # Built before any collective: a bad corpus or tokenizer fails on every rank alike instead of hanging.
    sequences = build_sequences(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model)
    windows = eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len) if cfg.train.eval_every else None
    timeout = timedelta(minutes=cfg.launch.timeout_minutes)
    env = distributed.init_process_group(device, env, timeout, host_collectives=cfg.parallel.offload == "cpu")
    finished = False
    try:
        _train_in_group(cfg, env, degrees, device, sequences, windows, timeout)
        finished = True
    except StoppedBySignal:
        finished = True  # every rank stopped at the same step: shut down as after the last one
        raise
    finally:
        distributed.shut_down(finished)


def _train_in_group(cfg: DictConfig, env: distributed.Env, degrees: dict, device: torch.device,
                    sequences: PackedSequences, windows: torch.Tensor | None, timeout: timedelta) -> None:
    """The run once the process group exists; returning drops the trainer (and its pipeline's pending work)."""
    world_size = env.world_size
    run_dir = Path(distributed.agree_on(os.path.abspath(cfg.run.dir)))
    console.log_to_run_dir(env.rank, run_dir)
    if env.rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    mesh = ParallelMesh(layout_from_degrees(degrees), device.type, timeout)
    log.info("layout %s on %d %s rank(s); run dir %s (%s)", mesh.layout.as_dict(), world_size, device.type, run_dir,
             console.resume_hint(cfg.run.name, run_dir))
    from_checkpoint = cfg.checkpoint.enabled and resumes_from_a_checkpoint(cfg.checkpoint, run_dir)
    trainer = Trainer(cfg, mesh, device, sequences, windows, from_checkpoint)
    log.info("model: %s parameters (%s of them on this rank); %s tokens a step (%d sequences of %d); %d steps",
             f"{trainer.num_params:,}", console.human_bytes(sum(local_bytes(p) for p in trainer.model.parameters())),
             f"{cfg.train.global_batch_size * cfg.train.seq_len:,}", cfg.train.global_batch_size, cfg.train.seq_len,
             cfg.train.steps)
    checkpointer = None
    if cfg.checkpoint.enabled:
        checkpointer = Checkpointer(cfg.checkpoint, run_dir, trainer, OmegaConf.to_container(cfg, resolve=True))
        trainer.step = checkpointer.resume()
    sink = MetricsSink(run_dir, cfg, enabled=env.rank == 0, total_steps=cfg.train.steps, resume_step=trainer.step)
    try:
        trainer.fit(sink, checkpointer)
    finally:
        trainer.close()
        sink.close()


def _main(cfg: DictConfig) -> None:
    env = distributed.job_env()
    ours = launcher.started_by_local_launcher()
    if ours:
        launcher.die_with_launcher()
    run_dir = Path(os.path.abspath(cfg.run.dir))  # once: it may hold ${now:...}
    try:
        resolve_model_config(cfg.model)
        if env is not None and not ours and cfg.launch.max_restarts:
            raise ConfigError("launch.max_restarts: restarts are the local launcher's; this job was started by "
                              "torchrun or SLURM. Use torchrun's --max-restarts (or the scheduler's requeue) instead")
        if env is None:
            # Fail here, in seconds, before starting any worker (or, in one process, before training).
            preflight(cfg, cfg.launch.nproc_per_node)
        if env is None and (cfg.launch.nproc_per_node > 1 or cfg.launch.max_restarts):
            _launch(cfg, run_dir)
            return
        run(cfg, env, run_dir)
    except ConfigError as error:
        _tell(env, f"composer3d: invalid configuration: {error}", every_rank=error.rank_specific)
        sys.exit(2)
    except CheckpointError as error:
        print(f"composer3d: {error}", file=sys.stderr)
        sys.exit(1)
    except TrainingDiverged as error:  # every rank sees the same values and exits alike
        _tell(env, f"composer3d: training stopped: {error}")
        sys.exit(3)
    except StoppedBySignal:  # rank 0 has logged it; all ranks stopped at the same step
        if env is None or env.rank == 0:
            log.info("%s", console.resume_hint(cfg.run.name, run_dir))
        sys.exit(StoppedBySignal.EXIT_CODE)
    except (KeyboardInterrupt, launcher.Interrupted) as error:  # one line, not a traceback per process
        signum = getattr(error, "signum", signal.SIGINT)
        # SIGTERM/SIGUSR1 reached the workers too: they saved at their next step boundary (within the agent's
        # shutdown grace period), and the job is to be requeued, as when the workers got the signal themselves.
        stop = signum in (signal.SIGTERM, signal.SIGUSR1)
        if env is None or env.rank == 0:
            how = f"stopped by {signal.Signals(signum).name}" if signum != signal.SIGINT else "interrupted (Ctrl-C)"
            print(f"composer3d: {how}; the last checkpoint is {_last_checkpoint(cfg, run_dir)}; "
                  f"{console.resume_hint(cfg.run.name, run_dir)}", file=sys.stderr)
        sys.exit(StoppedBySignal.EXIT_CODE if stop else 128 + signum)


def _tell(env, line: str, every_rank: bool = False) -> None:
    """One line on stderr for the job. Under the local launcher, it prints the first failed rank's; under torchrun
    or SLURM, rank 0 prints what every rank found alike (one config, one corpus) and each rank what is its own."""
    if launcher.report_to_launcher(line):
        return
    if env is None or env.rank == 0 or every_rank:
        print(line, file=sys.stderr)


def _launch(cfg: DictConfig, run_dir: Path) -> None:
    """Start the local workers (the config and the data were checked by ``preflight``), holding run.dir's lock."""
    launcher.lock_run_dir(run_dir)
    # hydra.* overrides too (e.g. hydra.searchpath for the user's own recipes), as typed.
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("run.dir=")]
    overrides += list(HydraConfig.get().overrides.hydra)
    overrides.append(f"run.dir={run_dir}")  # one run directory for all workers
    launcher.spawn_local_workers(cfg.launch.nproc_per_node, "composer3d.train", overrides,
                                 max_restarts=cfg.launch.max_restarts, log_dir=run_dir / "logs",
                                 resume_hint=console.resume_hint(cfg.run.name, run_dir))


def _last_checkpoint(cfg: DictConfig, run_dir: Path) -> str:
    if not cfg.checkpoint.enabled:
        return "none (checkpoint.enabled=false)"
    found = committed_checkpoints(checkpoint_dir(cfg.checkpoint, run_dir))
    return str(found[0]) if found else "none"


# pkg://: the configs are the top-level conf/ mapped into the package (pyproject.toml); under `python -m` (workers,
# torchrun) Hydra would look for a relative config_path next to this file, where an editable install has none.
main = hydra_entry_point(_main, config_path="pkg://composer3d.conf", config_name="train")


register_configs()

if __name__ == "__main__":
    main()
