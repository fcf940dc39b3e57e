"""Fused linear + cross-entropy (``train.loss_impl=fused``): the head's matmul and the summed cross-entropy per
chunk of rows, with both gradients computed in the same pass, so neither the full-vocabulary logits nor their
gradient ever exist for more than one chunk.

Per chunk: logits = x·Wᵀ (in the compute dtype), one kernel that reads them for the log-sum-exp and the target's
logit and writes the gradient softmax − one_hot (ignored targets: zero), then that gradient's two matmuls into
∂x and ∂W. Backward only scales those by the incoming gradient: the matmuls a head runs in forward and backward
(three), no recomputation, and one pass over each chunk's logits where ``F.cross_entropy`` over fp32 logits makes
several. The chunk kernel is torch.compile'd on an accelerator (whether or not ``compile.enabled``) and with
``compile.enabled``; on the CPU otherwise it runs eagerly, the same math. ∂W accumulates over the chunks in W's
dtype (bf16 under mixed precision, as a bf16 head's weight gradient is; fp32 exact on the CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from composer3d.data import IGNORE_INDEX
from composer3d.training.loss import CHUNK_ELEMENTS


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy of a chunk's trained rows, in fp32 (alone: evaluation, where no gradient is wanted)."""
    return _chunk_parts(logits, targets)[0]


def _chunk_parts(logits: torch.Tensor, targets: torch.Tensor):
    """(the chunk's summed loss, its fp32 logits, their log-sum-exp, the target index, which rows are trained)."""
    trained = (targets != IGNORE_INDEX).unsqueeze(1)
    index = torch.where(trained, targets.unsqueeze(1), 0)
    wide = logits.float()
    lse = torch.logsumexp(wide, dim=1, keepdim=True)
    return ((lse - wide.gather(1, index)) * trained).sum(), wide, lse, index, trained


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and its gradient w.r.t. the logits (softmax − one_hot, zero on ignored rows), in their dtype:
    eager, the one-hot subtracted in place (no second chunk-sized temporary)."""
    loss, wide, lse, index, trained = _chunk_parts(logits, targets)
    grad = (wide - lse).exp_().scatter_add_(1, index, -trained.float()).mul_(trained)
    return loss, grad.to(logits.dtype)


def _chunk_loss_and_grad_pointwise(logits: torch.Tensor, targets: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, with the one-hot as a comparison: all pointwise after the reduction, which torch.compile fuses
    into one kernel reading the chunk (a scatter would be a kernel of its own)."""
    loss, wide, lse, index, trained = _chunk_parts(logits, targets)
    hit = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == index
    return loss, (((wide - lse).exp() - hit.float()) * trained).to(logits.dtype)


@functools.cache
def _compiled(kernel: Callable) -> Callable:
    return torch.compile(kernel, dynamic=False)  # two shapes: the full chunks' and the last one's


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compiled: bool) -> torch.Tensor:
        rows, vocab = x.shape[0], weight.shape[0]
        wants_x, wants_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wants_grad = wants_x or wants_w
        if compiled:
            kernel = _compiled(_chunk_loss_and_grad_pointwise if wants_grad else _chunk_loss)
        else:
            kernel = _chunk_loss_and_grad if wants_grad else _chunk_loss
        grad_x = torch.empty_like(x) if wants_x else None
        grad_w = torch.zeros_like(weight) if wants_w else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        step = max(1, CHUNK_ELEMENTS // max(1, vocab))
        for start in range(0, rows, step):
            chunk = slice(start, start + step)
            logits = x[chunk] @ weight.t()
            if not wants_grad:
                total += kernel(logits, targets[chunk])
                continue
            loss, grad_logits = kernel(logits, targets[chunk])
            total += loss
            del logits  # the chunk's logits are done with: only their gradient is needed now
            if grad_x is not None:
                torch.mm(grad_logits, weight, out=grad_x[chunk])
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t(), x[chunk])
        ctx.save_for_backward(grad_x, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        scale = [None if g is None else g * grad_loss.to(g.dtype) for g in (grad_x, grad_w)]
        return scale[0], scale[1], None, None


def fused_linear_cross_entropy_sum(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   compiled: bool = False) -> torch.Tensor:
    """Σ −log softmax(x·Wᵀ)[target] over targets that are not IGNORE_INDEX, in fp32, chunk by chunk.

    ``x`` (..., dim): the head's input (after the final norm); ``weight`` (vocab, dim): a bias-free head's whole
    weight (a plain tensor: tensor parallel's vocabulary shards are not fused, ``config.checks``); ``targets``
    (...) global vocabulary ids. Under autocast the matmuls run in its dtype, as the head's ``Linear`` would.
    ``compiled``: the chunk kernel through torch.compile.
    """
    if isinstance(weight, DTensor) or isinstance(x, DTensor):
        raise ValueError("the fused loss takes the head's whole weight, not a DTensor (tensor parallel's vocabulary "
                         "shards): use train.loss_impl=chunked")
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):
        return _FusedLinearCrossEntropy.apply(x.flatten(0, -2).to(dtype), weight.to(dtype), targets.flatten(),
                                              compiled)
