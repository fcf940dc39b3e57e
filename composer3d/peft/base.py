"""A peft run's frozen base: not training state, so a LoRA/QLoRA checkpoint holds only what trains
(the adapters, ``peft.modules_to_save``) and records where the base came from; every load rebuilds
it from there.

The source is one of: a full composer3d checkpoint (``peft.base_from``), the pretrained weights in
``model.path`` (``model=hf``, ``model.pretrained``), or the initialization from ``train.seed``. Each
gives the same tensors every time, and QLoRA quantizes them whole before cutting each rank's rows,
so the rebuilt base is bit-identical to the one the adapters trained on, under any layout.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from composer3d.checkpoint.format import (
    META_FILE,
    SafeFileSystemReader,
    check_same_model,
    incomplete,
    read_meta,
)
from composer3d.config.peft_schema import PeftConfig
from composer3d.config.schema import ModelConfig, TrainConfig
from composer3d.errors import ConfigError
from composer3d.models import MODEL_REGISTRY, ModelSpec, build_model
from composer3d.models.init import materialize
from composer3d.peft.apply import apply_peft
from composer3d.peft.lora import is_nf4

# composer3d.json's key for the record
BASE_KEY = "peft_base"


def base_meta(cfg: TrainConfig) -> dict:
    """What a peft run's checkpoints record of their base, which they do not hold (nothing without
    peft)."""
    return {BASE_KEY: base_source(cfg)} if cfg.peft.method != "none" else {}


def base_source(config: dict | TrainConfig) -> dict:
    """Where the run ``config`` describes takes its base from: ``{"checkpoint": dir}``,
    ``{"pretrained": dir}`` or ``{"seed": n}``."""
    base_from = (config.get("peft") or {}).get("base_from")
    if base_from:
        return {"checkpoint": str(base_from)}
    model = config["model"]
    if not isinstance(model, DictConfig):
        model = OmegaConf.merge(OmegaConf.structured(ModelConfig), model)
    weights = MODEL_REGISTRY[model.name].pretrained_weights(model)
    return (
        {"pretrained": str(weights)}
        if weights is not None
        else {"seed": int(config["train"]["seed"])}
    )


def recorded_base(meta: dict) -> dict:
    """The base a checkpoint's adapters trained on: its record, or (checkpoints from before the
    record, which held the base too) what its config describes."""
    return meta.get(BASE_KEY) or base_source(meta["config"])


def checkpoint_base(peft: PeftConfig, resume: str) -> dict | None:
    """The base of the peft checkpoint ``resume`` that composer3d-eval or -generate loads (None:
    none to rebuild, or the config's own). Its record, not the config: those commands' train.seed is
    not the run's."""
    if peft.method == "none" or resume in ("auto", "none"):
        return None
    return recorded_base(read_meta(Path(resume)))


def describe(base: dict) -> str:
    if "checkpoint" in base:
        return f"the full checkpoint {base['checkpoint']} (peft.base_from)"
    if "pretrained" in base:
        return f"the pretrained weights in {base['pretrained']} (model.path)"
    return f"the initialization from train.seed={base['seed']}"


def check_same_base(path: Path, meta: dict, config: TrainConfig) -> None:
    """Resuming ``path`` rebuilds its base from this run's config: the same source, or one clear
    error naming the key that would give it. (``model.path`` may name another directory: the weights
    may have moved.)"""
    before, now = recorded_base(meta), base_source(config)
    if before.keys() == now.keys() and ("pretrained" in now or before == now):
        return
    remedy = (
        "set peft.base_from={checkpoint}"
        if "checkpoint" in before
        else "set model.path to the directory holding {pretrained} (model.pretrained=true)"
        if "pretrained" in before
        else "use train.seed={seed} and no peft.base_from"
    ).format(**before)
    raise ConfigError(
        f"checkpoint.resume: {path}'s adapters were trained on {describe(before)}, and this run's "
        f"config builds its base from {describe(now)}. To resume, {remedy}"
    )


def check_base_from(peft: PeftConfig, model: ModelConfig) -> None:
    """Before launch: ``peft.base_from`` is a complete full checkpoint of this run's ``model``."""
    path = Path(peft.base_from)
    if not (path / META_FILE).is_file():
        raise ConfigError(
            f"peft.base_from: {path} is not a composer3d checkpoint (no {META_FILE}). Name a "
            "step-N directory of a run trained without peft (its model weights become the frozen "
            "base)"
        )
    try:
        meta = read_meta(path)
    except ValueError as error:
        raise ConfigError(f"peft.base_from: {path / META_FILE} is unreadable ({error})") from None
    method = (meta["config"].get("peft") or {}).get("method", "none")
    if method != "none":
        raise ConfigError(
            f"peft.base_from: {path} is a peft={method} checkpoint: it holds adapters, not a base. "
            f"Continue it with checkpoint.resume={path}, or name the base it trained on: "
            f"{describe(recorded_base(meta))}"
        )
    problem = incomplete(path)
    if problem is not None:
        raise ConfigError(f"peft.base_from: {path} {problem}. Name a complete checkpoint")
    check_same_model(
        path,
        build_model(model),
        remedy="Set peft.base_from to a checkpoint of this run's model, or the model.* keys as "
        "{meta} records them",
    )


def fill_base(
    model: torch.nn.Module,
    spec: ModelSpec,
    model_cfg: ModelConfig,
    base: dict,
    seed: int,
    device: torch.device,
    **placement: Any,
) -> None:
    """Allocate ``model`` (a peft model on meta) on ``device`` and fill its base from ``base``, its
    adapters fresh from ``seed`` (a base initialized from a seed: that seed). ``placement``:
    ``materialize``'s fsdp_roots, compute_device and aliases."""
    read = tensor_reader(Path(base["checkpoint"])) if "checkpoint" in base else None
    weights = None if read is not None else spec.pretrained_weights(model_cfg)
    materialize(
        model, device, base.get("seed", seed), init_params=weights is None, read=read, **placement
    )
    if weights is not None:
        spec.load_pretrained(model, weights)


class _IndexedReader(SafeFileSystemReader):
    """A reader for many loads of one checkpoint: its index unpickled on the first, kept for the
    others (each load still takes its own id)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        if not hasattr(self, "_index"):
            self._index = super().read_metadata(*args, **kwargs)
        self._index.storage_meta.load_id = self.load_id
        return self._index


def tensor_reader(path: Path) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """Whole model tensors of checkpoint ``path`` by name, each read as asked (one at a time,
    whatever layout saved it; no collective, so pipeline stages may each read their own). The
    checkpoint's index is read once: each load would otherwise unpickle it again, every saved chunk
    of every tensor, once per tensor."""
    reader = _IndexedReader(path)
    stored = reader.read_metadata().state_dict_metadata

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        entry = stored.get(f"model.{name}")
        if entry is None or tuple(getattr(entry, "size", ())) != shape:
            raise ConfigError(
                f"peft.base_from: {path} holds no tensor model.{name} of shape {shape}. Name a "
                "checkpoint of this model (trained without peft)"
            )
        state = {"model": {name: torch.empty(shape, dtype=entry.properties.dtype)}}
        # "assuming the intent is to load in a single process": it is
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
        return state["model"][name].float()

    return read


def whole_base(meta: dict) -> dict[str, torch.Tensor]:
    """The frozen tensors of a peft checkpoint's model, rebuilt whole from its recorded source in
    this process on the CPU (composer3d-convert's export): by their names in the LoRA model, QLoRA's
    NF4 weights dequantized (fp32)."""
    config = meta["config"]
    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), config["model"])
    model = build_model(model_cfg)
    apply_peft(model, OmegaConf.merge(OmegaConf.structured(PeftConfig), config["peft"]))
    fill_base(
        model,
        MODEL_REGISTRY[model_cfg.name],
        model_cfg,
        recorded_base(meta),
        int(config["train"]["seed"]),
        torch.device("cpu"),
    )
    return {
        name: (p.get_original_weight() if is_nf4(p) else p).detach()
        for name, p in model.named_parameters()
        if not p.requires_grad
    }


def build_with_adapters(model: dict | DictConfig, peft: dict | DictConfig | None) -> nn.Module:
    """The whole model a run of these ``model`` and ``peft`` sections trains, on meta: with LoRA's
    adapters and wrapped base linears, whose names are part of its checkpoints'."""
    built = build_model(OmegaConf.merge(OmegaConf.structured(ModelConfig), model))
    if peft is not None and peft.get("method", "none") != "none":
        apply_peft(built, OmegaConf.merge(OmegaConf.structured(PeftConfig), peft))
    return built
