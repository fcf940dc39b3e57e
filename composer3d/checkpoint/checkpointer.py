"""The Checkpointer: saves a Trainer's whole state (async if asked), commits it atomically, prunes,
resumes."""

from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from composer3d.checkpoint import space
from composer3d.checkpoint.format import (
    FORMAT_VERSION,
    LOAD_FAILURES,
    META_FILE,
    STEP_DIR,
    CheckpointError,
    CheckpointNotSaved,
    SafeFileSystemReader,
    check_same_model,
    check_steps_left,
    checkpoint_dir,
    committed_checkpoints,
    failure_reason,
    load_model_weights,
    model_state,
    read_meta,
    set_model_state,
    verified_checkpoints,
)
from composer3d.checkpoint.rng import rng_state, set_rng_state
from composer3d.config.schema import CheckpointConfig
from composer3d.dtypes import DTYPES
from composer3d.errors import ConfigError

log = logging.getLogger("composer3d")
# A save that failed writing: DCP gathers every rank's write failure (the disk full: ENOSPC, or
# torch's "unexpected pos" from its zip writer) into one CheckpointException raised on every rank
# alike; our own files fail with OSError. (A peer that died mid-save surfaces as the process group's
# RuntimeError instead: a crash, handled as one.)
WRITE_FAILURES = (CheckpointException, OSError)


