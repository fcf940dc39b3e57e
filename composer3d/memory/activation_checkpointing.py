"""Activation checkpointing per block: the block's own forward runs under ``torch.utils.checkpoint``
(non-reentrant), set as the block's instance ``forward`` (no wrapper module: parameter names
unchanged).

``full``: every block recomputes its forward in backward. ``selective`` with ``ac_every=k`` (k ≥ 1):
layer-level, every k-th block fully recomputed, the others keep their activations. ``selective``
with ``ac_every=0``: op-level, in every block, by ``memory.ac_policy``: ``all_matmuls`` keeps the
outputs of the expensive ops (matmuls, attention, and the reductions TP and expert parallel run) and
recomputes the cheap elementwise ones (norms, activations, RoPE); ``alternate_matmuls``
(torchtitan's op-level policy) keeps only every other matmul's output besides attention's and the
reductions', trading one recomputed matmul in two for less memory.

Both recompute the block's all-gathers (``memory.ac_save_gathers=false``, the default), as
Megatron-LM and torchtitan do: sequence parallel's gathered inputs of attention and the feed-forward
(and context parallel's gathered K/V) are the whole sequence, tp× (cp×) what they are gathered from,
and cost one all-gather each to redo in backward. The recomputation gathers the same shards again
(the norm's output it recomputes first), and every rank of the group recomputes the same blocks in
the same order, so the redone collectives stay matched. The reduce-scatters, all-reduces and
all-to-alls stay kept: they hold no more than the tensors they come from. Both keep nothing of a
sequence tile (``memory.tile_mlp``, memory/tiling.py): the tile's own checkpoint recomputes it, one
at a time.

Why not torch's composable ``checkpoint`` (forward hooks): under ``compile.enabled`` its selective
policy never sees the compiled graph's ops, so backward recomputed every matmul and the attention,
as full checkpointing does. Called inside the compiled forward, ``torch.utils.checkpoint`` is traced
as one higher-order op and the policy decides what the compiled graph saves.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from composer3d.memory.tiling import in_sequence_tile

aten = torch.ops.aten


def _save_list() -> set:
    """The ops whose outputs op-level selective checkpointing keeps, but the all-gathers
    (``GATHERS``)."""
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,
        aten._grouped_mm.default,
    }
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    # the native llama's attention within packed documents
    ops.add(torch.ops.higher_order.flex_attention)
    # TP's reductions and expert parallel's token exchange: don't redo communication that saves no
    # memory
    for name in ("reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
        ops.add(getattr(torch.ops._c10d_functional, name).default)
    return ops


SAVE_OPS = _save_list()
# Kept only under memory.ac_save_gathers: otherwise redone in backward (its wait_tensor with it,
# never kept)
GATHERS = {torch.ops._c10d_functional.all_gather_into_tensor.default}

# Profiler annotations are no computation, but selective checkpointing replays ops by count, and
# FSDP2 annotates a nested FSDP module's (expert parallel's experts) forward a different number of
# times when it is recomputed: the replay then fails ("_record_function_enter_new ... not found in
# storage"; torchtitan#3427, fixed upstream after torch 2.13 by ignoring these ops in the same way).
torch.utils.checkpoint.SAC_IGNORED_OPS.update(
    getattr(torch.ops.profiler, name).default
    for name in ("_record_function_enter", "_record_function_enter_new")
)
torch.utils.checkpoint.SAC_IGNORED_OPS.add(torch.ops.profiler._record_function_exit._RecordFunction)


# The matmuls alternate_matmuls takes turns over: the blocks' linear layers (bf16 or float8)
LINEAR_MATMULS = {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}


def _save_expensive(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in saved and not in_sequence_tile():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _all_matmuls_context(saved: set):
    return create_selective_checkpoint_contexts(partial(_save_expensive, saved))


def _alternate_matmuls_context(saved: set):
    """A fresh count per checkpointed call: the forward and its recomputation see the matmuls in the
    same order, each counted on its own, so both decide alike which are kept. A sequence tile's
    matmuls are not counted: the tile keeps none of them."""
    seen = {
        False: 0,
        True: 0,
    }  # linear matmuls so far, in the forward (False) and in the recomputation (True)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in LINEAR_MATMULS and not in_sequence_tile():
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:  # the 2nd, 4th, … are recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _save_expensive(saved, ctx, op)

    return create_selective_checkpoint_contexts(policy)


POLICIES = {"all_matmuls": _all_matmuls_context, "alternate_matmuls": _alternate_matmuls_context}


def _policy_context(policy: str, save_gathers: bool):
    """The ``context_fn`` of ``POLICIES[policy]`` keeping ``SAVE_OPS``' outputs, and the
    all-gathers' with ``save_gathers``."""
    saved = frozenset(SAVE_OPS | GATHERS) if save_gathers else frozenset(SAVE_OPS)

    def context():
        return POLICIES[policy](saved)

    return context


def blocks_all_gather(tp: int, sequence_parallel: bool, cp: int, cp_style: str) -> bool:
    """Whether a block's forward all-gathers, which ``save_gathers`` can keep: sequence parallel's
    inputs of attention and the feed-forward, cp_style=allgather's K/V."""
    return (tp > 1 and sequence_parallel) or (cp > 1 and cp_style == "allgather")


# One per (policy, save_gathers), looked up inside the traced forward by those constants, which
# dynamo guards on: a context function passed in is not guarded, and a block compiled under one
# policy would serve another's graph.
CONTEXTS = {
    (policy, keep): _policy_context(policy, keep) for policy in POLICIES for keep in (False, True)
}


def checkpointed_forward(forward, policy: str | None, save_gathers: bool, *args, **kwargs):
    """``forward(*args, **kwargs)``, its activations recomputed in backward: all (``policy`` None),
    or those ``POLICIES[policy]`` does not keep (with the all-gathers' outputs under
    ``save_gathers``). (Full takes checkpoint's default context: dynamo cannot trace one passed
    in.)"""
    context = {"context_fn": CONTEXTS[policy, save_gathers]} if policy else {}
    return checkpoint(
        forward, *args, use_reentrant=False, preserve_rng_state=False, **context, **kwargs
    )


def apply_activation_checkpointing(
    model: nn.Module, mode: str, every: int, policy: str = "all_matmuls", save_gathers: bool = False
) -> int:
    """Checkpoint the blocks per ``mode`` (after TP, before compile and FSDP), op-level ones by
    ``policy`` (a key of ``POLICIES``), keeping the all-gathers' outputs too with ``save_gathers``;
    returns how many blocks were checkpointed."""
    if mode == "none":
        return 0
    wrapped = 0
    for layer_id, block in model.layers.items():
        if mode == "full" or (every >= 1 and int(layer_id) % every == 0):
            block_policy = None
        elif every == 0:
            block_policy = policy
        else:
            continue
        block.forward = partial(checkpointed_forward, block.forward, block_policy, save_gathers)
        wrapped += 1
    return wrapped
