"""Distributed checkpoints with DCP: save, async save, atomic commit, pruning, and resume (also under another layout).

A checkpoint is a directory ``<checkpoint.dir>/step-<8 digits>/`` holding
  - DCP files of ``{"model": <model state>, "optim": <optimizer state>}`` keyed by parameter name (FQN), as
    ``torch.distributed.checkpoint.state_dict`` gives them: DTensor shards that DCP re-slices for any layout;
  - ``composer3d.json``: ours, plain JSON — step, config, data-loader and LR-schedule state, layout;
  - ``rng/rank<N>.json``: each rank's RNG states (restored only when the world size is unchanged).
It is written as ``step-N.partial`` and renamed to ``step-N`` by rank 0 only after every rank's data and the
DCP metadata are on disk, so a crash mid-save leaves at most a ``.partial`` directory, never a half checkpoint
that looks whole. Loading never unpickles arbitrary objects: DCP's tensor files are read with
``weights_only``, its pickled index through a whitelist of DCP's own metadata classes, ours is JSON.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import pickle
import re
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from composer3d.config import ConfigError, ModelConfig
from composer3d.dtypes import DTYPES
from composer3d.models import build_model
from composer3d.optim import restore_configured_settings

log = logging.getLogger("composer3d")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


# DCP gathers every rank's failure into one CheckpointException, raised on all ranks alike (a BaseException).
LOAD_FAILURES = (Exception, CheckpointException)


def _reason(error: BaseException) -> str:
    """One line for the console; the per-rank tracebacks DCP embeds go to the rank logs."""
    log.debug("checkpoint load failure", exc_info=error)
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {_one_line(exc)}" for rank, (exc, _) in sorted(error.failures.items()))
    return _one_line(error)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__

FORMAT_VERSION = 1
META_FILE = "composer3d.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")


# ------------------------------------------------------------------------------------------ safe reading

class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index and nothing else: DCP's metadata classes, sizes, dtypes and paths."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module.startswith("torch.distributed.checkpoint.") or is_dtype or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not DCP metadata; "
                                     "refusing to load it")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_meta(path: Path) -> dict:
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')} is not {FORMAT_VERSION}")
    return meta


def check_complete(path: Path) -> None:
    """Refuse (ConfigError) a checkpoint whose DCP index or data files are missing or shorter than the index says:
    a copy cut short, or a disk that filled up. Reads only the index and file sizes."""
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except Exception as error:  # missing, truncated or foreign .metadata: unpickling fails in many ways
        raise ConfigError(f"checkpoint.resume: {path} has no readable DCP index (.metadata: {_reason(error)}). Give "
                          "another step-N directory, or start afresh with checkpoint.resume=none") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {have} bytes"
            raise ConfigError(f"checkpoint.resume: {path} is incomplete: {name} {state}, its index needs {size}. "
                              "Give another step-N directory, or start afresh with checkpoint.resume=none")


def committed_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / META_FILE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load only the model part of a checkpoint (any layout) into ``model`` (sharded or not)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=SafeFileSystemReader(path))
    set_model_state_dict(model, state["model"])


# ------------------------------------------------------------------------------------------ RNG states

def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device: torch.device) -> dict:
    state = {"cpu": _encode(torch.get_rng_state())}
    if device.type != "cpu":
        state[device.type] = _encode(torch.get_device_module(device.type).get_rng_state())
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_decode(state["cpu"]))
    if device.type != "cpu" and device.type in state:
        torch.get_device_module(device.type).set_rng_state(_decode(state[device.type]))


# ------------------------------------------------------------------------------------------ the checkpointer

def checkpoint_dir(ckpt_cfg, run_dir: Path) -> Path:
    return Path(ckpt_cfg.dir) if ckpt_cfg.dir else run_dir / "checkpoints"


def resumes_from_a_checkpoint(ckpt_cfg, run_dir: Path) -> bool:
    """Whether ``Checkpointer.resume`` will load a checkpoint's weights (or stop with an error trying): with
    resume=auto, whenever the directory holds a committed checkpoint (a finished run's final weights load nothing,
    but it trains nothing either)."""
    if ckpt_cfg.resume != "auto":
        return ckpt_cfg.resume != "none"
    return bool(committed_checkpoints(checkpoint_dir(ckpt_cfg, run_dir)))


class Checkpointer:
    """Saves and restores a Trainer's whole state; see the module docstring for the on-disk contract."""

    def __init__(self, ckpt_cfg, run_dir: Path, trainer, config_dict: dict):
        self.cfg = ckpt_cfg
        self.dir = checkpoint_dir(ckpt_cfg, run_dir)
        self.trainer = trainer
        self.config_dict = config_dict
        self.rank = dist.get_rank()
        self.pending: tuple | None = None  # (future, partial dir, final dir) of an async save in flight
        self.async_group = None
        if ckpt_cfg.async_mode != "none":
            # Background writes run collectives; on their own gloo group they never interleave with training's.
            timeout = timedelta(minutes=config_dict["launch"]["timeout_minutes"])
            self.async_group = dist.new_group(backend="gloo", timeout=timeout)
            pinned = ckpt_cfg.async_mode == "async_pinned"
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=pinned))

    # -- state

    def _state_dict(self, model_only: bool) -> dict:
        t = self.trainer
        state = {"model": get_model_state_dict(t.model)}
        if not model_only:
            state["optim"] = t.optimizer_state_dict()
        return state

    def _meta(self, step: int, model_only: bool) -> dict:
        t = self.trainer
        meta = {"format": FORMAT_VERSION, "step": step, "model_only": model_only, "config": self.config_dict,
                "layout": t.mesh.layout.as_dict(), "world_size": dist.get_world_size()}
        if not model_only:
            meta.update({"data": t.loader.state_dict(), "scheduler": _jsonable(t.scheduler.state_dict())})
            if t.scaler is not None:  # fp16: resume with the scale reached, not loss_scale_init
                meta["loss_scaler"] = t.scaler.state_dict()
        return meta

    # -- saving

    def due(self, step: int) -> bool:
        return (self.cfg.interval > 0 and step % self.cfg.interval == 0) or step == self.trainer.total_steps

    def save(self, step: int) -> None:
        self.wait()  # at most one save in flight
        final = self.dir / f"step-{step:08d}"
        partial = final.with_name(final.name + ".partial")
        model_only = self.cfg.model_only_final and step == self.trainer.total_steps
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            (partial / "rng").mkdir(parents=True)
        dist.barrier()
        if not model_only:
            (partial / "rng" / f"rank{self.rank}.json").write_text(json.dumps(rng_state(self.trainer.device)))
        state = self._state_dict(model_only)
        if model_only and self.cfg.export_dtype != "float32":
            dtype = DTYPES[self.cfg.export_dtype]
            state["model"] = {k: v.to(dtype) for k, v in state["model"].items()}
        if self.rank == 0:
            (partial / META_FILE).write_text(json.dumps(self._meta(step, model_only), indent=1))
        writer = self._storage_writer(partial, step)
        if self.async_group is None:
            dcp.save(state, storage_writer=writer)
            self._commit(partial, final)
        else:
            response = dcp.async_save(state, storage_writer=writer, process_group=self.async_group,
                                      async_stager=self.stager)
            future = getattr(response, "upload_completion", response)
            self.pending = (future, partial, final)

    def _storage_writer(self, path: Path, step: int) -> FileSystemWriter:
        """Where DCP writes the save of ``step`` (tests replace it to crash a rank mid-save: tests/fault_injection)."""
        return FileSystemWriter(path)

    def poll(self) -> None:
        """Commit an async save whose writes have finished; never blocks."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            future, partial, final = self.pending
            self.pending = None
            future.result()  # re-raises a failed write
            self._commit(partial, final)

    def _commit(self, partial: Path, final: Path) -> None:
        if self.rank != 0:
            return
        # DCP's coordinator wrote .metadata only after gathering every rank's write results: all data is on disk.
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        log.info("checkpoint saved: %s", final)
        self._prune(keep_newer_than=int(STEP_DIR.match(final.name).group(1)))

    def _prune(self, keep_newer_than: int) -> None:
        for stale in self.dir.glob("step-*.partial"):
            if int(stale.name[5:13]) < keep_newer_than:  # leftovers of crashed saves
                shutil.rmtree(stale, ignore_errors=True)
        if self.cfg.keep_last > 0:
            for old in committed_checkpoints(self.dir)[self.cfg.keep_last:]:
                shutil.rmtree(old, ignore_errors=True)

    # -- resuming

    def resume(self) -> int:
        """Restore the newest usable checkpoint per ``checkpoint.resume``; returns the step to continue from."""
        mode = self.cfg.resume
        if mode == "none":
            return 0
        if mode == "auto":
            committed = committed_checkpoints(self.dir)
            if committed and read_meta(committed[0])["model_only"]:
                return self._finished(committed[0])
            candidates = [p for p in committed if not read_meta(p)["model_only"]]
            for path in candidates:
                try:
                    return self._load(path)
                except ConfigError:
                    raise
                except LOAD_FAILURES as error:
                    log.error("checkpoint %s is unreadable (%s); falling back to the previous one", path, _reason(error))
            if candidates:
                raise CheckpointError(f"no readable checkpoint in {self.dir} (tried {[p.name for p in candidates]}); "
                                      "fix or remove them, or start afresh with checkpoint.resume=none")
            return 0
        path = Path(mode)
        if not (path / META_FILE).exists():
            raise ConfigError(f"checkpoint.resume: {path} is not a complete composer3d checkpoint (no {META_FILE}). "
                              "Give a step-N directory, or use auto/none")
        try:
            return self._load(path)
        except ConfigError:
            raise
        except LOAD_FAILURES as error:
            raise CheckpointError(f"checkpoint {path} is unreadable ({_reason(error)})") from None

    def _finished(self, path: Path) -> int:
        """The newest checkpoint holds only the final weights (checkpoint.model_only_final): the run is done. Training
        on here, from an older checkpoint or from scratch, would overwrite or prune them: it is refused."""
        step = read_meta(path)["step"]
        if step != self.trainer.total_steps:
            raise ConfigError(
                f"train.steps: {path} holds the final weights of a finished run (checkpoint.model_only_final, step "
                f"{step}; no optimizer or data state to continue from), and train.steps={self.trainer.total_steps} "
                "would train on in this directory, overwriting or pruning them. Use a new run.dir: with "
                f"checkpoint.resume={path} it starts from these weights, or with checkpoint.resume=<an older step-N "
                "directory> it continues that state")
        log.info("%s holds the final weights (checkpoint.model_only_final); nothing is loaded or written", path)
        return step

    def _load(self, path: Path) -> int:
        meta = read_meta(path)
        check_same_model(path, self.config_dict["model"])
        t = self.trainer
        if meta["model_only"]:  # pretrained weights: start training from them
            load_model_weights(t.model, path)
            log.info("loaded model weights from %s (step 0, fresh optimizer)", path)
            return 0
        check_steps_left(meta, t.total_steps, path)
        # First, before the expensive read: a changed corpus, seq_len or seed is a config problem, not a bad file.
        t.loader.load_state_dict(meta["data"])
        state = self._state_dict(model_only=False)
        dcp.load(state, storage_reader=SafeFileSystemReader(path))
        set_model_state_dict(t.model, state["model"])
        t.load_optimizer_state_dict(state["optim"])
        scheduler_state = meta["scheduler"]
        if isinstance(t.optimizer.param_groups[0]["lr"], torch.Tensor):  # torchao's optimizers keep lr a tensor
            scheduler_state["base_lrs"] = [torch.tensor(lr) for lr in scheduler_state["base_lrs"]]
        t.scheduler.load_state_dict(scheduler_state)
        changed = restore_configured_settings(t.optimizer, t.scheduler, t.optimizer_settings)
        if changed:
            log.warning("resuming with other optimizer settings than the checkpoint's: %s; this run's values apply "
                        "from step %d on (as config.yaml says)", ", ".join(changed), meta["step"] + 1)
        if t.scaler is not None and "loss_scaler" in meta:
            t.scaler.load_state_dict(meta["loss_scaler"])
        rng_file = path / "rng" / f"rank{self.rank}.json"
        if meta["world_size"] == dist.get_world_size() and rng_file.exists():
            set_rng_state(json.loads(rng_file.read_text()), t.device)
        log.info("resumed from %s at step %d (saved under layout %s)", path, meta["step"], meta["layout"])
        return meta["step"]


def _jsonable(value: Any) -> Any:
    """Scheduler state as plain JSON: tensors (torchao keeps learning rates as tensors) become numbers."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def check_steps_left(meta: dict, total_steps: int, path: Path) -> None:
    if meta["step"] > total_steps:
        raise ConfigError(f"train.steps: the checkpoint {path} is at step {meta['step']}, past train.steps="
                          f"{total_steps}: there is nothing to train. Raise train.steps above {meta['step']}, "
                          "or start afresh with checkpoint.resume=none")


def check_same_model(path: Path, current: dict) -> None:
    """Refuse a checkpoint whose model tensors have other names or shapes (fields like max_seq_len may change).

    What the checkpoint holds is read from its own DCP index, not rebuilt from its config: for model=hf that would
    need the directory it was trained from, which may have moved since."""
    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    before = {key[len("model."):]: tuple(entry.size) for key, entry in stored.items()
              if key.startswith("model.") and hasattr(entry, "size")}
    model = build_model(OmegaConf.merge(OmegaConf.structured(ModelConfig), current))
    now = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if before != now:
        differing = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        raise ConfigError(f"model: the checkpoint {path} holds a model of another shape ({len(differing)} parameters "
                          f"differ, e.g. {differing[:3]}). Resume with its model config (see {path / META_FILE})")