class Checkpointer:
    """Saves and restores a Trainer's whole state; see the module docstring for the on-disk
    contract."""

    def __init__(
        self,
        ckpt_cfg: CheckpointConfig,
        run_dir: Path,
        trainer,
        config_dict: dict,
        whole_model: Callable[[], nn.Module],
        extra_meta: dict | None = None,
    ):
        """``whole_model``: the model this run trains, whole and on meta (what a checkpoint it loads
        must hold); ``extra_meta``: recorded in every checkpoint's meta too (a peft run's base
        source)."""
        self.cfg = ckpt_cfg
        self.whole_model, self.extra_meta = whole_model, extra_meta or {}
        self.dir = checkpoint_dir(ckpt_cfg, run_dir)
        self.trainer = trainer
        self.config_dict = config_dict
        self.rank = dist.get_rank()
        # (future, partial dir, final dir) of an async save in flight
        self.pending: tuple | None = None
        # checkpoints whose load failed here: never kept, never chosen
        self.unreadable: set[Path] = set()
        self._expected_bytes: dict[
            bool, int
        ] = {}  # a save's state bytes, full (False) and model-only (True)
        self.async_group = None
        if ckpt_cfg.async_mode != "none":
            # Background writes run collectives; on their own gloo group they never interleave with
            # training's.
            timeout = timedelta(minutes=config_dict["launch"]["timeout_minutes"])
            self.async_group = dist.new_group(backend="gloo", timeout=timeout)
            self.stager = self._new_stager()

    def _new_stager(self) -> DefaultStager:
        pinned = self.cfg.async_mode == "async_pinned"
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=pinned,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=pinned,
            )
        )

    # -- state

    def _state_dict(
        self, model_only: bool, saving: bool = False, format_version: int = FORMAT_VERSION
    ) -> dict:
        """``saving``: ZeRO-1's fp32 masters in place of the parameters rounded to a narrower gather
        dtype; a load writes into the parameters themselves (``_masters_from_params``).
        ``format_version``: the checkpoint's (a load's), 1 with the optimizer's groups as one
        list."""
        t = self.trainer
        state = {"model": model_state(t.model)}
        if saving and t.sharder is not None:
            state["model"] = t.sharder.with_masters(state["model"])
        if not model_only:
            state["optim"] = t.optimizer_state_dict(by_parameter=format_version >= 2)
        return state

    def _meta(self, step: int, model_only: bool) -> dict:
        t = self.trainer
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "model_only": model_only,
            "config": self.config_dict,
            "layout": t.mesh.layout.as_dict(),
            "world_size": dist.get_world_size(),
        }
        meta.update(self.extra_meta)
        if not model_only:
            meta.update(
                {"data": t.loader.state_dict(), "scheduler": _jsonable(t.scheduler.state_dict())}
            )
            if t.scaler is not None:  # fp16: resume with the scale reached, not loss_scale_init
                meta["loss_scaler"] = t.scaler.state_dict()
        return meta

    # -- saving

    def due(self, step: int) -> bool:
        return (
            self.cfg.interval > 0 and step % self.cfg.interval == 0
        ) or step == self.trainer.total_steps

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is committed."""
        return self.dir / f"step-{step:08d}"

    def save(self, step: int) -> None:
        self.wait()  # at most one save in flight
        final = self.path(step)
        partial = final.with_name(final.name + ".partial")
        model_only = self.cfg.model_only_final and step == self.trainer.total_steps
        state = self._state_dict(model_only, saving=True)
        if model_only and self.cfg.export_dtype != "float32":
            dtype = DTYPES[self.cfg.export_dtype]
            state["model"] = {k: v.to(dtype) for k, v in state["model"].items()}
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        self._check_room(final, state, model_only)
        if self.rank == 0:
            (partial / "rng").mkdir(parents=True)
        dist.barrier()
        try:
            if not model_only:
                (partial / "rng" / f"rank{self.rank}.json").write_text(
                    json.dumps(rng_state(self.trainer.device))
                )
            if self.rank == 0:
                (partial / META_FILE).write_text(json.dumps(self._meta(step, model_only), indent=1))
            writer = self._storage_writer(partial, step)
            if self.async_group is None:
                dcp.save(state, storage_writer=writer)
            else:
                response = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=self.async_group,
                    async_stager=self.stager,
                )
        except WRITE_FAILURES as error:
            self._discard(partial, final, error)
        if self.async_group is None:
            self._commit(partial, final)
        else:
            if not _can_stage_again(self.stager):
                self.stager = self._new_stager()
            future = getattr(response, "upload_completion", response)
            self.pending = (future, partial, final)

    def _check_room(self, final: Path, state: dict, model_only: bool) -> None:
        """Refuse the save (on every rank alike: rank 0 decides) when checkpoint.dir lacks the room
        it needs. Nothing is pruned to make room: pruning follows a committed save, so the last good
        checkpoint stays until then."""
        estimate = self._expected_bytes.get(model_only)
        # the state's shapes do not change between saves: gathered once per kind
        if estimate is None:
            estimate = self._expected_bytes[model_only] = space.state_bytes(state)
        verdict = [None]
        if self.rank == 0:
            last = next(
                (
                    p
                    for p in verified_checkpoints(self.dir)
                    if read_meta(p)["model_only"] == model_only
                ),
                None,
            )
            needed = max(estimate, space.bytes_on_disk(last) if last else 0)
            free = space.free_bytes(self.dir)
            if free < needed:
                basis = f"the size of {last.name}" if last else "the model and optimizer state"
                verdict[0] = (
                    f"checkpoint.dir: no room for checkpoint {final.name} in {self.dir}: it needs "
                    f"about {space.readable(needed)} ({basis}), and {space.readable(free)} are "
                    "free. Free space there, keep fewer checkpoints "
                    f"(checkpoint.keep_last={self.cfg.keep_last} now; older ones are pruned only "
                    f"after a save), or set checkpoint.dir to a disk with room{self._last_good()}"
                )
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise CheckpointNotSaved(verdict[0])

    def _discard(self, partial: Path, final: Path, error: BaseException) -> None:
        """A save that failed anyway (the disk filled up while writing): its partial directory is
        removed, so no half checkpoint is left taking space, and the run stops with one line."""
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointNotSaved(
            f"checkpoint.dir: checkpoint {final.name} could not be written to {self.dir} "
            f"({failure_reason(error)}); its partial directory was removed{self._last_good()}. "
            "Free space there, lower checkpoint.keep_last, or set checkpoint.dir to a disk with "
            "room"
        ) from None

    def _last_good(self) -> str:
        good = next((p for p in verified_checkpoints(self.dir) if p not in self.unreadable), None)
        return f"; the last good checkpoint, {good}, is kept" if good else ""

    def _storage_writer(self, path: Path, step: int) -> FileSystemWriter:
        """Where DCP writes the save of ``step`` (tests replace it to crash a rank mid-save:
        tests/fault_injection)."""
        return FileSystemWriter(path)

    def poll(self) -> None:
        """Commit an async save whose writes have finished; never blocks."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            future, partial, final = self.pending
            self.pending = None
            try:
                future.result()  # re-raises a failed write
            except WRITE_FAILURES as error:
                self._discard(partial, final, error)
            self._commit(partial, final)

    def _commit(self, partial: Path, final: Path) -> None:
        if self.rank != 0:
            return
        # DCP's coordinator wrote .metadata only after gathering every rank's write results: all
        # data is on disk.
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        log.info("checkpoint saved: %s", final)
        self._prune(keep_newer_than=_step(final))

    def _prune(self, keep_newer_than: int) -> None:
        for stale in self.dir.glob("step-*.partial"):
            if int(stale.name[5:13]) < keep_newer_than:  # leftovers of crashed saves
                shutil.rmtree(stale, ignore_errors=True)
        if self.cfg.keep_last <= 0:
            return
        # Only checkpoints that pass verification count as kept: a corrupt one newer than the good
        # ones must not take the place of the newest good one. A corrupt one older than the last one
        # kept goes like any old one.
        good = [
            p for p in verified_checkpoints(self.dir) if p not in self.unreadable
        ]  # keep_last + 1, or few more
        kept = good[: self.cfg.keep_last]
        oldest_kept = _step(kept[-1]) if kept else keep_newer_than
        for old in committed_checkpoints(self.dir):
            if old not in kept and (old in good or _step(old) < oldest_kept):
                shutil.rmtree(old, ignore_errors=True)

    # -- resuming

    def resume(self) -> int:
        """Restore the newest usable checkpoint per ``checkpoint.resume``; returns the step to
        continue from."""
        mode = self.cfg.resume
        if mode == "none":
            return 0
        if mode == "auto":
            committed = committed_checkpoints(self.dir)
            if committed and read_meta(committed[0])["model_only"]:
                return self._finished(committed[0])
            for path in (
                p for p in verified_checkpoints(self.dir) if not read_meta(p)["model_only"]
            ):
                try:
                    return self._load(path)
                except ConfigError:
                    raise
                except LOAD_FAILURES as error:
                    self.unreadable.add(path)
                    log.error(
                        "checkpoint %s is unreadable (%s); falling back to the previous one",
                        path,
                        failure_reason(error),
                    )
            if any(not read_meta(p)["model_only"] for p in committed):
                raise CheckpointError(
                    f"no readable checkpoint in {self.dir} (tried {[p.name for p in committed]}); "
                    "fix or remove them, or start afresh in a new run.dir with "
                    "checkpoint.resume=none"
                )
            return 0
        path = Path(mode)
        if not (path / META_FILE).exists():
            raise ConfigError(
                f"checkpoint.resume: {path} is not a complete composer3d checkpoint (no "
                f"{META_FILE}). Give a step-N directory, or use auto/none"
            )
        try:
            return self._load(path)
        except ConfigError:
            raise
        except LOAD_FAILURES as error:
            raise CheckpointError(
                f"checkpoint {path} is unreadable ({failure_reason(error)})"
            ) from None

    def _finished(self, path: Path) -> int:
        """The newest checkpoint holds only the final weights (checkpoint.model_only_final): the run
        is done. Training on here, from an older checkpoint or from scratch, would overwrite or
        prune them: it is refused."""
        step = read_meta(path)["step"]
        if step != self.trainer.total_steps:
            raise ConfigError(
                f"train.steps: {path} holds the final weights of a finished run "
                f"(checkpoint.model_only_final, step {step}; no optimizer or data state to "
                f"continue from), and train.steps={self.trainer.total_steps} would train on in "
                "this directory, overwriting or pruning them. Use a new run.dir: with "
                f"checkpoint.resume={path} it starts from these weights, or with "
                "checkpoint.resume=<an older step-N directory> it continues that state"
            )
        log.info(
            "%s holds the final weights (checkpoint.model_only_final); nothing is loaded or "
            "written",
            path,
        )
        return step

    def _load(self, path: Path) -> int:
        meta = read_meta(path)
        check_same_model(path, self.whole_model())
        t = self.trainer
        if meta["model_only"]:  # pretrained weights: start training from them
            load_model_weights(t.model, path)
            _masters_from_params(t)
            log.info("loaded model weights from %s (step 0, fresh optimizer)", path)
            return 0
        check_steps_left(meta, t.total_steps, path)
        # First, before the expensive read: a changed corpus, seq_len or seed is a config problem,
        # not a bad file.
        t.loader.load_state_dict(meta["data"])
        state = self._state_dict(model_only=False, format_version=meta["format"])
        dcp.load(state, storage_reader=SafeFileSystemReader(path))
        set_model_state(t.model, state["model"])
        _masters_from_params(t)
        t.load_optimizer_state_dict(state["optim"])
        scheduler_state = meta["scheduler"]
        # torchao's optimizers keep lr a tensor
        if isinstance(t.optimizer.param_groups[0]["lr"], torch.Tensor):
            scheduler_state["base_lrs"] = [torch.tensor(lr) for lr in scheduler_state["base_lrs"]]
        t.scheduler.load_state_dict(scheduler_state)
        changed = t.restore_configured_settings()
        if changed:
            log.warning(
                "resuming with other optimizer settings than the checkpoint's: %s; this run's "
                "values apply from step %d on (as config.yaml says)",
                ", ".join(changed),
                meta["step"] + 1,
            )
        if t.scaler is not None and "loss_scaler" in meta:
            t.scaler.load_state_dict(meta["loss_scaler"])
        rng_file = path / "rng" / f"rank{self.rank}.json"
        if meta["world_size"] == dist.get_world_size() and rng_file.exists():
            set_rng_state(json.loads(rng_file.read_text()), t.device)
        log.info(
            "resumed from %s at step %d (saved under layout %s)", path, meta["step"], meta["layout"]
        )
        return meta["step"]


def _masters_from_params(trainer) -> None:
    """After a load into the parameters (fp32 values): ZeRO-1's masters take them, the parameters
    their rounding."""
    if trainer.sharder is not None:
        trainer.sharder.take_masters()


def _step(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def _jsonable(value: Any) -> Any:
    """Scheduler state as plain JSON: tensors (torchao keeps learning rates as tensors) become
    numbers."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _can_stage_again(stager: DefaultStager) -> bool:
    """False where torch closed the stager's copier at the end of its save (torch 2.11 and 2.12,
    pytorch/pytorch#183413): the next save through it would fail with ``KeyError: <class 'type'>``.
    Where it can, the stager is kept, and with it the pinned staging buffers it reuses from save to
    save."""
    copier = getattr(stager, "_state_dict_stager", None)
    return copier is None or bool(getattr(copier, "_deepcopy_dispatch", True))
