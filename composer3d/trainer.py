"""The Trainer: one rank's model, optimizer, data and step loop, under any layout (``train.py`` is the CLI).

One step: the global batch is fixed by the seed; this data-parallel rank takes its slice and runs it as
micro-batches (gradient accumulation). Each micro-batch's summed token loss is divided by the count of targets
that take a loss (not -100: document boundaries, chat prompts) in the whole global batch, so the gradient — and
the logged loss — are the same under every layout. The batch's position_ids go to the model with the inputs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from composer3d import distributed
from composer3d.assemble import build_parallel_model
from composer3d.checkpoint import Checkpointer
from composer3d.config import pipeline_microbatches, validate, validate_for_device
from composer3d.data import (
    IGNORE_INDEX,
    Batch,
    BatchPrefetcher,
    GlobalBatchLoader,
    PackedSequences,
    eval_result,
    window_batches,
)
from composer3d.console import human_bytes
from composer3d.errors import StoppedBySignal, TrainingDiverged
from composer3d.expert_load import ExpertLoad
from composer3d.flops import peak_flops
from composer3d.garbage import StepGarbageCollection
from composer3d.grad import clip_grad_norm_
from composer3d.layout import ParallelMesh
from composer3d.loss import cross_entropy_sum
from composer3d.metrics import (
    MetricsSink,
    Throughput,
    max_over_ranks,
    memory_breakdown,
    model_state_bytes,
    peak_memory_bytes,
)
from composer3d.models.hf import expert_count, hf_expert_modules, load_hf_config
from composer3d.models.hf_experts import count_routing
from composer3d.models.llama import is_moe_layer
from composer3d.optim import build_optimizer, build_scheduler, configured_settings
from composer3d.parallel.pipeline import build_schedule
from composer3d.precision import DynamicLossScaler
from composer3d.stop_signals import StopSignals

log = logging.getLogger("composer3d")


class Trainer:
    def __init__(self, cfg: DictConfig, mesh: ParallelMesh, device: torch.device, sequences: PackedSequences | None,
                 eval_windows: torch.Tensor | None = None, from_checkpoint: bool = False):
        """``sequences``: the training data (None: evaluation only); ``eval_windows``: for train.eval_every;
        ``from_checkpoint``: the weights will be loaded from a checkpoint (``build_parallel_model``)."""
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t, p = cfg.train, cfg.parallel
        built = build_parallel_model(cfg, mesh, device, from_checkpoint)
        self.model, self.num_params, stages = built.model, built.num_params, built.stages
        self.active_params = built.active_params
        self.throughput = Throughput(built.flops_per_token, peak_flops(device, cfg.precision.param_dtype,
                                                                       cfg.logging.peak_tflops),
                                     mesh.layout.world_size)
        self.param_names = [name for name, _ in self.model.named_parameters()]
        self.optimizer, self.sharder = build_optimizer(self.model, cfg.optim,
                                                       zero1_mesh=mesh.dp if p.zero_stage == 1 else None)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
        self.total_steps = t.steps
        self.loader = None if sequences is None else BatchPrefetcher(
            GlobalBatchLoader(sequences, t.global_batch_size, mesh.dp_rank, mesh.layout.dp, t.seed), device)
        self.eval_windows = eval_windows
        self.evaluating = False  # the loss function then returns plain summed losses (see evaluate)
        self.accumulation_steps = pipeline_microbatches(cfg, mesh.layout.dp)
        self.global_tokens = 1.0  # trained targets in the current global batch (a host number: no sync)
        self.memory_tracker = None  # set while logging.memory_breakdown measures a step
        self.scaler = None
        if cfg.precision.param_dtype == "float16":  # fp16's narrow range needs loss scaling; bf16 does not
            self.scaler = DynamicLossScaler(cfg.precision.loss_scale_init, cfg.precision.loss_scale_growth_interval,
                                            device)
        self.pipeline = None
        if stages:
            self.pipeline = build_schedule(stages, p.pp_schedule, self.accumulation_steps, mesh["pp"].get_group(),
                                           device, self._loss)
            self.runs_first_stage = any(stage.plan.is_first for stage in stages)
            self.runs_last_stage = any(stage.plan.is_last for stage in stages)
        self.expert_load = _expert_load(cfg, self.model, mesh, device)
        self.step = 0
        self.run_info_extra: dict = {}  # recorded in run.json as they are (composer3d-train's parallel=auto choice)
        self.nonfinite_skipped_steps = 0  # updates dropped for non-finite gradients (train.on_nonfinite=skip)
        self.dropped_in_a_row = 0  # consecutive updates dropped, for any reason (train.max_skipped_steps)
        # The hyperparameters this run asks for: a checkpoint restores its own, and the config's win (see resume).
        self.optimizer_settings = configured_settings(self.optimizer)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One microbatch's summed token loss over the global count of trained targets (so microbatches add up).

        Targets of IGNORE_INDEX (-100: document boundaries, chat prompts) take no loss and are not counted. Under
        tensor parallel the logits stay sharded on the vocabulary (``loss``). ``compile.enabled`` compiles its
        kernels as it does the blocks.
        """
        loss = cross_entropy_sum(logits, targets, compiled=self.cfg.compile.enabled)
        if self.evaluating:
            return loss
        loss = loss / self.global_tokens
        return self.scaler.scale_loss(loss) if self.scaler else loss

    def _forward_backward(self, batch: Batch) -> torch.Tensor:
        """This rank's share of the step's loss (a sum of already-normalized microbatch losses).

        With data.document_masking, position_ids go to the model (under PP: to every stage, split into microbatches
        like the inputs); without, or with synthetic windows (no documents), they run 0..seq-1 in every row and the
        model's causal default is the same, on its fastest kernel.
        """
        inputs, targets = batch.inputs, batch.targets
        documents = self.cfg.data.document_masking and self.cfg.data.name != "synthetic"
        positions = batch.position_ids if documents else None
        total = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.runs_first_stage else ()
            # return_outputs=False: the last stage would otherwise hold every microbatch's logits until the step ends
            self.pipeline.step(*args, target=targets, losses=losses, return_outputs=False,
                               **({} if positions is None else {"position_ids": positions}))
            for loss in losses if self.runs_last_stage else []:
                total += loss.detach()
            return total
        position_chunks = [None] * self.accumulation_steps if positions is None else positions.chunk(self.accumulation_steps)
        for i, (inp, tgt, pos) in enumerate(zip(inputs.chunk(self.accumulation_steps),
                                                targets.chunk(self.accumulation_steps), position_chunks)):
            if i and self.memory_tracker is not None:
                self.memory_tracker.reset_mod_stats()
            loss = self._loss(self.model(inp, position_ids=pos), tgt)
            loss.backward()
            total += loss.detach()
        return total

    def train_step(self) -> dict:
        """One optimizer step. The loss and gradient norm stay on the device (this rank's share of the loss,
        not yet reduced): reading them back is a host sync, which ``fit`` does once per logging window."""
        batch = self.loader.next_batch()  # built ahead on a background thread, already on its way to the device
        processed = self.cfg.train.global_batch_size * batch.inputs.shape[1]  # tokens through the model, all ranks
        self.global_tokens = float(batch.global_targets)  # counted by the loader: no collective, no sync
        if batch.global_targets == 0:  # the same count on every rank: all skip alike
            log.warning("step %d: no target in the global batch takes a loss (all masked: chat rows without "
                        "assistant tokens in these windows?); step skipped, no update", self.step + 1)
            self.scheduler.step()
            self.step += 1
            zero = torch.zeros((), device=self.device)
            return {"loss": zero, "grad_norm": zero, "lr": float(self.scheduler.get_last_lr()[0]),
                    "tokens": processed, "target_tokens": 0, "update_skipped": True,
                    **({"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped_steps}
                       if self.scaler else {})}
        scale = self.scaler.scale if self.scaler else 1.0
        if self.expert_load is not None:
            self.expert_load.before_step(scale)
        loss = self._forward_backward(batch) / scale
        params = list(self.model.parameters())
        stepped = self.scaler.unscale_or_skip(params) if self.scaler else True
        if not stepped:
            log.info("step %d: fp16 gradients overflowed; update skipped, loss scale now %g",
                     self.step + 1, self.scaler.scale)
        grad_norm = clip_grad_norm_(params, self.cfg.train.grad_clip,
                                    pp_group=self.mesh["pp"].get_group() if self.pipeline is not None else None)
        if stepped and self.cfg.train.on_nonfinite == "skip":
            # The global norm is the same on every rank, so all drop the update alike; reading it is a host sync.
            stepped = bool(torch.isfinite(grad_norm))
            if not stepped:
                self.nonfinite_skipped_steps += 1
                log.warning("step %d: the gradient norm is %s; update dropped (train.on_nonfinite=skip)",
                            self.step + 1, float(grad_norm))
        lr = float(self.scheduler.get_last_lr()[0])  # torchao's optimizers keep lr as a tensor
        if stepped:  # a dropped update is dropped on every rank alike (the LR schedule still advances)
            self.optimizer.step()
            self.dropped_in_a_row = 0
        else:
            self.dropped_in_a_row += 1
        if self.expert_load is not None:
            self.expert_load.after_step(updated=stepped)
        self.scheduler.step()
        self.step += 1
        if self.dropped_in_a_row > self.cfg.train.max_skipped_steps:
            raise TrainingDiverged(f"step {self.step}: {self.dropped_in_a_row} updates in a row were dropped "
                                   f"(fp16 overflow or non-finite gradients), more than train.max_skipped_steps="
                                   f"{self.cfg.train.max_skipped_steps}: training has diverged. Lower optim.lr, "
                                   "use bf16, or resume from an earlier checkpoint")
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": processed,
                   "target_tokens": batch.global_targets, "update_skipped": not stepped}
        if self.scaler:
            metrics.update(loss_scale=scale, skipped_steps=self.scaler.skipped_steps)
        if self.cfg.train.on_nonfinite == "skip":
            metrics["nonfinite_skipped_steps"] = self.nonfinite_skipped_steps
        return metrics

    def read_back(self, pending: list[tuple[int, dict]], window_start: float) -> list[dict]:
        """The logging window's records: the steps' losses summed over the mesh in one collective, then read
        back with the gradient norms and peak memory in one host sync; times are the window's average."""
        losses = torch.stack([metrics["loss"] for _, metrics in pending])
        dist.all_reduce(losses, group=self.mesh.loss.get_group())
        if self.pipeline is not None:  # only the last stage's ranks hold it; the others add zero
            dist.all_reduce(losses, group=self.mesh["pp"].get_group())
        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        norms = torch.stack([metrics["grad_norm"].float() for _, metrics in pending])
        values = torch.cat([losses.double(), norms.double(), peak]).tolist()
        experts = self.expert_load.read(len(pending)) if self.expert_load is not None else {}
        step_time = (time.perf_counter() - window_start) / len(pending)
        records = []
        for i, (step, metrics) in enumerate(pending):
            tokens_per_s = metrics["tokens"] / step_time
            records.append({
                "step": step, "loss": _finite_or_none(values[i]),
                "grad_norm": _finite_or_none(values[len(pending) + i]), "lr": metrics["lr"],
                "tokens_per_s": tokens_per_s, "step_time_s": step_time, "peak_mem_bytes": int(values[-1]),
                **self.throughput.of(tokens_per_s), **experts,
                **{k: metrics[k] for k in ("loss_scale", "skipped_steps", "nonfinite_skipped_steps") if k in metrics},
                **({"update_skipped": True} if metrics["update_skipped"] else {})})
        return records

    def optimizer_state_dict(self) -> dict:
        """FQN-keyed optimizer state, the same form whatever the layout (what DCP saves and re-shards)."""
        if self.sharder:
            return self.sharder.state_dict(self.optimizer, self.param_names)
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_optimizer_state_dict(self, state: dict) -> None:
        if self.sharder:
            self.sharder.load_state_dict(self.optimizer, self.param_names, state)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state)

    def close(self) -> None:
        """Stop the data prefetch thread."""
        if self.loader is not None:
            self.loader.close()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # ZeRO-1's optimizer only sees its slices of the gradients

    @torch.no_grad()
    def evaluate(self, windows: torch.Tensor) -> dict:
        """Mean next-token loss, perplexity and predicted-token count over ``windows`` (see ``evaluate.py``),
        in the training layout: data-parallel ranks split the windows; under PP the schedule runs forward only."""
        per_forward = self.cfg.train.micro_batch_size * (self.accumulation_steps if self.pipeline is not None else 1)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        self.model.eval()
        self.evaluating = True
        try:
            for inputs, targets in window_batches(windows, self.mesh.dp_rank, self.mesh.layout.dp, per_forward):
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                count += (targets != IGNORE_INDEX).sum()
                if self.pipeline is None:
                    loss_sum += self._loss(self.model(inputs), targets).double()
                    continue
                losses: list[torch.Tensor] = []
                args = (inputs,) if self.runs_first_stage else ()
                self.pipeline.eval(*args, target=targets, losses=losses)
                for loss in losses if self.runs_last_stage else []:
                    loss_sum += loss.double()
        finally:
            self.evaluating = False
            self.model.train()
        for total in (loss_sum, count):
            dist.all_reduce(total, group=self.mesh.loss.get_group())
        if self.pipeline is not None:  # the loss lives on the last stage's ranks; the others add zero
            dist.all_reduce(loss_sum, group=self.mesh["pp"].get_group())
        return eval_result(loss_sum.item(), int(count.item()))

    def fit(self, sink: MetricsSink, checkpointer: Checkpointer | None) -> None:
        """Train from ``self.step`` to train.steps; SIGTERM/SIGUSR1 stop it early at a step boundary (``StopSignals``),
        raising StoppedBySignal once that step's checkpoint is committed."""
        if self.step == self.cfg.train.steps:
            log.info("already finished: step %d of train.steps=%d; nothing to train", self.step, self.step)
        signals = StopSignals(timedelta(minutes=self.cfg.launch.timeout_minutes))
        try:
            with StepGarbageCollection(self.cfg.train.gc_every) as garbage:
                self._fit(sink, checkpointer, signals, garbage)
        finally:
            signals.restore()

    def _fit(self, sink: MetricsSink, checkpointer: Checkpointer | None, signals: StopSignals,
             garbage: StepGarbageCollection) -> None:
        cfg = self.cfg
        run_info = {
            "layout": self.mesh.layout.as_dict(), "world_size": dist.get_world_size(),
            "zero_stage": cfg.parallel.zero_stage, "sequence_parallel": cfg.parallel.sequence_parallel,
            "num_params": self.num_params, "device": self.device.type,
            **({"num_active_params": self.active_params} if self.active_params != self.num_params else {}),
            "accumulation_steps": self.accumulation_steps, "flops_per_token": self.throughput.flops_per_token,
            "peak_flops_per_device": self.throughput.peak, **self.run_info_extra,
        }
        pending: list[tuple[int, dict]] = []  # steps whose metrics are still on the device
        window_start = time.perf_counter()
        while self.step < cfg.train.steps:
            # The second step is the steady state (optimizer state exists): measure it when asked.
            measure = cfg.logging.memory_breakdown and "model_state_bytes_per_rank" in run_info \
                and "memory_breakdown_bytes_per_rank" not in run_info
            with memory_breakdown(self.model, self.optimizer) if measure else contextlib.nullcontext(({}, None)) \
                    as (breakdown, self.memory_tracker):
                metrics = self.train_step()
            self.memory_tracker = None
            if measure:
                run_info["memory_breakdown_bytes_per_rank"] = {
                    k: int(max_over_ranks(v, self.device)) for k, v in sorted(breakdown.items())}
                sink.write_run_info(run_info)
            if "model_state_bytes_per_rank" not in run_info:  # grads and optimizer state exist now: measure them
                run_info["model_state_bytes_per_rank"] = int(
                    max_over_ranks(model_state_bytes(self.model, self.optimizer), self.device))
                sink.write_run_info(run_info)
                log.info("model state: %s per rank (parameters, gradients and optimizer state; the largest rank)",
                         human_bytes(run_info["model_state_bytes_per_rank"]))
            self.zero_grad()
            garbage.after_step(self.step)
            pending.append((self.step, metrics))
            last = self.step == cfg.train.steps
            stop = 0 if last else signals.agreed()  # the last step ends the run anyway
            every = cfg.train.eval_every
            evaluating = bool(every) and self.eval_windows is not None and (self.step % every == 0 or last)
            saving = checkpointer is not None and (checkpointer.due(self.step) or bool(stop))
            if checkpointer is not None:
                checkpointer.poll()
            if not (self.step % cfg.logging.log_every == 0 or last or evaluating or saving or stop):
                continue
            records = self.read_back(pending, window_start)
            pending = []
            diverged = next((r for r in records if "update_skipped" not in r
                             and (r["loss"] is None or r["grad_norm"] is None)), None)
            if diverged is not None:  # before any evaluation or checkpoint of this state
                sink.log(records, to_console=True)
                raise TrainingDiverged(
                    f"step {diverged['step']}: the loss or gradient norm is not finite (NaN/inf) and "
                    "train.on_nonfinite=stop: stopped without saving this state; the last checkpoint written "
                    "before it is kept. Lower optim.lr or resume from that checkpoint, or set "
                    "train.on_nonfinite=skip to drop such updates")
            if evaluating:
                evaluated = self.evaluate(self.eval_windows)
                records[-1].update(eval_loss=evaluated["loss"], eval_perplexity=evaluated["perplexity"])
            if saving:
                started = time.perf_counter()
                checkpointer.save(self.step)
                records[-1]["checkpoint_blocked_s"] = time.perf_counter() - started  # training waited this long
            sink.log(records, to_console=self.step % cfg.logging.log_every == 0 or last)
            if stop:
                self._stop(stop, checkpointer, signals)
            window_start = time.perf_counter()
        if checkpointer is not None:
            checkpointer.wait()
        signals.finish()

    def _stop(self, signum: int, checkpointer: Checkpointer | None, signals: StopSignals) -> None:
        """End the run at this step for a stop signal, its checkpoint (just started) committed first."""
        if checkpointer is not None:
            checkpointer.wait()
            saved = f"checkpoint step-{self.step:08d} saved"
        else:
            saved = f"step {self.step}, nothing saved (checkpoint.enabled=false)"
        signals.finish()
        message = f"received {signal.Signals(signum).name}: {saved}; exiting so the job can be requeued"
        log.info("%s (exit code %d)", message, StoppedBySignal.EXIT_CODE)
        raise StoppedBySignal(message)


