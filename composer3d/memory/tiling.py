"""Sequence tiling (``memory.tile_mlp``, ``memory.tile_loss``): the dense feed-forward, and the head
with the loss, over N tiles of the sequence, each tile recomputed in backward (DeepSpeed ALST's
tiled MLP and loss).

At long sequences the feed-forward's hidden (seq × ffn) and the logits (seq × vocab) are the largest
activations. Tiled, each tile runs under ``torch.utils.checkpoint``, which keeps only the tile's
input: the hidden or the logits of one tile exist at a time, in forward and in backward. Both are
per token, so tiling changes nothing but the order in which the weight gradients (and the loss) are
summed.

Tiles are cut from what each rank holds of the sequence. Under sequence parallel that is a slice of
it: a tile is then every tp rank's i-th piece of its slice, which the modules' own tensor-parallel
hooks gather and scatter back (the feed-forward is tiled around its ``__call__``, hooks included),
so every output lands where its input was; the loss takes its targets in the same order.

Under op-level selective checkpointing a tiled feed-forward runs inside its block's checkpoint,
whose policy sees every op, the tiles' too: were it to keep their matmul outputs, every tile's
hidden would stay until the block's backward and tiling would save nothing. A tile therefore runs
under an ``fx.traceback.annotate`` mark (``in_sequence_tile``) that the policies
(memory/activation_checkpointing.py) read to keep nothing of it: the tile's own checkpoint keeps its
input and recomputes it in its backward. The mark is torch's annotation of the ops being traced,
which the compiled checkpoint's policy sees as the eager one does (a flag set in Python would be a
side effect that breaks the compiled graph at the checkpoint). Every run of a tile carries the mark
(forward, the block's recomputation, the tile's own), so forward and recomputation decide alike:
torch 2.13 consults the policy in the forward only and replays its decisions, torch 2.11 consults it
in the recomputation too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def split_sequence(x: torch.Tensor, tiles: int) -> list[torch.Tensor]:
    """``tiles`` pieces of dim 1 (the sequence) of what this rank holds; a DTensor's keep its mesh
    and placements."""
    pieces = _local(x).tensor_split(tiles, dim=1)
    if not isinstance(x, DTensor):
        return list(pieces)
    return [DTensor.from_local(p, x.device_mesh, x.placements, run_check=False) for p in pieces]


def join_sequence(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of ``split_sequence``."""
    first = pieces[0]
    joined = torch.cat([_local(p) for p in pieces], dim=1)
    if not isinstance(first, DTensor):
        return joined
    return DTensor.from_local(joined, first.device_mesh, first.placements, run_check=False)


_TILE_MARK = "composer3d_sequence_tile"


def in_sequence_tile() -> bool:
    """Whether the op being run (or traced by torch.compile) is inside a sequence tile."""
    return fx_traceback.current_meta.get("custom", {}).get(_TILE_MARK, False)


def _marked(fn: Callable, *args):
    with fx_traceback.annotate({_TILE_MARK: True}):
        return fn(*args)


def _recomputed(fn: Callable, *args):
    # No RNG state kept: what is tiled (feed-forwards, head, loss) draws no random numbers (as in
    # parallel.activation)
    return checkpoint(_marked, fn, *args, use_reentrant=False, preserve_rng_state=False)


class SequenceTiled:
    """Mixed into a feed-forward module's class (as FSDP2 mixes in its own): a call runs over
    ``sequence_tiles`` tiles of its input's sequence, each recomputed in backward. It wraps
    ``__call__``, not ``forward``, so the module's hooks (tensor parallel's gather of the sequence
    and scatter of the output) run per tile."""

    sequence_tiles: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        call = super().__call__
        return join_sequence(
            [_recomputed(call, tile) for tile in split_sequence(x, self.sequence_tiles)]
        )


@functools.cache
def _tiled_class(cls: type) -> type:
    return type(f"SequenceTiled{cls.__name__}", (SequenceTiled, cls), {})


def tile_feed_forwards(model: nn.Module, tiles: int) -> int:
    """Run every dense feed-forward of ``model`` (``feed_forwards()``) over ``tiles`` sequence tiles
    (after tensor parallel, before activation checkpointing); returns how many were tiled. Parameter
    names are unchanged."""
    if tiles <= 1:
        return 0
    modules = model.feed_forwards()
    for module in modules:
        module.__class__ = _tiled_class(type(module))
        module.sequence_tiles = tiles
    return len(modules)


def _tile_loss(
    hidden: torch.Tensor, targets: torch.Tensor, logits_fn: Callable, loss_fn: Callable
) -> torch.Tensor:
    return loss_fn(logits_fn(hidden), targets)


def tiled_head_loss(
    hidden: torch.Tensor,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    tiles: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Σ over ``tiles`` sequence tiles of ``loss_fn(logits_fn(tile of hidden), its targets)``: the
    loss a summing ``loss_fn`` gives over ``logits_fn(hidden)``, without the full-length logits ever
    existing.

    ``hidden`` (batch, seq, dim), or this rank's slice of the sequence under sequence parallel,
    whose tiles the head gathers over the tp ranks in rank order; ``targets`` (batch, seq) cover the
    whole sequence.
    """
    # > 1 where the head gathers the sequence's slices
    shards = targets.shape[1] // _local(hidden).shape[1]
    target_tiles = targets.unflatten(1, (shards, -1)).tensor_split(tiles, dim=2)
    losses = [
        _recomputed(_tile_loss, tile, tile_targets.flatten(1), logits_fn, loss_fn)
        for tile, tile_targets in zip(split_sequence(hidden, tiles), target_tiles)
    ]
    return torch.stack(losses).sum()
