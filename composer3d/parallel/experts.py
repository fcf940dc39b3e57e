"""Expert parallel and the tensor-parallel split of mixture-of-experts layers (``models.moe``, and for model=hf
transformers' experts modules, ``models.hf_experts``: expert parallel only).

Routed experts are stacked tensors: expert parallel shards them by expert (dim 0) over the ``ep`` ranks, tensor
parallel by hidden width (w1, w3 on dim 1, w2 on dim 2; shared experts as column/row-parallel linears); with
both they are 2-D DTensors on the (ep, tp) mesh. The router stays whole on every rank. FSDP later shards the
routed experts over ``ParallelMesh.expert_dp`` (what ep leaves of dp_shard) and everything else over all of it,
so expert gradients are reduced over the ranks holding the same experts and the others over every
data-parallel rank. DCP saves the DTensors whole, which is why a checkpoint loads under another ep degree.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from composer3d.layout import ParallelMesh
from composer3d.models.hf import hf_expert_modules
from composer3d.models.hf_experts import use_expert_parallel
from composer3d.models.moe import moe_layers

# Stacked expert weights [experts, out, in]: the dim tensor parallel splits (the hidden width).
_EXPERT_TP_DIM = {"w1": 1, "w3": 1, "w2": 2}
# Shared experts' nn.Linear weights [out, in]: column-parallel w1/w3, row-parallel w2.
_SHARED_TP_DIM = {"shared_w1": 0, "shared_w3": 0, "shared_w2": 1}


def shard_experts(model: nn.Module, mesh: ParallelMesh, sequence_parallel: bool) -> None:
    """Split every MoE layer of ``model`` (built on meta) over ep and tp; a no-op for dense models."""
    ep, tp = mesh.layout.ep, mesh.layout.tp
    if ep == 1 and tp == 1:
        return
    dims = [d for d, size in (("ep", ep), ("tp", tp)) if size > 1]
    expert_mesh = mesh.world[tuple(dims)] if len(dims) > 1 else mesh[dims[0]]
    for moe in moe_layers(model):
        for name, tp_dim in _EXPERT_TP_DIM.items():
            placements = [Shard(0)] * (ep > 1) + [Shard(tp_dim)] * (tp > 1)
            _distribute(moe.experts, name, expert_mesh, placements)
        if tp > 1:
            # The router stays whole; as a DTensor, like every other parameter TP touches (one optimizer kernel
            # cannot take plain tensors and DTensors together).
            _distribute(moe.gate, "weight", mesh["tp"], [Replicate()])
            for name, tp_dim in _SHARED_TP_DIM.items():
                linear = getattr(moe, name)
                if linear is not None:
                    _distribute(linear, "weight", mesh["tp"], [Shard(tp_dim)])
            moe.tp_mesh, moe.sequence_parallel = mesh["tp"], sequence_parallel
        if ep > 1:
            moe.ep_group = mesh["ep"].get_group()
    if ep > 1 and hf_expert_modules(model):  # transformers' experts (model=hf): by expert only (no tp, validated)
        for module in hf_expert_modules(model):
            for name in ("gate_up_proj", "down_proj"):
                _distribute(module, name, mesh["ep"], [Shard(0)])
        use_expert_parallel(model, mesh["ep"].get_group())


def routed_experts(model: nn.Module) -> list[nn.Module]:
    """Each MoE layer's routed-experts module (stacked weights, dim 0 = expert): native or transformers'."""
    return [moe.experts for moe in moe_layers(model)] + hf_expert_modules(model)


def _distribute(module: nn.Module, name: str, device_mesh, placements) -> None:
    # src_data_rank=None: each rank takes its own chunk, no communication (the weights are still on meta).
    param = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, placements,
                                                                   src_data_rank=None)))
