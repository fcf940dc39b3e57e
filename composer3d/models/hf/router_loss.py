"""transformers' router load-balancing loss for Hugging Face mixture-of-experts models.

With ``output_router_logits: true`` in config.json transformers adds ``router_aux_loss_coef`` × its
load-balancing loss (the model family's own ``load_balancing_loss_func``: the experts' share of the
top-k choices times their mean router probability, pooled over every MoE layer of one forward) to
each forward's training loss. composer3d's forward is its own decoder loop, so the router logits are
taken where transformers records them (the router modules its ``_can_record_outputs`` names) and
handed to that same function at the end of the layers; the loss trains the routers through its
gradient (``AttachAuxLoss``) without being added to the token loss composer3d logs.

Each forward is a micro-batch, so — as transformers averages the per-micro-batch losses over
gradient accumulation and data-parallel ranks — every micro-batch's loss gets coef / (micro-batches
in the global batch); a micro-batch holds the same sequences under every layout, so the curve does
not depend on the layout. The loss pools every layer of one forward: a pipeline stage holds only
some, so pipeline parallel is refused with it (config checks).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from composer3d.models.moe import AttachAuxLoss, recorded_forward


def wants_router_loss(config) -> bool:
    return bool(getattr(config, "output_router_logits", False))


class RouterLoss:
    """Collects a forward's router logits and attaches transformers' loss of them to the final
    hidden states."""

    def __init__(self, causal: nn.Module, experts: int):
        recorder = causal.model._can_record_outputs["router_logits"]
        self.router_class, self.index = recorder.target_class, recorder.index
        self.loss_fn = sys.modules[type(causal).__module__].load_balancing_loss_func
        self.experts, self.top_k = experts, causal.config.num_experts_per_tok
        self.coef = causal.config.router_aux_loss_coef
        self.grad_scale = 0.0  # set every step by the trainer (``ExpertLoad.before_step``)
        self.logits: list[torch.Tensor] = []
        # the micro-batches' losses summed since the last read
        self.total: torch.Tensor | None = None

    def install(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, self.router_class):
                module.register_forward_hook(self._capture)

    def _capture(self, module: nn.Module, _args, output) -> None:
        if recorded_forward(module):  # training forwards, once
            self.logits.append(output[self.index] if isinstance(output, tuple) else output)

    def attach(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` unchanged; this forward's loss trains the routers in backward."""
        if not self.logits:
            return hidden
        loss = self.loss_fn(tuple(self.logits), self.experts, self.top_k, None)
        self.logits = []
        self.total = loss.detach() if self.total is None else self.total + loss.detach()
        return AttachAuxLoss.apply(hidden, loss, self.grad_scale) if self.grad_scale else hidden

    def take_total(self) -> torch.Tensor | None:
        total, self.total = self.total, None
        return total
