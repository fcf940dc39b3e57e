"""Low-precision compute over fp32 parameters where FSDP does not run (TP-only, PP-only, ZeRO-1
layouts; one device with ``precision.cast=autocast``, compiled runs' default there).

FSDP's mixed-precision policy casts the gathered parameters; with no data-parallel dim there is
nothing to gather, so the roots' forwards run under ``torch.autocast`` instead: matmuls and
attention in bf16/fp16, parameters, gradients and optimizer state in fp32 (what torchtitan does on
one device). Numerically close to FSDP's policy, not identical: autocast keeps the residual stream,
norms and softmax-like ops in fp32. The output head runs the same kernels but keeps its fp32 weight
for backward, not autocast's copy of it (``cast_head_in_backward``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from composer3d.dtypes import DTYPES


def autocast_forward(roots: list[nn.Module], param_dtype: str, device: torch.device) -> None:
    """Run each root module's forward under autocast to ``param_dtype`` (nothing to do for float32);
    the head, where a root holds it, casts its weight again in backward
    (``cast_head_in_backward``)."""
    if param_dtype == "float32":
        return
    for root in roots:
        root.forward = torch.autocast(device.type, dtype=DTYPES[param_dtype])(root.forward)
        cast_head_in_backward(root)


class _LinearKeepingWeight(torch.autograd.Function):
    """``F.linear(x_low, weight_low)`` that saves the fp32 ``weight`` for backward instead of its
    low-precision cast ``weight_low``: backward casts it again for ∂x and frees it before ∂W is
    made. The same kernels on the same operands as autocast's linear, so the same bits. Its
    gradients stay in the low dtype: the casts before it (``Tensor.to``'s backward nodes) take them
    to fp32 once this node, and the logits' gradient with it, is done."""

    @staticmethod
    def forward(
        ctx, x_low: torch.Tensor, weight_low: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x_low, weight)
        return F.linear(x_low, weight_low)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_low, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # the cast lives for this matmul only
            grad_x = rows.mm(weight.to(grad.dtype)).view(x_low.shape)
        if ctx.needs_input_grad[1]:
            grad_w = rows.t().mm(x_low.reshape(-1, x_low.shape[-1]))
        return grad_x, grad_w, None


def cast_head_in_backward(model: nn.Module) -> None:
    """Under autocast, the output head keeps no low-precision copy of its weight from forward to
    backward (``_LinearKeepingWeight``): on one device the head's backward is the step's peak (an
    H200's allocator trace, 1B: the logits' gradient, the saved cast and the weight's gradient
    together), and this takes one cast of the head (vocab · dim · 2 bytes) from it. Only a plain
    bias-free ``nn.Linear`` over a local weight: a tensor-parallel head's DTensor, or an adapter
    around it, keeps autocast's linear."""
    head = getattr(model, "output", None)
    if type(head) is not nn.Linear or head.bias is not None or isinstance(head.weight, DTensor):
        return
    plain = head.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (torch.is_grad_enabled() and torch.is_autocast_enabled(device)):
            return plain(x)
        dtype = torch.get_autocast_dtype(device)
        return _LinearKeepingWeight.apply(x.to(dtype), head.weight.to(dtype), head.weight.detach())

    head.forward = forward


def auto_cast(
    accelerator: bool, world_size: int, compiled: bool, zero_stage: int, peft_method: str
) -> str:
    """What ``precision.cast=auto`` resolves to, by measurement (docs/performance.md: H200, 1B
    Llama, seq 8192, selective AC). Eager on one accelerator, params: 43.0k tok/s against
    autocast's 41.5k (one cast of each weight a step instead of one per forward and recomputation,
    and none of each activation).
    Compiled, autocast: 48.3k against 47.5k and 2.1 GiB less (Inductor fuses the activations' casts,
    and FSDP's one-rank copies, which params ran through then, cost more than the weights' casts
    left; ``cast_once`` since leaves them out, not yet measured on a GPU). Where params cannot run,
    autocast: ZeRO-1 (no FSDP) and QLoRA (refused with params by the checks). The trainer
    (``training.precision``) and the planner resolve it here alike."""
    eager_alone = world_size == 1 and not compiled
    return (
        "params"
        if accelerator and eager_alone and zero_stage != 1 and peft_method != "qlora"
        else "autocast"
    )
