"""The Trainer: one rank's model, optimizer, data and step, under any layout (``commands/train.py``
is the CLI; the loop around the step is ``loop``, its metrics' read-back ``readback``).

One step: the global batch is fixed by the seed; this data-parallel rank takes its slice and runs it
as micro-batches (gradient accumulation). Each micro-batch's summed token loss is divided by the
count of targets that take a loss (not -100: document boundaries, chat prompts) in the whole global
batch, so the gradient — and the logged loss — are the same under every layout. The batch's
position_ids go to the model with the inputs. With train.objective=dpo the summed loss is the
pairs' preference loss (``preference``), divided by the pairs of the global batch.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from composer3d.config.checks import pipeline_microbatches
from composer3d.config.schema import TrainLoopConfig
from composer3d.data import (
    IGNORE_INDEX,
    Batch,
    BatchPrefetcher,
    GlobalBatchLoader,
    PackedSequences,
    eval_result,
    window_batches,
)
from composer3d.dtypes import DTYPES
from composer3d.errors import TrainingDiverged
from composer3d.launch import distributed
from composer3d.memory.tiling import tiled_head_loss
from composer3d.optim.build import (
    build_optimizer,
    configured_settings,
    groups_by_parameter,
    groups_of_this_rank,
    restore_configured_settings,
    with_configured_kernels,
)
from composer3d.optim.qk_clip import QKClip
from composer3d.optim.schedule import build_scheduler
from composer3d.parallel.data_parallel.zero import replica_mesh
from composer3d.parallel.mesh import ParallelMesh
from composer3d.parallel.pipeline.stages import stage_boundary
from composer3d.parallel.pipeline.tied import (
    optimizer_from_checkpoint_names,
    optimizer_to_checkpoint_names,
    sum_twin_grads,
    uncounted_in_norm,
)
from composer3d.precision.loss_scaling import DynamicLossScaler
from composer3d.training.assemble import build_parallel_model
from composer3d.training.expert_load import ExpertLoad
from composer3d.training.flops import peak_flops
from composer3d.training.fused_loss import fused_linear_cross_entropy_sum
from composer3d.training.grad import clip_grad_norm_, replicas
from composer3d.training.loop import train_loop
from composer3d.training.loss import cross_entropy_sum
from composer3d.training.metrics import MetricsSink, Throughput, model_state_bytes
from composer3d.training.preference import PreferenceObjective
from composer3d.training.readback import window_records

if TYPE_CHECKING:  # built under cp > 1 only (parallel/compose.py)
    from composer3d.parallel.context.context_parallel import ContextParallel

log = logging.getLogger("composer3d")


class Trainer:
    def __init__(
        self,
        cfg: DictConfig,
        mesh: ParallelMesh,
        device: torch.device,
        sequences: PackedSequences | None,
        eval_windows: torch.Tensor | None = None,
        from_checkpoint: bool = False,
        base: dict | None = None,
        static_pipeline: bool = False,
    ):
        """``sequences``: the training data (None: evaluation only); ``eval_windows``: for
        train.eval_every; ``from_checkpoint``, ``base``: the weights will be loaded from a
        checkpoint, a peft run's base from its source (``build_parallel_model``);
        ``static_pipeline``: pipeline stages built with the shapes they exchange (plan.measure: no
        other stage)."""
        self.cfg, self.mesh, self.device = cfg, mesh, device
        # The loss's chunk kernels, compiled on an accelerator even in an eager run: one fused pass
        # over each chunk of logits instead of several (on an H200, 1B head: chunked 38.9 ms eager,
        # 22.8 compiled, log-softmax 30.8)
        self._compiled_loss = cfg.compile.enabled or distributed.is_accelerator(device)
        t, p = cfg.train, cfg.parallel
        built = build_parallel_model(cfg, mesh, device, from_checkpoint, base)
        self.model, self.num_params, stages = built.model, built.num_params, built.stages
        self.active_params, self.trainable_params = built.active_params, built.trainable_params
        self.throughput = Throughput(
            built.flops_per_token,
            peak_flops(device, cfg.precision.param_dtype, cfg.logging.peak_tflops),
            mesh.layout.world_size,
        )
        self.param_names = [name for name, _ in self.model.named_parameters()]
        self.accumulation_steps = pipeline_microbatches(cfg, mesh.layout.dp)
        zero1 = {
            "reduce_dtype": DTYPES[cfg.precision.reduce_dtype],
            "bucket_bytes": int(p.zero1_bucket_mb * 2**20),
            "backwards_per_step": self.accumulation_steps,
            "gather_dtype": DTYPES[cfg.precision.param_dtype],
        }
        self.optimizer, self.sharder = build_optimizer(
            self.model,
            cfg.optim,
            zero1_mesh=replica_mesh(self.model, mesh) if p.zero_stage == 1 else None,
            offload=p.offload,
            offload_dir=p.offload_dir,
            device=device,
            zero1=zero1,
        )
        # optim.muon_clip_threshold: the attention heads' largest logits recorded, and clipped
        # after each update
        self.qk_clip = (
            QKClip(
                self.model.attention_logits(),
                cfg.optim.muon_clip_threshold,
                device,
                mesh.loss.get_group() if mesh.layout.dp * mesh.layout.cp > 1 else None,
                mesh["tp"].get_group() if mesh.layout.tp > 1 else None,
            )
            if cfg.optim.muon_clip_threshold > 0
            else None
        )
        # ZeRO-1's slices of the gradients: each element on one rank of the ranks its parameter is
        # replicated over
        self.shard_replicas = (
            [
                replicas(p, mesh.layout) // n
                for p, n in zip(self.sharder.params, self.sharder.group_sizes)
            ]
            if self.sharder
            else None
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
        self.total_steps = t.steps
        self.sequences = sequences
        self.loader = (
            None
            if sequences is None
            else BatchPrefetcher(
                GlobalBatchLoader(
                    sequences, t.global_batch_size, mesh.dp_rank, mesh.layout.dp, t.seed
                ),
                device,
            )
        )
        self.eval_windows = eval_windows
        self.evaluating = False  # the loss function then returns plain summed losses (see evaluate)
        # trained targets in the current global batch (a host number: no sync)
        self.global_tokens = 1.0
        self.memory_tracker = None  # set while logging.memory_breakdown measures a step
        self.scaler = None
        # fp16's narrow range needs loss scaling; bf16 does not
        if cfg.precision.param_dtype == "float16":
            self.scaler = DynamicLossScaler(
                cfg.precision.loss_scale_init, cfg.precision.loss_scale_growth_interval, device
            )
        self.pipeline = None
        make_schedule = None
        if stages:
            # here: torch's pipelining imports dynamo, which a run without a pipeline never needs
            from composer3d.parallel.pipeline.schedule import build_schedule

            make_schedule = partial(
                build_schedule,
                schedule=p.pp_schedule,
                microbatches=self.accumulation_steps,
                pp_group=mesh["pp"].get_group(),
                device=device,
                boundary=(
                    stage_boundary(cfg, mesh, self.accumulation_steps) if static_pipeline else None
                ),
            )
            self.pipeline = make_schedule(stages, loss_fn=self._pipeline_loss)
            self.runs_first_stage = any(stage.plan.is_first for stage in stages)
            self.runs_last_stage = any(stage.plan.is_last for stage in stages)
        self.expert_load = _expert_load(cfg.train, self.model, mesh, device)
        # train.objective=dpo: the pairs' loss and its reference model
        self.preference = (
            PreferenceObjective(
                cfg,
                mesh,
                device,
                self.model,
                self._compiled_loss,
                built.context,
                self.pipeline,
                make_schedule,
            )
            if t.objective == "dpo"
            else None
        )
        # Context parallel: each cp rank takes its share of every sequence (the model attends over
        # all of it), by the ContextParallel parallelize gave the model: the batch's placement
        # (parallel.cp_balance) is set once for both.
        self.context: ContextParallel | None = built.context
        self.step = 0
        # recorded in run.json as they are (composer3d-train's parallel=auto choice)
        self.run_info_extra: dict = {}
        # updates dropped for non-finite gradients (train.on_nonfinite=skip)
        self.nonfinite_skipped_steps = 0
        # consecutive updates dropped, for any reason (train.max_skipped_steps)
        self.dropped_in_a_row = 0
        # The hyperparameters this run asks for: a checkpoint restores its own, and the config's win
        # (see resume).
        self.optimizer_settings = configured_settings(self.optimizer)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One microbatch's summed token loss over the global count of trained targets (so
        microbatches add up).

        Targets of IGNORE_INDEX (-100: document boundaries, chat prompts) take no loss and are not
        counted. Under tensor parallel the logits stay sharded on the vocabulary (``loss``).
        ``compile.enabled`` compiles its kernels as it does the blocks.
        """
        return self._normalized(self._loss_sum(logits, targets))

    def _pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's loss of a microbatch: ``_loss``, or with train.objective=dpo
        the pairs' (``target``: the micro-batch's row numbers, ``PreferenceObjective``)."""
        if self.preference is None or self.evaluating:
            return self._loss(logits, target)
        return self._normalized(self.preference.pipeline_loss(logits, target))

    def _loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits not kept
        return cross_entropy_sum(logits, targets, compiled=self._compiled_loss, in_place=True)

    def _normalized(self, loss: torch.Tensor) -> torch.Tensor:
        if self.evaluating:
            return loss
        loss = loss / self.global_tokens
        return self.scaler.scale_loss(loss) if self.scaler else loss

    def _model_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``_loss`` of the model's logits; with memory.tile_loss the model computes it from its
        final hidden states in sequence tiles (``parallel.tiling``), inside its forward (FSDP's and
        autocast's scope)."""
        if self.cfg.train.loss_impl == "fused":
            head_loss = partial(self._fused_head_loss, targets=targets)
            return self._normalized(self.model(inputs, position_ids=positions, head_loss=head_loss))
        tiles = self.cfg.memory.tile_loss
        if tiles <= 1:
            return self._loss(self.model(inputs, position_ids=positions), targets)
        head_loss = partial(tiled_head_loss, targets=targets, tiles=tiles, loss_fn=self._loss_sum)
        return self._normalized(self.model(inputs, position_ids=positions, head_loss=head_loss))

    def _fused_head_loss(self, h: torch.Tensor, logits_fn, targets: torch.Tensor) -> torch.Tensor:
        """The head and summed loss fused (train.loss_impl=fused), from the head's weight as the
        model's forward holds it (FSDP's gathered one). Its gradients are computed in forward for
        the output gradient the step will send (``_normalized``'s), so they are rounded where
        autograd through the full logits rounds them."""
        norm, weight = self.model.linear_head()  # not None: checked with the config
        grad_scale = self._normalized(torch.ones((), device=self.device))
        return fused_linear_cross_entropy_sum(
            norm(h), weight, targets, compiled=self._compiled_loss, grad_scale=grad_scale
        )

    def _forward_backward(self, batch: Batch) -> torch.Tensor:
        """This rank's share of the step's loss (a sum of already-normalized microbatch losses),
        from the batch as ``_placed`` hands it to the model."""
        inputs, targets, positions, segment = self._placed(batch)
        reference = batch.reference  # preference.reference=precomputed: the pairs' sums
        total = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.runs_first_stage else ()
            kwargs = {} if positions is None else {"position_ids": positions}
            if self.preference is not None:  # its reference runs first
                targets = self.preference.pipeline_target(targets, segment, args, kwargs, reference)
            # return_outputs=False: the last stage would otherwise hold every microbatch's logits
            # until the step ends
            self.pipeline.step(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
            for loss in losses if self.runs_last_stage else []:
                total += loss.detach()
            return total
        position_chunks, segment_chunks, reference_chunks = (
            [None] * self.accumulation_steps if t is None else t.chunk(self.accumulation_steps)
            for t in (positions, segment, reference)
        )
        for i, (inp, tgt, pos, seg, ref) in enumerate(
            zip(
                inputs.chunk(self.accumulation_steps),
                targets.chunk(self.accumulation_steps),
                position_chunks,
                segment_chunks,
                reference_chunks,
            )
        ):
            if i and self.memory_tracker is not None:
                self.memory_tracker.reset_mod_stats()
            if self.preference is None:
                loss = self._model_loss(inp, tgt, pos)
            else:
                loss = self._normalized(self.preference.loss(self.model, inp, tgt, pos, seg, ref))
            loss.backward()
            total += loss.detach()
        return total

    def _placed(self, batch: Batch) -> tuple[torch.Tensor | None, ...]:
        """(inputs, targets, positions, segment) as this rank's model takes them. With
        data.document_masking, position_ids go to the model (under PP: to every stage, split into
        microbatches like the inputs); without, or with synthetic windows (no documents), they run
        0..seq-1 in every row and the model's causal default is the same, on its fastest kernel.
        Under cp, this rank's share of every row."""
        inputs, targets = batch.inputs, batch.targets
        documents = self.cfg.data.document_masking and self.cfg.data.name != "synthetic"
        positions = batch.position_ids if documents else None
        segment = batch.segment
        if self.context is not None:
            # one placement for the batch, every microbatch of it (DPO's segments with its targets)
            self.context.place(positions, inputs.shape[1])
            inputs, targets, positions, segment = (
                self.context.shard(t) for t in (inputs, targets, positions, segment)
            )
        return inputs, targets, positions, segment

    def _precompute_reference(self) -> None:
        """preference.reference=precomputed, before this run's first step: the reference's sums of
        every pair of the data, each data-parallel rank's share of the rows run as a step runs its
        forwards (the same shapes, the last forward's padded), then put together on every rank and
        kept with the data, which hands each batch its rows'."""
        started = time.perf_counter()
        sequences, layout = self.sequences, self.mesh.layout
        per_forward = self.cfg.train.global_batch_size // layout.dp
        mine = list(range(self.mesh.dp_rank, len(sequences), layout.dp))
        # every rank runs every forward (their collectives), a rank out of rows its first again
        rounds = math.ceil(math.ceil(len(sequences) / layout.dp) / per_forward)
        table = torch.zeros(int(sequences.pairs.sum()), 2, device=self.device)
        untrained = self.step == 0
        with self.preference.reference_for_the_pass(untrained):
            for i in range(rounds):
                rows = mine[i * per_forward : (i + 1) * per_forward]
                padded = rows + [rows[0] if rows else 0] * (per_forward - len(rows))
                inputs, targets, positions, segment = self._placed(
                    sequences.batch(padded).to(self.device)
                )
                pipeline_inputs = None
                if self.pipeline is not None:
                    args = (inputs,) if self.runs_first_stage else ()
                    pipeline_inputs = (args, {"position_ids": positions})
                sums = self.preference.pass_sums(
                    inputs, targets, positions, segment, self.accumulation_steps, pipeline_inputs
                )
                (row, slot), pair = sequences.pair_index(rows)
                table[pair.to(self.device)] = sums[row.to(self.device), slot.to(self.device)]
        # each pair computed on one data-parallel rank (and under PP on the last stage only)
        if layout.dp > 1:
            dist.all_reduce(table, group=self.mesh.dp.get_group())
        if layout.pp > 1:
            dist.all_reduce(table, group=self.mesh["pp"].get_group())
        sequences.reference = table.cpu()
        self.preference.pending_pass = None
        log.info(
            "preference.reference=precomputed: the reference's log-probabilities of %d pairs "
            "(%d rows), taken by %s in %.1f s",
            table.shape[0],
            len(sequences),
            "the untrained policy" if untrained else "a frozen copy of the initial policy",
            time.perf_counter() - started,
        )

    def train_step(self) -> dict:
        """One optimizer step. The loss and gradient norm stay on the device (this rank's share of
        the loss, not yet reduced): reading them back is a host sync, which ``fit`` does once per
        logging window."""
        if self.preference is not None and self.preference.pending_pass is not None:
            self._precompute_reference()  # before the loader builds a batch
        # built ahead on a background thread, already on its way to the device
        batch = self.loader.next_batch()
        # tokens through the model, all ranks
        processed = self.cfg.train.global_batch_size * batch.inputs.shape[1]
        # counted by the loader: no collective, no sync
        self.global_tokens = float(batch.global_targets)
        if batch.global_targets == 0:  # the same count on every rank: all skip alike
            log.warning(
                "step %d: no target in the global batch takes a loss (all masked: chat rows "
                "without assistant tokens in these windows?); step skipped, no update",
                self.step + 1,
            )
            self.scheduler.step()
            self.step += 1
            zero = torch.zeros((), device=self.device)
            return {
                "loss": zero,
                "grad_norm": zero,
                "lr": float(self.scheduler.get_last_lr()[0]),
                "tokens": processed,
                "target_tokens": 0,
                "update_skipped": True,
                **(
                    {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped_steps}
                    if self.scaler
                    else {}
                ),
            }
        scale = self.scaler.scale if self.scaler else 1.0
        if self.expert_load is not None:
            self.expert_load.before_step(scale)
        loss = self._forward_backward(batch) / scale
        sum_twin_grads(self.model)  # a tied embedding and its twin head on the last pipeline stage
        params = list(self.model.parameters())
        if self.sharder:  # ZeRO-1: this rank's slices of the reduced gradients
            self.sharder.finish_reduction()
            params = self.sharder.shards
        stepped = self.scaler.unscale_or_skip(params) if self.scaler else True
        if not stepped:
            log.info(
                "step %d: fp16 gradients overflowed; update skipped, loss scale now %g",
                self.step + 1,
                self.scaler.scale,
            )
        grad_norm = clip_grad_norm_(
            params,
            self.cfg.train.grad_clip,
            self.mesh.layout,
            self.shard_replicas,
            uncounted=uncounted_in_norm(self.model),
            optimizer=self.optimizer,
        )
        if stepped and self.cfg.train.on_nonfinite == "skip":
            # The global norm is the same on every rank, so all drop the update alike; reading it is
            # a host sync.
            stepped = bool(torch.isfinite(grad_norm))
            if not stepped:
                self.nonfinite_skipped_steps += 1
                log.warning(
                    "step %d: the gradient norm is %s; update dropped (train.on_nonfinite=skip)",
                    self.step + 1,
                    float(grad_norm),
                )
        lr = float(self.scheduler.get_last_lr()[0])  # torchao's optimizers keep lr as a tensor
        # a dropped update is dropped on every rank alike (the LR schedule still advances)
        if stepped:
            self.optimizer.step()
            if self.qk_clip is not None:
                self.qk_clip.apply()
            self.dropped_in_a_row = 0
        else:
            self.dropped_in_a_row += 1
        if self.expert_load is not None:
            self.expert_load.after_step(updated=stepped)
        self.scheduler.step()
        self.step += 1
        if self.dropped_in_a_row > self.cfg.train.max_skipped_steps:
            raise TrainingDiverged(
                f"step {self.step}: {self.dropped_in_a_row} updates in a row were dropped (fp16 "
                "overflow or non-finite gradients), more than "
                f"train.max_skipped_steps={self.cfg.train.max_skipped_steps}: training has "
                "diverged. Lower optim.lr, use bf16, or resume from an earlier checkpoint"
            )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": processed,
            "target_tokens": batch.global_targets,
            "update_skipped": not stepped,
        }
        if self.scaler:
            metrics.update(loss_scale=scale, skipped_steps=self.scaler.skipped_steps)
        if self.preference is not None:  # summed over this rank's pairs (read back per window)
            metrics["preference"] = self.preference.step_sums()
        if self.cfg.train.on_nonfinite == "skip":
            metrics["nonfinite_skipped_steps"] = self.nonfinite_skipped_steps
        if self.qk_clip is not None:
            metrics["attention_logit_max"] = self.qk_clip.largest
        return metrics

    def read_back(self, pending: list[tuple[int, dict]], window_start: float) -> list[dict]:
        """The logging window's records, reduced over the mesh and read back in one host sync
        (``readback``)."""
        return window_records(
            pending,
            window_start,
            self.mesh,
            self.device,
            self.pipeline is not None,
            self.expert_load,
            self.throughput,
        )

    def model_state_bytes(self) -> int:
        """Parameters, gradients (ZeRO-1's: its buckets) and optimizer state (ZeRO-1's masters) this
        rank holds."""
        held = self.sharder.gradient_bytes() + self.sharder.master_bytes() if self.sharder else 0
        return model_state_bytes(self.model, self.optimizer, held)

    def optimizer_state_dict(self, by_parameter: bool = True) -> dict:
        """FQN-keyed optimizer state, the same form whatever the layout (what DCP saves and
        re-shards); ``by_parameter``: its groups' settings too (``groups_by_parameter``; False:
        as checkpoints of format 1 hold them)."""
        if self.sharder:
            state = self.sharder.state_dict(self.optimizer, self.param_names)
        else:
            state = get_optimizer_state_dict(self.model, self.optimizer)
        state = optimizer_to_checkpoint_names(self.model, state)
        return groups_by_parameter(state) if by_parameter else state

    def load_optimizer_state_dict(self, state: dict) -> None:
        if isinstance(state["param_groups"], dict):  # by parameter
            state = groups_of_this_rank(state, self.optimizer_state_dict(by_parameter=False))
        state = with_configured_kernels(
            self.optimizer, optimizer_from_checkpoint_names(self.model, state)
        )
        if self.sharder:
            self.sharder.load_state_dict(self.optimizer, self.param_names, state)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state)

    def close(self) -> None:
        """Stop the data prefetch thread; let go of the optimizer's host files
        (parallel.offload_dir)."""
        if self.loader is not None:
            self.loader.close()
        if hasattr(self.optimizer, "close"):
            self.optimizer.close()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        # ZeRO-1's optimizer only sees its slices of the gradients
        self.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, windows: torch.Tensor) -> dict:
        """Mean next-token loss, perplexity and predicted-token count over ``windows`` (see
        ``commands/evaluate.py``), in the training layout: data-parallel ranks split the windows;
        under PP the schedule runs forward only."""
        per_forward = self.cfg.train.micro_batch_size * (
            self.accumulation_steps if self.pipeline is not None else 1
        )
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        if self.pipeline is not None:
            from composer3d.parallel.pipeline.schedule import forward_only  # see __init__
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        self.model.eval()
        self.evaluating = True
        try:
            for inputs, targets in window_batches(
                windows, self.mesh.dp_rank, self.mesh.layout.dp, per_forward
            ):
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                if self.context is not None:
                    self.context.place(None, inputs.shape[1])  # causal windows
                    inputs, targets = self.context.shard(inputs), self.context.shard(targets)
                count += (targets != IGNORE_INDEX).sum()
                if self.pipeline is None:
                    loss_sum += self._model_loss(inputs, targets).double()
                    continue
                losses: list[torch.Tensor] = []
                args = (inputs,) if self.runs_first_stage else ()
                forward_only(self.pipeline, *args, target=targets, losses=losses)
                for loss in losses if self.runs_last_stage else []:
                    loss_sum += loss.double()
        finally:
            self.evaluating = False
            self.model.train()
        for total in (loss_sum, count):
            dist.all_reduce(total, group=self.mesh.loss.get_group())
        # the loss lives on the last stage's ranks; the others add zero
        if self.pipeline is not None:
            dist.all_reduce(loss_sum, group=self.mesh["pp"].get_group())
        return eval_result(loss_sum.item(), int(count.item()))

    def restore_configured_settings(self) -> list[str]:
        """After a checkpoint load: this run's optimizer settings over the checkpoint's; returns
        what changed."""
        return restore_configured_settings(self.optimizer, self.scheduler, self.optimizer_settings)

    def fit(self, sink: MetricsSink, checkpointer) -> None:
        """Train from ``self.step`` to train.steps, logging, evaluating, saving (``checkpointer``: a
        ``checkpoint.Checkpointer``, or None) and stopping on signals (``loop``)."""
        train_loop(self, sink, checkpointer)


def _expert_load(
    train: TrainLoopConfig, model: torch.nn.Module, mesh: ParallelMesh, device: torch.device
) -> ExpertLoad | None:
    """The load metrics of a mixture-of-experts model (and, for composer3d's own, its balancing);
    None if dense."""
    routing = model.track_routing(device)
    if routing is None:
        return None
    return ExpertLoad(model, routing, train.global_batch_size, mesh, device, train.micro_batch_size)
