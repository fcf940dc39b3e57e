"""The optimizer's state and step in host memory (``parallel.offload=optimizer``), or in files
(``parallel.offload_dir``): ZeRO-Offload's middle step, where parameters and gradients stay on the
device.

Each step the gradients (already clipped, on the device) are copied into pinned host buffers; a
fused CPU AdamW updates fp32 host copies of the parameters (the masters, which the optimizer owns)
and its moments there; the masters are copied back into the device parameters, queued on the
device's stream so the next forward waits for them without a host sync. Under FSDP the host copies
are DTensors over the same mesh and placements as the device shards, so the optimizer state is
sharded as it would be on the device, and DCP saves and re-shards it under any layout.

The rest of the trainer sees an ordinary optimizer over the model's parameters: ``param_groups``
hold the device parameters (the LR schedule and the config's settings act on them and are passed on
each step), and ``state`` is keyed by them, holding the host tensors — what
``get_optimizer_state_dict`` needs to name them by FQN.

With ``offload_dir`` the masters and moments are memory-mapped files in that directory, unlinked as
soon as they are mapped (nothing is left behind by a crash; the space returns when the process
ends): the page cache, not the host's memory, bounds the model, at the disk's bandwidth. Only the
gradient buffers stay in (pinned) host memory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state tensors, shaped like the parameter


class HostTensors:
    """Where one rank's host tensors are made: pinned host memory (so copies to and from an
    accelerator are asynchronous), or files under ``directory``, memory-mapped and unlinked at
    once."""

    def __init__(self, device: torch.device, directory: str | None):
        self.pin = device.type != "cpu"
        self.directory = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.directory = tempfile.mkdtemp(
                prefix=f"rank{os.environ.get('RANK', '0')}-", dir=directory
            )
        self.count = 0
        self.file_bytes = 0  # bytes this rank keeps in files

    def buffer(self, like: torch.Tensor, in_file: bool = True) -> torch.Tensor:
        """A zero-filled host tensor shaped like ``like`` (a local tensor); in a file if a directory
        was given."""
        if self.directory is None or not in_file:
            return torch.zeros(like.shape, dtype=like.dtype, pin_memory=self.pin)
        path = os.path.join(self.directory, f"{self.count}.bin")
        self.count += 1
        flat = torch.from_file(path, shared=True, size=like.numel(), dtype=like.dtype)
        # the mapping keeps the data; the name is not needed and nothing outlives the process
        os.unlink(path)
        self.file_bytes += flat.numel() * flat.element_size()
        return flat.view(like.shape)

    def close(self) -> None:
        if self.directory is not None:
            os.rmdir(self.directory)  # empty: every file was unlinked once mapped
            self.directory = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(device_tensor: torch.Tensor, host_local: torch.Tensor) -> torch.Tensor:
    """``host_local`` as the tensor the device one is: a DTensor over the same mesh and placements,
    or itself."""
    if not isinstance(device_tensor, DTensor):
        return host_local
    return DTensor.from_local(
        host_local,
        device_tensor.device_mesh,
        device_tensor.placements,
        run_check=False,
        shape=device_tensor.shape,
        stride=device_tensor.stride(),
    )


class HostOffloadOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over host copies of ``param_groups``' device parameters (see the module
    docstring)."""

    def __init__(
        self,
        param_groups: list[dict],
        optimizer_class: type[torch.optim.Optimizer],
        device: torch.device,
        offload_dir: str | None = None,
        **kwargs,
    ):
        super().__init__(param_groups, kwargs)
        self.host = HostTensors(device, offload_dir)
        self.device = device
        self.pairs: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []  # (device param, host master, grad buf)
        host_groups = []
        for group in self.param_groups:
            masters = []
            for param in group["params"]:
                master = _like(param, self.host.buffer(_local(param).detach()))
                grad_buffer = _like(param, self.host.buffer(_local(param).detach(), in_file=False))
                self.pairs.append((param, master, grad_buffer))
                masters.append(master)
            host_groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": masters}
            )
        self.inner = optimizer_class(host_groups, **kwargs)
        # every hyperparameter the optimizer has: a checkpoint as on the device
        self.defaults = self.inner.defaults
        self._settings_from(self.inner.param_groups)
        # The device parameters are the truth until the first step, and again after a checkpoint
        # loads them (or a model is loaded after this optimizer was made): the masters are then
        # refreshed from them.
        self.masters_stale = True
        self._alias_state()

    @property
    def host_file_bytes(self) -> int:
        return self.host.file_bytes

    def _alias_state(self) -> None:
        """``state`` keyed by the device parameters holds the inner optimizer's host state (the same
        dicts)."""
        self.state.clear()
        for param, master, _ in self.pairs:
            if master in self.inner.state:
                self.state[param] = self.inner.state[master]

    def _init_state_in_files(self) -> None:
        """Moments in files before AdamW would make them in host memory (with ``offload_dir``)."""
        if self.host.directory is None:
            return
        for _, master, _ in self.pairs:
            state = self.inner.state[master]
            for key in MOMENTS:
                if key not in state:
                    state[key] = _like(master, self.host.buffer(_local(master)))
                # loaded into host memory: into its file
                elif _local(state[key]).untyped_storage().filename is None:
                    local = self.host.buffer(_local(master))
                    local.copy_(_local(state[key]))
                    state[key] = _like(master, local)
            if "step" not in state:
                fused = self.inner.param_groups[0].get("fused") or self.inner.param_groups[0].get(
                    "capturable"
                )
                state["step"] = torch.zeros((), dtype=torch.float32) if fused else torch.tensor(0.0)

    def _settings_from(self, groups: list[dict]) -> None:
        for group, other in zip(self.param_groups, groups):
            group.update({k: v for k, v in other.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        """Gradients to the host, the host step, the masters back to the device parameters."""
        loss = closure() if closure is not None else None
        for host_group, group in zip(self.inner.param_groups, self.param_groups):
            # the schedule's lr, the config's
            host_group.update({k: v for k, v in group.items() if k != "params"})
        for param, master, grad_buffer in self.pairs:
            if self.masters_stale:
                _local(master).copy_(_local(param).detach(), non_blocking=True)
            # no gradient this step (e.g. an expert no token reached): no update, as on device
            if param.grad is None:
                master.grad = None
                continue
            _local(grad_buffer).copy_(_local(param.grad), non_blocking=True)
            master.grad = grad_buffer
        if self.device.type != "cpu":
            # the gradients have arrived in the host buffers
            torch.accelerator.synchronize(self.device)
        self.masters_stale = False
        self._init_state_in_files()
        # the clip, handed to the step (training/grad.py): the host's
        scale = getattr(self, "grad_scale", None)
        self.inner.grad_scale = None if scale is None else scale.to("cpu")
        self.inner.step()
        for param, master, _ in self.pairs:
            # Queued on the device's stream: the next forward waits for it there, the host does not.
            _local(param).copy_(_local(master), non_blocking=True)
        self._alias_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, master, _ in self.pairs:
            param.grad = None
            master.grad = None

    def state_dict(self) -> dict:
        self._alias_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Into the host optimizer (the same groups in the same order): its state stays on the
        host."""
        self.inner.load_state_dict(state_dict)
        self._settings_from(self.inner.param_groups)
        self._init_state_in_files()
        self._alias_state()
        self.masters_stale = True  # the checkpoint's parameters are loaded into the device ones

    def close(self) -> None:
        self.host.close()
