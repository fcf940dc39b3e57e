"""Distributed checkpoints with DCP: save, async save, atomic commit, pruning, and resume (also
under another layout).

A checkpoint is a directory ``<checkpoint.dir>/step-<8 digits>/`` holding
  - DCP files of ``{"model": <model state>, "optim": <optimizer state>}`` keyed by parameter name
    (FQN), as ``torch.distributed.checkpoint.state_dict`` gives them: DTensor shards that DCP
    re-slices for any layout;
  - ``composer3d.json``: ours, plain JSON — step, config, data-loader and LR-schedule state, layout;
  - ``rng/rank<N>.json``: each rank's RNG states (restored only when the world size is unchanged).
A peft run's checkpoint leaves its frozen base out and records where it came from (``peft_base``).
It is written as ``step-N.partial`` and renamed to ``step-N`` by rank 0 only after every rank's data
and the DCP metadata are on disk, so a crash mid-save leaves at most a ``.partial`` directory, never
a half checkpoint that looks whole. Loading never unpickles arbitrary objects: DCP's tensor files
are read with ``weights_only``, its pickled index through a whitelist of DCP's own metadata classes,
ours is JSON.
"""

from composer3d.checkpoint.checkpointer import Checkpointer
from composer3d.checkpoint.format import (
    FORMAT_VERSION,
    META_FILE,
    CheckpointError,
    CheckpointNotSaved,
    SafeFileSystemReader,
    check_complete,
    check_same_model,
    check_steps_left,
    checkpoint_dir,
    committed_checkpoints,
    load_model_weights,
    read_meta,
    resumes_from_a_checkpoint,
    verified_checkpoints,
)

__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "CheckpointError",
    "CheckpointNotSaved",
    "Checkpointer",
    "SafeFileSystemReader",
    "check_complete",
    "check_same_model",
    "check_steps_left",
    "checkpoint_dir",
    "committed_checkpoints",
    "load_model_weights",
    "read_meta",
    "resumes_from_a_checkpoint",
    "verified_checkpoints",
]
