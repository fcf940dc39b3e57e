"""Expert parallel and the tensor-parallel split of mixture-of-experts layers, for any model family.

A model names its routed experts (``ComposerModel.routed_experts``: modules whose own weights are
stacked by expert on dim 0); expert parallel shards them by expert over the ``ep`` ranks and, where
a module says how (``tp_dims``, composer3d's ``models.moe`` experts: w1, w3 on dim 1, w2 on dim 2),
tensor parallel by hidden width; with both they are 2-D DTensors on the (ep, tp) mesh. Experts
without ``tp_dims`` (transformers') stay whole on every tp rank. composer3d's MoE layers also split
their shared experts as column/row-parallel linears under TP; their router stays whole on every
rank. Under context parallel the ep ranks include the cp ranks (``layout``). FSDP later shards the
routed experts over ``ParallelMesh.expert_dp`` (what ep leaves of dp_shard) and everything else over
all of it, so expert gradients are reduced over the ranks holding the same experts and the others
over every data-parallel rank. DCP saves the DTensors whole, which is why a checkpoint loads under
another ep degree.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from composer3d.models.moe import moe_layers
from composer3d.parallel.mesh import ParallelMesh

# Shared experts' nn.Linear weights [out, in]: column-parallel w1/w3, row-parallel w2.
_SHARED_TP_DIM = {"shared_w1": 0, "shared_w3": 0, "shared_w2": 1}


def shard_experts(model: nn.Module, mesh: ParallelMesh, sequence_parallel: bool) -> None:
    """Split every MoE layer of ``model`` (built on meta) over ep and tp; a no-op for dense
    models."""
    ep, tp = mesh.layout.ep, mesh.layout.tp
    if ep == 1 and tp == 1:
        return
    for experts in model.routed_experts():
        tp_dims = getattr(experts, "tp_dims", None) if tp > 1 else None
        if tp_dims is None and ep == 1:
            continue  # whole on every tp rank
        expert_mesh = mesh.experts_mesh(by_expert=ep > 1, by_width=tp_dims is not None)
        for name, _ in list(experts.named_parameters(recurse=False)):
            placements = [Shard(0)] * (ep > 1) + (
                [Shard(tp_dims[name])] if tp_dims is not None else []
            )
            _distribute(experts, name, expert_mesh, placements)
    if tp > 1:
        for moe in moe_layers(model):
            # The router stays whole; as a DTensor, like every other parameter TP touches (one
            # optimizer kernel cannot take plain tensors and DTensors together).
            _distribute(moe.gate, "weight", mesh["tp"], [Replicate()])
            for name, tp_dim in _SHARED_TP_DIM.items():
                linear = getattr(moe, name)
                if linear is not None:
                    _distribute(linear, "weight", mesh["tp"], [Shard(tp_dim)])
            moe.tp_mesh, moe.sequence_parallel = mesh["tp"], sequence_parallel
    if ep > 1:
        model.use_expert_parallel(mesh.ep.get_group())


def _distribute(module: nn.Module, name: str, device_mesh, placements) -> None:
    # src_data_rank=None: each rank takes its own chunk, no communication (the weights are still on
    # meta).
    param = getattr(module, name)
    module.register_parameter(
        name, nn.Parameter(distribute_tensor(param, device_mesh, placements, src_data_rank=None))
    )
