"""Activation offload per block: the tensors autograd saves for backward go to host memory in the
forward and come back ahead of their backward (``torch.autograd.graph.saved_tensors_hooks``).

Each call of a block is one group: its pack hook copies every saved tensor to a (pinned) host
buffer — on an accelerator on a side stream, so the copy overlaps the forward — and its unpack hook,
at the first tensor the backward asks for, brings back the whole group and starts the copies of the
group that ran before it (the next backward), so that copy overlaps this block's backward. What
stays on the device is the block being computed and the one prefetched. Not offloaded: parameters
and buffers (FSDP's gathered parameters and the views of them the matmuls save: they are freed or
kept by FSDP, not by autograd), tensors on another device (a CPU RNG state), and tensors under
``min_bytes`` (a copy costs more than they hold).

Under activation checkpointing the hooks see what checkpointing keeps: the checkpointed block's
inputs (full, or every k-th block), and under compile the tensors the compiled graph saves (the
op-level selective policy's too). Eager op-level selective keeps the policy's tensors in
checkpoint's own cache, which no saved-tensor hook sees: config/checks refuses that combination.

The hooks are entered around the block's whole call — outside its compiled graph (dynamo
graph-breaks on ``saved_tensors_hooks``; entered outside, the compiled graph's saved tensors still
pass through them, with no recompilation) and outside FSDP's hooks — by taking the slot
``nn.Module.compile`` fills (``_compiled_call_impl``). The device is the run's (launch/distributed,
through parallelize); streams and events are torch's device-generic ones, and where the device is
the CPU there are none: the same lines copy to a host buffer and back synchronously, and the
counters show it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# smaller saved tensors (norm statistics of a short sequence) stay on the device
MIN_OFFLOAD_BYTES = 1024


@dataclass
class OffloadCounters:
    """Since the last ``reset``: saved tensors (and their bytes) that went through a host copy,
    those kept on the device, and the bytes copied back (a tensor unpacked twice, or saved twice by
    one block, comes back twice)."""

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    tensors_kept: int = 0
    bytes_brought_back: int = 0


def _storage_ptr(t: torch.Tensor) -> int:
    return _leaves(t)[0].untyped_storage().data_ptr()


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A collective's result (TP's all-reduce, SP's all-gather; a DTensor's local tensor too) once
    it is there."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s data (a DTensor's local shard)."""
    t = _waited(t)
    if is_traceable_wrapper_subclass(t):
        inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
        return [x for part in inner if isinstance(part, torch.Tensor) for x in _leaves(part)]
    return [t]


def _expanded(t: torch.Tensor) -> bool:
    """Broadcast along some dim (stride 0): a few elements, which a copy of its own shape would
    overlap."""
    return any(
        stride == 0 and size > 1 for x in _leaves(t) for size, stride in zip(x.shape, x.stride())
    )


def _nbytes(t: torch.Tensor) -> int:
    return sum(x.numel() * x.element_size() for x in _leaves(t))


def _empty(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """An uninitialized tensor of ``t``'s size, strides and dtype on ``device`` (a subclass rebuilt
    around its inner tensors): the compiled backward asserts the strides of what it saved."""
    t = _waited(t)
    if is_traceable_wrapper_subclass(t):
        names, context = t.__tensor_flatten__()
        inner = {
            name: getattr(t, name) for name in names
        }  # tensors, and what they travel with (a DTensor's mesh)
        inner = {
            name: _empty(x, device, pin) if isinstance(x, torch.Tensor) else x
            for name, x in inner.items()
        }
        return type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=pin)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    for d, s in zip(_leaves(dst), _leaves(src)):
        d.copy_(s, non_blocking=True)


class _Saved:
    """One saved tensor in host memory (what the pack hook returns); ``on_device`` once brought
    back."""

    __slots__ = ("group", "host", "on_device", "brought", "__weakref__")

    def __init__(self, group: _Group, host: torch.Tensor):
        # the copy back follows the copy to the host on the side stream; ``brought``: the event
        # after it
        self.group, self.host = group, host
        self.on_device, self.brought = None, None


class _Group:
    """The saved tensors of one block call, and the group of the call before it (the next one
    backward needs)."""

    def __init__(self, previous: _Group | None, model: nn.Module, block: nn.Module):
        self.previous = weakref.ref(previous) if previous is not None else None
        self.model, self.block = model, block
        # storages of parameters and buffers, read at the first pack
        self.not_offloaded: set[int] | None = None
        self.saved: list[weakref.ref] = []
        self.by_id: dict[
            int, tuple[torch.Tensor, _Saved]
        ] = {}  # while the block runs forward: each tensor once
        self.brought_back = self.in_backward = False