def _expert_load(cfg: DictConfig, model: torch.nn.Module, mesh: ParallelMesh, device: torch.device) -> ExpertLoad | None:
    """The load metrics of a mixture-of-experts model (and, for composer3d's own, its balancing); None if dense."""
    batch = cfg.train.global_batch_size
    if cfg.model.name == "llama" and cfg.model.moe.experts > 0:
        moe_layers = sum(is_moe_layer(cfg.model, i) for i in range(cfg.model.n_layers))
        return ExpertLoad(model, cfg.model.moe.experts, batch, mesh, device, balancing=(cfg.model.moe, moe_layers))
    if cfg.model.name == "hf":
        experts = expert_count(load_hf_config(cfg.model.path))
        if experts:
            count_routing(hf_expert_modules(model), device)
            return ExpertLoad(model, experts, batch, mesh, device, router_loss=getattr(model, "router_loss", None),
                              micro_batch_size=cfg.train.micro_batch_size)
    return None


def _finite_or_none(value: float) -> float | None:
    """metrics.jsonl is strict JSON, which has no NaN or infinity: such values are written as null."""
    return value if math.isfinite(value) else None


def prepare_rank(cfg: DictConfig, env: distributed.Env | None) -> tuple[dict, torch.device]:
    """Checks and settings every rank makes before its process group exists (training and evaluation alike):
    the layout's degrees, this rank's device, and the resolved compute dtype."""
    degrees = validate(cfg, env.world_size if env else 1)
    device = distributed.resolve_device(cfg.launch.device, env.local_rank if env else 0)
    validate_for_device(cfg, degrees, device.type)
    if cfg.precision.param_dtype == "auto":  # bf16 compute where it is fast; fp32 on the CPU
        cfg.precision.param_dtype = "float32" if device.type == "cpu" else "bfloat16"
    return degrees, device
