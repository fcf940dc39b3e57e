"""One device's low-precision compute from fp32 parameters, each cast once a forward
(``precision.cast=params``).

At each forward of the model every parameter's param_dtype copy is made once, and it shadows the
parameter on its module: an instance attribute, which attribute lookup finds before nn.Module's
parameter table. ``self.weight`` in any module's forward, and in activation checkpointing's
recomputation, is then the copy, while ``parameters()``, ``state_dict()``, the optimizer and
checkpoints see only the fp32 parameters. Autograd casts each copy's gradient back into its
parameter's fp32 ``.grad`` (where micro-batches add up). The copies go when the backward ends, or
when a forward that builds no graph returns. Generation calls the blocks itself, step after step:
``held`` keeps one set of copies for all of it.

This replaced FSDP's one-rank path, which cast the same way: the same rounding of each weight, its
bf16 gradient (summed in bf16 over the weight's uses) made fp32. What it leaves out is that path's
copies — each cast copied into the gathered buffer, each block's gradients into an fp32 reduce
buffer and again into its output, about 24 bytes a parameter against a cast's 6 and its gradient's
6 — and FSDP's hooks on every block. Unlike FSDP it casts no forward inputs: the native Llama's RoPE
tables stay fp32 (its blocks' other inputs are already the low dtype).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from composer3d.config.schema import PrecisionConfig


def casts_once(world_size: int, precision_cfg: PrecisionConfig, offload: str) -> bool:
    """Whether ``parallelize`` casts this way: one rank, ``precision.cast=params`` (resolved) to a
    narrower dtype, parameters on the device (one-rank ``offload=cpu`` runs FSDP, whose shards live
    on the host)."""
    return (
        world_size == 1
        and precision_cfg.cast == "params"
        and precision_cfg.param_dtype != "float32"
        and offload != "cpu"
    )


class CastOnce:
    def __init__(self, model: nn.Module, dtype: torch.dtype):
        """Cast ``model``'s parameters to ``dtype`` at each of its forwards (``attach``)."""
        self.dtype = dtype
        # every (module, name) a parameter is registered under (a tied weight: one copy shadows it
        # in each); the parameter itself is read at each cast, as materializing or loading a
        # checkpoint may replace it
        self.slots = [
            (module, name)
            for module in model.modules()
            for name, _ in module.named_parameters(recurse=False, remove_duplicate=False)
        ]
        self.holding = False

    def attach(self, model: nn.Module) -> None:
        """The copies made at each forward of ``model``, which keeps this as ``model.cast_once``."""
        model.register_forward_pre_hook(self._cast)
        model.register_forward_hook(self._after_forward)
        model.cast_once = self

    @contextmanager
    def held(self):
        """One set of copies for everything inside, the forwards leaving them be (no gradient:
        generation)."""
        with torch.no_grad():
            self._cast()
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            self.drop()

    def _cast(self, *hook_args) -> None:
        if self.holding:
            return
        # Afresh at every forward: copies kept from an earlier one would hold the weights before an
        # optimizer step.
        copies: dict[int, torch.Tensor] = {}
        for module, name in self.slots:
            param = module._parameters[name]
            if id(param) not in copies:
                # under autograd: the gradient cast back to fp32
                copies[id(param)] = param.to(self.dtype)
            module.__dict__[name] = copies[id(param)]

    def _after_forward(self, model: nn.Module, args, output) -> None:
        if self.holding:
            return
        graph = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if graph:  # kept for the backward (its recomputation reads them), dropped once it ends
            graph[0].register_hook(self._at_backward)
        else:
            self.drop()

    def _at_backward(self, grad: torch.Tensor) -> None:
        # the engine runs the callback when this backward is done (as FSDP ends its own backward)
        torch.autograd.Variable._execution_engine.queue_callback(self.drop)

    def drop(self) -> None:
        """The parameters in view again; the copies freed (with the graph that held them)."""
        for module, name in self.slots:
            module.__dict__.pop(name, None)
