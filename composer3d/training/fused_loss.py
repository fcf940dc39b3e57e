"""Fused linear + cross-entropy (``train.loss_impl=fused``): the head's matmul and the summed
cross-entropy in chunks, with both gradients computed in forward, so neither the full-vocabulary
logits nor their gradient ever exist for more than one chunk.

It runs the chunked loss's own kernels (``training.loss``: each chunk's log-sum-exp and softmax −
one_hot in fp32 from the logits in their dtype, one fused kernel each when compiled) and computes
what the reference computes from the same low-precision logits: per-row fp32 losses summed once, the
logits' gradient rounded to their dtype after it is scaled by the step's output gradient
(``grad_scale``), and each gradient one matmul over its whole reduction:
  - rows in chunks (logits of every vocabulary entry): the loss, each row's log-sum-exp, and ∂x =
    G·W;
  - the vocabulary in chunks (logits of every row, recomputed): ∂W = Gᵀ·x, over all rows at once,
    written once.
Summing ∂W over row chunks instead would round it once per chunk in bf16 (or cost an fp32 copy of W,
read and written per chunk); the recomputation costs one more matmul of the head's size. A frozen
head (LoRA) skips it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from composer3d.data import IGNORE_INDEX
from composer3d.training.loss import EAGER_KERNELS, ChunkKernels, compiled_kernels

# Elements of one chunk's logits (fp32 temporaries: 256 MiB): 523 rows of a 128K vocabulary, and
# ∂W's pass over 8192 rows takes 8192 vocabulary entries at a time. Twice the chunked loss's: on an
# H200 (benchmarks/loss_impl.py, 8192 tokens, 1B head, compiled) 512 rows a chunk step in 39.3 ms at
# a 1,160 MiB peak, the 261 rows of the chunked loss's size in 61.2 ms at 813 MiB (2048 rows: 37.6
# ms, 3,038 MiB; the chunked loss 25.9 ms, 4,136 MiB).
CHUNK_ELEMENTS = 2**26


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        grad_scale: torch.Tensor,
        kernels: ChunkKernels,
    ) -> torch.Tensor:
        rows, vocab = x.shape[0], weight.shape[0]
        wants_x, wants_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        trained = targets != IGNORE_INDEX
        index = torch.where(trained, targets, 0).unsqueeze(1)
        # each row's share of the output gradient
        scale = (trained * grad_scale).float().unsqueeze(1)
        lse = torch.empty(rows, dtype=torch.float32, device=x.device)
        target_logit = torch.empty(rows, dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if wants_x else None
        step = max(1, CHUNK_ELEMENTS // max(1, vocab))
        for start in range(0, rows, step):
            chunk = slice(start, start + step)
            logits = x[chunk] @ weight.t()
            lse[chunk] = kernels.logsumexp(logits)
            target_logit[chunk] = logits.gather(1, index[chunk]).squeeze(1).float()
            if grad_x is not None:
                kernels.grad_in_place(
                    logits, lse[chunk], index[chunk], trained[chunk], scale[chunk]
                )
                torch.mm(logits, weight, out=grad_x[chunk])  # the logits are now their gradient
        grad_w = _weight_grad(x, weight, targets, trained, lse, scale, kernels) if wants_w else None
        ctx.grads, ctx.grad_scale = (grad_x, grad_w), grad_scale
        return ((lse - target_logit) * trained).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # The gradients were computed for grad_scale: in training this ratio is 1 and leaves them as
        # they are
        ratio = grad_loss / ctx.grad_scale
        grad_x, grad_w = (None if g is None else g.mul_(ratio) for g in ctx.grads)
        ctx.grads = None
        return grad_x, grad_w, None, None, None


def _weight_grad(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    trained: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    kernels: ChunkKernels,
) -> torch.Tensor:
    """∂W = Gᵀ·x over the vocabulary in chunks: each chunk's logits for every row recomputed, their
    gradient from the rows' log-sum-exp, one matmul over all rows into the chunk's slice of ∂W."""
    rows, vocab = x.shape[0], weight.shape[0]
    grad_w = torch.empty_like(weight)
    step = max(1, CHUNK_ELEMENTS // max(1, rows))
    for start in range(0, vocab, step):
        entries = slice(start, start + step)
        logits = x @ weight[entries].t()
        local = targets - start
        here = trained & (local >= 0) & (local < logits.shape[1])
        kernels.grad_in_place(logits, lse, torch.where(here, local, 0).unsqueeze(1), here, scale)
        torch.mm(logits.t(), x, out=grad_w[entries])  # the logits are now their gradient
    return grad_w


def fused_linear_cross_entropy_sum(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    compiled: bool = False,
    grad_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Σ −log softmax(x·Wᵀ)[target] over targets that are not IGNORE_INDEX, in fp32, chunk by chunk.

    ``x`` (..., dim): the head's input (after the final norm); ``weight`` (vocab, dim): a bias-free
    head's whole weight (a plain tensor: tensor parallel's vocabulary shards are not fused,
    ``config.checks``); ``targets`` (...) global vocabulary ids. Under autocast the matmuls run in
    its dtype, as the head's ``Linear`` would. ``compiled``: the chunk kernels through
    torch.compile. ``grad_scale``: the gradient the caller will send into this sum (the trainer's 1
    / global tokens, times fp16's loss scale): the logits' gradient is scaled by it before it is
    rounded, as autograd through the full logits would; any other output gradient still gives the
    right gradients, with one more rounding.
    """
    if isinstance(weight, DTensor) or isinstance(x, DTensor):
        raise ValueError(
            "the fused loss takes the head's whole weight, not a DTensor (tensor parallel's "
            "vocabulary shards): use train.loss_impl=chunked"
        )
    device_type = x.device.type
    dtype = (
        torch.get_autocast_dtype(device_type)
        if torch.is_autocast_enabled(device_type)
        else weight.dtype
    )
    # evaluation: the loss alone (a Function's forward sees inputs' requires_grad)
    if not torch.is_grad_enabled():
        x, weight = x.detach(), weight.detach()
    grad_scale = torch.as_tensor(grad_scale, dtype=torch.float32, device=x.device)
    kernels = compiled_kernels() if compiled else EAGER_KERNELS
    with torch.autocast(device_type, enabled=False):
        return _FusedLinearCrossEntropy.apply(
            x.flatten(0, -2).to(dtype), weight.to(dtype), targets.flatten(), grad_scale, kernels
        )
