"""Dynamic loss scaling for fp16 training, correct under any mix of FSDP, TP and PP.

Each rank checks only its own gradient shards for inf/nan; one all-reduce (MAX) over the whole world
makes every rank take the same decision — skip the step and halve the scale, or unscale and step —
so no rank's optimizer ever diverges from the others. After ``growth_interval`` clean steps the
scale doubles.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class DynamicLossScaler:
    def __init__(self, init_scale: float, growth_interval: int, device: torch.device):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.device = device
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_or_skip(self, params: list[torch.Tensor]) -> bool:
        """Unscale gradients in place and return True, or return False (step must be skipped) after
        an overflow."""
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in params
            if p.grad is not None
        ]
        found = torch.zeros((), device=self.device)
        for g in grads:
            found = torch.maximum(found, (~torch.isfinite(g)).any().to(found.dtype))
        # all ranks, all mesh dims: one decision everywhere
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found.item() > 0:
            self.scale /= 2
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        for g in grads:
            g.mul_(1.0 / self.scale)
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2
        return True

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.skipped_steps = (
            state["scale"],
            state["clean_steps"],
            state["skipped_steps"],
        )