class ActivationOffload:
    """The offload of one model's blocks: hooks, the side stream and the counters."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.accelerator = device.type != "cpu"
        # compared with the tensors' devices, which have one
        if self.accelerator and device.index is None:
            device = torch.device(device.type, torch.accelerator.current_device_index())
        self.device, self.min_bytes = device, min_bytes
        self.stream = torch.Stream(device) if self.accelerator else None
        self.counters = OffloadCounters()
        self._last: weakref.ref | None = None
        self._in_flight: list[
            tuple[object, list[torch.Tensor]]
        ] = []  # device tensors until their copy is done

    def reset(self) -> OffloadCounters:
        counters, self.counters = self.counters, OffloadCounters()
        return counters

    @contextlib.contextmanager
    def block(self, model: nn.Module, block: nn.Module):
        """Offload what autograd saves while ``block`` (of ``model``) runs: one group."""
        previous = self._last() if self._last is not None else None
        group = _Group(previous, model, block)
        self._last = weakref.ref(group)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack):
            try:
                yield
            finally:
                # hold the device tensors until their copies are done (the allocator would hand
                # their memory on)
                self._in_flight.append((self._event(), [t for t, _ in group.by_id.values()]))
                group.by_id.clear()
                self._release_copied()

    # forward

    def _pack(self, group: _Group, saved_tensor: torch.Tensor):
        if id(saved_tensor) in group.by_id:  # saved twice (an input of two ops): one copy
            return group.by_id[id(saved_tensor)][1]
        t = _waited(saved_tensor)
        if group.not_offloaded is None:
            # Parameters (and the views of them the matmuls save) stay where FSDP or the model keeps
            # them; FSDP gathers a block's in its forward pre-hook, so they are read at the first
            # pack, inside the block. Buffers too (the model's RoPE tables, which every block is
            # given).
            group.not_offloaded = {
                _storage_ptr(p) for p in (*group.block.parameters(), *group.model.buffers())
            }
        if (
            isinstance(t, nn.Parameter)
            or t.device != self.device
            or t.layout != torch.strided
            or _nbytes(t) < self.min_bytes
            or _expanded(t)
            or _storage_ptr(t) in group.not_offloaded
        ):
            self.counters.tensors_kept += 1
            return saved_tensor
        self._release_copied()
        host = _empty(t, torch.device("cpu"), pin=self.accelerator)
        with self._on_side_stream():
            _copy_into(host, t)
        saved = _Saved(group, host)
        group.by_id[id(saved_tensor)] = (saved_tensor, saved)
        group.saved.append(weakref.ref(saved))
        self.counters.tensors_offloaded += 1
        self.counters.bytes_offloaded += _nbytes(t)
        return saved

    # backward

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        group = packed.group
        if not group.in_backward:  # this block's backward begins
            group.in_backward = True
            # the last blocks' device tensors, held until their copies were done
            self._release_copied()
            self._bring_back(group)  # at once, unless it came as the block after's prefetch
            previous = group.previous() if group.previous is not None else None
            if previous is not None:
                # the next block's backward: its copies overlap this one's
                self._bring_back(previous)
        # unpacked again (a split backward), or saved after the group came back
        if packed.on_device is None:
            self._bring_back_one(packed)
        out, packed.on_device = packed.on_device, None
        if packed.brought is not None:
            torch.accelerator.current_stream(self.device).wait_event(packed.brought)
        return out

    def _bring_back(self, group: _Group) -> None:
        if group.brought_back:
            return
        group.brought_back = True
        for ref in group.saved:
            saved = ref()
            if saved is not None and saved.on_device is None:
                self._bring_back_one(saved)

    def _bring_back_one(self, saved: _Saved) -> None:
        # allocated on the compute stream, where it is used; the side stream first waits for the
        # compute stream's work so far (that memory's last users)
        device_copy = _empty(saved.host, self.device, pin=False)
        with self._on_side_stream():
            _copy_into(device_copy, saved.host)
        saved.on_device, saved.brought = device_copy, self._event()
        self.counters.bytes_brought_back += _nbytes(device_copy)

    # streams (none where the device is the CPU: the copies are synchronous there)

    def _on_side_stream(self):
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        return self.stream

    def _event(self):
        if self.stream is None:
            return None
        event = torch.Event(self.device)
        event.record(self.stream)
        return event

    def _release_copied(self) -> None:
        self._in_flight = [
            (event, held)
            for event, held in self._in_flight
            if event is not None and not event.query()
        ]


class OffloadedCall:
    """A block's call with its saved tensors offloaded: ``call`` is what ran before (compiled or
    not)."""

    def __init__(self, offload: ActivationOffload, model: nn.Module, block: nn.Module, call):
        self.offload, self.model, self.block, self.call = (
            offload,
            weakref.ref(model),
            weakref.ref(block),
            call,
        )

    def __call__(self, *args, **kwargs):
        with self.offload.block(self.model(), self.block()):
            return self.call(*args, **kwargs)


def apply_activation_offload(
    model: nn.Module, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES
) -> ActivationOffload:
    """Offload every block's saved tensors (after activation checkpointing and compile, before or
    after FSDP); the model keeps the offload as ``model.activation_offload`` (its counters)."""
    offload = ActivationOffload(device, min_bytes)
    for block in model.layers.values():
        block._compiled_call_impl = OffloadedCall(
            offload, model, block, block._compiled_call_impl or block._call_impl
        )
    model.activation_offload = offload
    return offload
