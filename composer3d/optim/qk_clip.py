"""QK-Clip (Kimi K2's MuonClip): attention logits kept from growing without bound under Muon.

Each step, every attention module records its heads' largest logit q·k/√d over the step's tokens
(``max_logits``, computed beside the attention kernels, which do not report it). After the update,
a head whose largest logit S exceeded the threshold τ has its projections scaled so that logit
would have been τ: with a key projection of its own (multi-head attention) both its query and key
rows by √(τ/S), as K2 does; where heads share a key head (grouped-query attention) the query rows
alone by τ/S, so the shared key is left to the heads that did not exceed it. The maximum is over
the data-parallel ranks (every rank scales alike); tensor parallel's ranks hold their own heads,
and their maxima are gathered so each rank scales the rows it holds, whatever FSDP cut them to.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


class QKClip:
    def __init__(
        self,
        modules: list,
        threshold: float,
        device: torch.device,
        data_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
    ):
        """``modules``: the attention modules of this stage (``attention_logits``);
        ``data_group``: the ranks that hold the same heads and see other tokens; ``tp_group``: the
        ranks holding the other heads of the same layers."""
        self.modules, self.threshold = modules, threshold
        self.data_group, self.tp_group = data_group, tp_group
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        for module in modules:
            heads = module.wq.weight.shape[0] // module.head_dim
            module.max_logits = torch.full((heads // tp,), float("-inf"), device=device)
        # the step's largest logit over this stage's layers and heads (on the device: read back
        # with the step's metrics)
        self.largest = torch.tensor(float("-inf"), device=device)

    @torch.no_grad()
    def apply(self) -> None:
        """Scale the projections of every head over the threshold this step (the others by 1,
        which leaves them as they are: no host sync to decide); start the next step's record."""
        largest = []
        for module in self.modules:
            seen = module.max_logits.clone()
            if self.data_group is not None:
                dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.data_group)
            if self.tp_group is not None:  # every head of the layer, in tensor parallel's order
                parts = [torch.empty_like(seen) for _ in range(dist.get_world_size(self.tp_group))]
                dist.all_gather(parts, seen, group=self.tp_group)
                seen = torch.cat(parts)
            module.max_logits.fill_(float("-inf"))
            largest.append(seen.max())
            factor = torch.where(seen > self.threshold, self.threshold / seen, 1.0)
            shared_keys = module.wk.weight.shape[0] != module.wq.weight.shape[0]
            query = factor if shared_keys else factor.sqrt()
            _scale_rows(module.wq.weight, query.repeat_interleave(module.head_dim))
            if not shared_keys:
                _scale_rows(module.wk.weight, factor.sqrt().repeat_interleave(module.head_dim))
        if largest:
            self.largest = torch.stack(largest).max()


def _scale_rows(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Multiply each row of ``weight`` (its global rows, wherever this rank's shard of them is)
    by ``scale``'s."""
    if isinstance(weight, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            weight.shape, weight.device_mesh, weight.placements
        )
        local = weight.to_local()
        if local.numel():
            local.mul_(scale[offset[0] : offset[0] + shape[0], None].to(local.dtype))
        return
    weight.mul_(scale[:, None].to(weight.dtype))
