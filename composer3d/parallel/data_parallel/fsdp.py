"""Data parallel through FSDP2: ZeRO-3/2 (``fully_shard``), HSDP, and replicated params (DDP).

ZeRO stage → FSDP2: 3 reshards params after forward and gathers them again in backward; 2 keeps them
gathered from forward through backward (one all-gather per step instead of two). ``dp_shard=1,
dp_replicate>1`` is plain DDP (FSDP2's ``replicate``: an all-reduce per block, overlapped with the
backward); both >1 is HSDP. ZeRO-1 runs without FSDP: its own buckets reduce-scatter the gradients
(``parallel.zero``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from composer3d.config.schema import ParallelConfig
from composer3d.dtypes import DTYPES
from composer3d.parallel.mesh import ParallelMesh


def shards_or_replicates(mesh: ParallelMesh, offload: bool, zero_stage: int) -> bool:
    """Whether a data-parallel dim needs FSDP2: more than one rank on it (but for ZeRO-1, which
    reduces its gradients itself), or offloading to host memory."""
    return (mesh.layout.dp * mesh.layout.cp > 1 and zero_stage != 1) or offload


def runs_fsdp(mesh: ParallelMesh, parallel_cfg: ParallelConfig) -> bool:
    """Whether ``parallelize`` puts FSDP2 around the blocks: where a data-parallel dim needs it, or
    offload."""
    return shards_or_replicates(mesh, parallel_cfg.offload == "cpu", parallel_cfg.zero_stage)


def replicates_params(mesh: ParallelMesh) -> bool:
    return mesh.layout.dp_shard == 1 and mesh.layout.cp == 1 and mesh.layout.dp_replicate > 1


def mixed_precision(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    # None keeps the params' own dtype: no casts at all in a pure fp32 run. The reduction dtype is
    # named whenever compute is in low precision: FSDP reads reduce_dtype=None as "reduce in the
    # compute dtype", which would reduce bf16/fp16 gradients in bf16/fp16 when
    # precision.reduce_dtype asks for float32.
    pure_fp32 = param_dtype == reduce_dtype == "float32"
    return MixedPrecisionPolicy(
        param_dtype=None if param_dtype == "float32" else DTYPES[param_dtype],
        reduce_dtype=None if pure_fp32 else DTYPES[reduce_dtype],
    )


def reshard_blocks_after_forward(policy: str, zero_stage: int, pp: int) -> bool:
    """ZeRO-3 frees gathered params after forward; under PP it keeps them, since every microbatch
    would gather them twice (forward and backward) — memory of one stage's full params against
    2×microbatches all-gathers."""
    if policy != "default":
        return policy == "always"
    return zero_stage == 3 and pp == 1


def apply_data_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    zero_stage: int,
    mp_policy: MixedPrecisionPolicy,
    reshard_policy: str = "default",
    roots: list[nn.Module] | None = None,
    offload: bool = False,
) -> None:
    """FSDP/DDP per block, then per root: the model, or under PP each stage module (embedding, norm,
    head).

    Pipeline schedules drive FSDP through the stage module they run (unshard, reshard, gradient sync
    per microbatch), so under PP each stage module is an FSDP root of its own. Under expert parallel
    the routed experts of each MoE layer are an FSDP unit of their own, over the ranks that hold the
    same experts.
    """
    if replicates_params(mesh):
        wrap = partial(replicate, mesh=mesh["dp_replicate"], mp_policy=mp_policy)
        wrap_block = wrap
    else:
        dp_mesh = mesh.hsdp if mesh.layout.dp_replicate > 1 else mesh.dp_shard_cp
        # ZeRO-Offload: sharded params, grads and the optimizer step live in host memory.
        offload_policy = (
            CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
            if offload
            else OffloadPolicy()
        )
        wrap = partial(
            fully_shard, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy
        )
        wrap_block = partial(
            wrap,
            reshard_after_forward=reshard_blocks_after_forward(
                reshard_policy, zero_stage, mesh.layout.pp
            ),
        )
    if mesh.layout.ep > 1:
        for experts in model.routed_experts():
            wrap_block(experts, mesh=mesh.expert_dp)
    for block in model.layers.values():
        wrap_block(block)
    roots = roots or [model]
    for root in roots:
        # embedding, final norm and head (those this rank kept); gathered through backward
        wrap(root)
    if mesh.layout.dp * mesh.layout.cp == 1:
        # one rank: FSDP neither divides nor reduces (a factor would cost a pass over the gradients)
        return
    for module in {m for root in roots for m in root.modules()}:
        if isinstance(module, FSDPModule):
            # The loss is already divided by the global token count, so gradients are summed over
            # ranks, not averaged; plain SUM collectives (no PREMUL_SUM, which gloo lacks) and no
            # extra scaling kernels.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
