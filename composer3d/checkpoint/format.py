"""The checkpoint directory format: what a committed checkpoint is, reading it safely, and the
checks a resume makes before loading one (complete, same model, steps left)."""

from __future__ import annotations

import io
import json
import logging
import pickle
import re
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from composer3d.config.schema import CheckpointConfig
from composer3d.errors import ConfigError
from composer3d.parallel.pipeline.tied import (
    from_checkpoint_names,
    shared_second_names,
    to_checkpoint_names,
)

log = logging.getLogger("composer3d")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why. Exit code 1."""

    EXIT_CODE = 1


class CheckpointNotSaved(CheckpointError):
    """A save found no room for the checkpoint, or failed writing it (its partial directory removed;
    the last good checkpoint kept). Exit code 74 (sysexits' EX_IOERR), not retried by a restart: it
    would fail the same way."""

    EXIT_CODE = 74


# DCP gathers every rank's failure into one CheckpointException, raised on all ranks alike (a
# BaseException).
LOAD_FAILURES = (Exception, CheckpointException)


def failure_reason(error: BaseException) -> str:
    """One line for the console; the per-rank tracebacks DCP embeds go to the rank logs."""
    log.debug("checkpoint load failure", exc_info=error)
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {_one_line(exc)}" for rank, (exc, _) in sorted(error.failures.items())
        )
    return _one_line(error)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


# 2: the optimizer's parameter groups saved by parameter (``optim.build.groups_by_parameter``); 1:
# as one list, which under pipeline parallel each stage wrote whole (resumed under PP, read as is)
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
META_FILE = "composer3d.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")


# ------------------------------------------------------------------------------------- safe reading


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index and nothing else: DCP's metadata classes, sizes, dtypes
    and paths."""

    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (
            module.startswith("torch.distributed.checkpoint.")
            or is_dtype
            or (module, name) in self.ALLOWED
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not DCP metadata; refusing "
            "to load it"
        )


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
    if meta.get("format") not in READABLE_FORMATS:
        raise ValueError(
            f"{path}: checkpoint format {meta.get('format')} is not one of {READABLE_FORMATS}"
        )
    return meta


def check_complete(path: Path) -> None:
    """Refuse (ConfigError) a checkpoint whose DCP index or data files are missing or shorter than
    the index says: a copy cut short, or a disk that filled up. Reads only the index and file
    sizes."""
    problem = incomplete(path)
    if problem is not None:
        raise ConfigError(
            f"checkpoint.resume: {path} {problem}. Give another step-N directory, or start afresh "
            "in a new run.dir with checkpoint.resume=none"
        )


def incomplete(path: Path) -> str | None:
    """What makes a checkpoint fail verification (its index unreadable, a data file missing or
    shorter than the index says), or None where it is whole. Reads only the index and file sizes."""
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    # missing, truncated or foreign .metadata: unpickling fails in many ways
    except Exception as error:
        return f"has no readable DCP index (.metadata: {failure_reason(error)})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {have} bytes"
            return f"is incomplete: {name} {state}, its index needs {size}"
    return None


def verified_checkpoints(directory: Path) -> Iterator[Path]:
    """The committed checkpoints in ``directory`` that pass verification (``incomplete``), newest
    first, verified as they are asked for; each that fails is logged. What resume=auto may choose,
    and what checkpoint.keep_last counts."""
    for path in committed_checkpoints(directory):
        problem = incomplete(path)
        if problem is None:
            yield path
        elif path not in _reported:  # once, not at every save that prunes around it
            _reported.add(path)
            log.error(
                "checkpoint %s %s: it is never resumed from nor counted by checkpoint.keep_last",
                path,
                problem,
            )


_reported: set[Path] = set()  # checkpoints this process has said fail verification


def committed_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = [
        p
        for p in directory.iterdir()
        if p.is_dir() and STEP_DIR.match(p.name) and (p / META_FILE).exists()
    ]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def model_state(model: torch.nn.Module) -> dict:
    """The model's FQN-keyed state as a checkpoint holds it: a tied weight once, under the
    embedding's name; frozen parameters (a peft run's base, rebuilt from its source: ``peft_base``)
    left out."""
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return to_checkpoint_names(model, state)


def set_model_state(model: torch.nn.Module, state: dict) -> None:
    """``model_state`` loaded back: every parameter, or with a frozen base only the others."""
    frozen = any(not p.requires_grad for p in model.parameters())
    set_model_state_dict(
        model, from_checkpoint_names(model, state), options=StateDictOptions(strict=not frozen)
    )


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load only the model part of a checkpoint (any layout) into ``model`` (sharded or not)."""
    state = {"model": model_state(model)}
    dcp.load(state, storage_reader=SafeFileSystemReader(path))
    set_model_state(model, state["model"])


def checkpoint_dir(ckpt_cfg: CheckpointConfig, run_dir: Path) -> Path:
    return Path(ckpt_cfg.dir) if ckpt_cfg.dir else run_dir / "checkpoints"


def resumes_from_a_checkpoint(ckpt_cfg: CheckpointConfig, run_dir: Path) -> bool:
    """Whether ``Checkpointer.resume`` will load a checkpoint's weights (or stop with an error
    trying): with resume=auto, whenever the directory holds a committed checkpoint (a finished run's
    final weights load nothing, but it trains nothing either)."""
    if ckpt_cfg.resume != "auto":
        return ckpt_cfg.resume != "none"
    return bool(committed_checkpoints(checkpoint_dir(ckpt_cfg, run_dir)))


def check_steps_left(meta: dict, total_steps: int, path: Path) -> None:
    if meta["step"] > total_steps:
        raise ConfigError(
            f"train.steps: the checkpoint {path} is at step {meta['step']}, past "
            f"train.steps={total_steps}: there is nothing to train. Raise train.steps above "
            f"{meta['step']}, or start afresh with checkpoint.resume=none"
        )


def check_same_model(
    path: Path, model: nn.Module, remedy: str = "Resume with its model config (see {meta})"
) -> None:
    """Refuse a checkpoint whose model tensors have other names or shapes than ``model`` (the whole
    model the run builds, on meta: with its LoRA adapters under peft,
    ``peft.apply.build_with_adapters``), naming the first that differs with both shapes; ``remedy``
    ends the line (``{meta}``: its recorded config).

    What the checkpoint holds is read from its own DCP index, not rebuilt from its config: for
    model=hf that would need the directory it was trained from, which may have moved since."""
    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    # A tied head is stored once, as the embedding (checkpoints before that also held it under its
    # own name); a frozen base not at all (checkpoints before that held it: not compared, it is
    # rebuilt from its source).
    skipped = {
        *shared_second_names(model),
        *(n for n, p in model.named_parameters() if not p.requires_grad),
    }
    before = {
        key[len("model.") :]: tuple(entry.size)
        for key, entry in stored.items()
        if key.startswith("model.")
        and hasattr(entry, "size")
        and key[len("model.") :] not in skipped
    }
    now = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in skipped}
    if before != now:
        # One both hold first: its two shapes say the most.
        differing = sorted(
            (k for k in set(before) | set(now) if before.get(k) != now.get(k)),
            key=lambda k: (k not in before or k not in now, k),
        )
        first = differing[0]
        raise ConfigError(
            f"model: the checkpoint {path} holds a model of another shape ({len(differing)} "
            f"parameters differ, e.g. {first}: {_shape(before.get(first))} in the checkpoint, "
            f"{_shape(now.get(first))} in this config). " + remedy.format(meta=path / META_FILE)
        )


def _shape(size: tuple | None) -> str:
    return "absent" if size is None else "(" + ", ".join(map(str, size)) + ")"
