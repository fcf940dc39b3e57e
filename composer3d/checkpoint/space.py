"""Room for a checkpoint: before a save, its expected size against the free space where it is
written.

A save that runs out of space fails deep inside torch's writer ("unexpected pos") after minutes of
writing; told beforehand, the user can free space, keep fewer checkpoints or write them elsewhere.
The expected size is the larger of two: the bytes of the state the ranks write, each tensor once at
its global shape (a tensor replicated over ranks is written once; pipeline stages write their own),
and the size on disk of the newest checkpoint of the same kind (full or model-only), which counts
the file format's overhead too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def free_bytes(directory: Path) -> int:
    """Bytes this user may still write where ``directory`` lives (tests replace it:
    tests/fault_injection)."""
    return shutil.disk_usage(directory).free


def readable(n: int) -> str:
    """Bytes as a user compares them with ``df -h``: GiB, or MiB below one GiB, and the exact
    count."""
    unit, scale = ("GiB", 2**30) if n >= 2**30 else ("MiB", 2**20)
    return f"{n / scale:.2f} {unit} ({n:,} bytes)"


def bytes_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def state_bytes(state: dict) -> int:
    """The bytes of every tensor in ``state`` (a nested state dict) that some rank writes, each at
    its global shape, counted once however many ranks hold it. Collective: every rank calls it with
    its own state."""
    sizes: dict[str, int] = {}
    _tensor_bytes(state, "", sizes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict[str, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sizes)
        for other in gathered:
            sizes.update(other)
    return sum(sizes.values())


def _tensor_bytes(value, key: str, sizes: dict[str, int]) -> None:
    if isinstance(value, torch.Tensor):  # a DTensor's shape is the global one
        sizes[key] = value.numel() * value.element_size()
    elif isinstance(value, dict):
        for name, item in value.items():
            _tensor_bytes(item, f"{key}.{name}", sizes)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _tensor_bytes(item, f"{key}.{index}", sizes)
