"""Mixture-of-experts bookkeeping around the step: the load metrics (the layers count their routing,
this module reduces and resets it) and, for composer3d's own MoE layers, the auxiliary loss's
gradient scale and the auxiliary-loss-free bias update.

Counts are summed over the data-parallel ranks (the ``loss`` mesh: every rank there routed different
sequences; tensor-parallel ranks routed the same ones), so the bias moves by the global batch's
load, the same under every layout. Under pipeline parallel each stage looks after its own layers;
the metrics combine the stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from composer3d.models import Routing
from composer3d.models.moe import routing_counters
from composer3d.parallel.mesh import ParallelMesh


class ExpertLoad:
    """``routing`` (the model's ``track_routing``): with ``balancing``, composer3d's MoE layers,
    which also carry the auxiliary loss and the balancing bias; without, transformers' experts,
    whose load is read here and, when config.json asks for it, transformers' router loss (one per
    micro-batch of ``micro_batch_size`` sequences)."""

    def __init__(
        self,
        model: torch.nn.Module,
        routing: Routing,
        global_batch_size: int,
        mesh: ParallelMesh,
        device: torch.device,
        micro_batch_size: int = 1,
    ):
        self.layers = routing_counters(model)  # this rank's (a pipeline stage holds some, or none)
        self.cfg, self.total_moe_layers = routing.balancing or (None, 0)
        self.router_loss, self.microbatches = (
            routing.router_loss,
            global_batch_size // micro_batch_size,
        )
        self.global_batch_size, self.mesh = global_batch_size, mesh
        # routed tokens, logging window
        self.window = torch.zeros(len(self.layers), routing.experts, device=device)
        # summed over ranks each step
        self.window_global = self.cfg is not None and self.cfg.bias_update_rate > 0

    def before_step(self, loss_scale: float) -> None:
        """The auxiliary loss's gradient: coefficient over the global batch's sequences (it is a
        per-sequence mean, like the token loss is a per-token one), times the fp16 loss scale the
        token loss carries too. transformers' router loss: its coefficient over the global batch's
        micro-batches (a per-micro-batch mean)."""
        if self.router_loss is not None:
            self.router_loss.grad_scale = self.router_loss.coef / self.microbatches * loss_scale
        if self.cfg is None:
            return
        for layer in self.layers:
            layer.aux_grad_scale = self.cfg.aux_loss_coef / self.global_batch_size * loss_scale

    def after_step(self, updated: bool) -> None:
        """Move the balancing bias by this step's global load (if the update was applied) and start
        a new count."""
        # a pipeline stage without MoE layers, as are the other ranks of its loss mesh
        if not self.layers:
            return
        counts = torch.stack([layer.routed_tokens for layer in self.layers])
        if self.window_global:
            dist.all_reduce(counts, group=self.mesh.loss.get_group())
        if self.window_global and updated:
            with torch.no_grad():
                for layer, load in zip(self.layers, counts):
                    # DeepSeek-V3: an expert below the mean load gets a higher bias, one above a
                    # lower.
                    layer.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        self.window += counts
        for layer in self.layers:
            layer.routed_tokens.zero_()

    def read(self, steps: int) -> dict:
        """The window's load metrics (a collective on every rank), and a new window.

        ``expert_load_max``/``_min``: the most and least loaded expert of any layer, as a multiple
        of that layer's mean load; ``moe_aux_loss``: composer3d's MoE: the sequence-wise balance
        loss averaged over MoE layers and sequences (1.0 = balanced; the coefficient not applied);
        transformers' (with output_router_logits): its router loss averaged over the micro-batches
        (top_k = balanced; the coefficient not applied)."""
        window = self.window.clone()
        if not self.window_global:
            dist.all_reduce(window, group=self.mesh.loss.get_group())
        ratios = window / window.mean(-1, keepdim=True).clamp_min(1)
        # max load and -min load (so one MAX reduction over the pipeline stages serves both)
        stats = torch.stack(
            [
                ratios.max() if len(ratios) else torch.tensor(0.0, device=window.device),
                -ratios.min() if len(ratios) else torch.tensor(-float("inf"), device=window.device),
            ]
        )
        pp_group = self.mesh["pp"].get_group() if self.mesh.layout.pp > 1 else None
        if pp_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=pp_group)
        self.window.zero_()
        if self.cfg is None:
            load_max, neg_load_min = stats.tolist()
            load = {"expert_load_max": load_max, "expert_load_min": -neg_load_min}
            if self.router_loss is None:
                return load
            total = self.router_loss.take_total()
            total = torch.zeros((), device=window.device) if total is None else total.float()
            dist.all_reduce(total, group=self.mesh.loss.get_group())
            return {"moe_aux_loss": total.item() / (self.microbatches * steps), **load}
        aux = sum(
            (layer.aux_loss_sum for layer in self.layers), torch.zeros((), device=window.device)
        )
        dist.all_reduce(aux, group=self.mesh.loss.get_group())
        if pp_group is not None:
            dist.all_reduce(aux, group=pp_group)
        load_max, neg_load_min, aux_sum = torch.cat([stats, aux.view(1)]).tolist()
        for layer in self.layers:
            layer.aux_loss_sum.zero_()
        return {
            "moe_aux_loss": aux_sum / (self.global_batch_size * steps * self.total_moe_layers),
            "expert_load_max": load_max,
            "expert_load_min": -neg_load_min,
        }
