"""The model a run trains or evaluates: built on meta, parallelized, then initialized or loaded into its shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from composer3d.layout import ParallelMesh
from composer3d.models import MODEL_REGISTRY, build_model, count_params
from composer3d.models.init import materialize
from composer3d.parallel import parallelize
from composer3d.parallel.pipeline import StageModule


@dataclass
class ParallelModel:
    model: nn.Module
    stages: list[StageModule]  # this rank's pipeline stages ([] without PP)
    num_params: int  # of the whole model, before any split


def build_parallel_model(cfg, mesh: ParallelMesh, device: torch.device) -> ParallelModel:
    spec = MODEL_REGISTRY[cfg.model.name]
    model = build_model(cfg.model)
    num_params = count_params(model)
    stages = parallelize(model, spec, mesh, cfg, device)
    weights = spec.pretrained_weights(cfg.model)
    materialize(model, device, cfg.train.seed, fsdp_roots=stages, init_params=weights is None)
    if weights is not None:
        from composer3d.models.hf import load_pretrained

        load_pretrained(model, weights)
    return ParallelModel(model, stages, num_params)
