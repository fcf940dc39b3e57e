"""``composer3d-plan plan.measure=true``: one rank of a layout measured here, before the cluster
exists.

The rank runs real training steps of the real model shapes on this machine's device (launch.device)
in a process group of the layout's world size whose other ranks do not exist: torch's fake backend
completes every collective at once without moving data (Megatron's --fake-process-group and
torchtitan's fake backend work the same way). So the rank allocates what it would on the cluster —
its parameter, gradient and optimizer shards, the buffers FSDP gathers into, TP's and cp's local
activations, its pipeline stages' micro-batches — and computes what it would, while communication
takes no time. A pipeline rank's stages are built with the shapes they exchange
(``parallel.pipeline.stage_boundary``: there is no other stage to ask) and run the rank's part of
the schedule, so the micro-batches 1F1B or an interleaved schedule keeps in flight there are held as
on the cluster. Its numbers sit beside the planner's for the same rank:

  - peak memory: the most bytes of tensors alive at once during a step (torch's MemTracker, which
    counts tensors as the planner models them, on any device), against the planner's total for the
    rank's pipeline stage;
  - model state: parameters, gradients and optimizer state (and train.objective=dpo's frozen
    reference copy's parameters), against the planner's;
  - compute time: the step's wall time (communication free), against the planner's compute time —
    comparable only where this device is ``cluster.device``.

The values the fake collectives and receives leave (zeros, or what the buffers held) make the loss
meaningless: only sizes and times are read. The zero-bubble schedules are refused
(plan/validation.py): the tracker's module hooks cannot follow the ``autograd.grad`` they split
input from weight gradients with.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

# Registers the "fake" backend. A torch testing module, but the documented way to get a fake process
# group (torchtitan and torch's own memory estimators use it).
from torch.testing._internal.distributed.fake_pg import FakeStore

from composer3d.config.schema import TrainConfig
from composer3d.data import build_sequences
from composer3d.launch.distributed import Env
from composer3d.launch.rank import prepare_rank
from composer3d.parallel.mesh import ParallelMesh
from composer3d.training.metrics import local_bytes
from composer3d.training.trainer import Trainer


@dataclass
class RankMeasurement:
    rank: int
    world_size: int
    pp_rank: int
    device: str
    peak_bytes: int
    model_state_bytes: int
    step_s: list[float]

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    def as_json(self) -> dict:
        return {**asdict(self), "median_step_s": self.median_step_s}


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class PeakTracker(MemTracker):
    """MemTracker reading only the rank's peak, which it counts per tensor whatever its module hooks
    record.

    A module run again within a step is the next micro-batch (gradient accumulation, pipeline
    schedules) rather than an error: the per-module stats start afresh. An interleaved schedule runs
    another stage's forward before this one's backwards: the backward hooks of a module whose stats
    that cleared are passed by. A frozen parameter (a peft run's base) has no gradient to follow,
    and torch refuses a gradient hook on it.
    """

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        for param in module.parameters():
            # as if hooked already: MemTracker then hooks only what trains
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module, inputs):
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    def _post_fw_hook(self, module, inputs, outputs):
        if module in self.memory_tracking:
            super()._post_fw_hook(module, inputs, outputs)

    def _pre_bw_hook(self, module, args):
        if module is None or module in self.memory_tracking:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module, args):
        if module is None or module in self.memory_tracking:
            super()._post_bw_hook(module, args)


def measure_rank(cfg: TrainConfig, world_size: int, rank: int, steps: int) -> RankMeasurement:
    """Run rank ``rank`` of a ``world_size``-rank job of ``cfg`` here for ``steps`` + 1 steps: the
    first builds the optimizer state and warms up; the next is tracked for memory; each after it is
    timed."""
    layout, device = prepare_rank(cfg, Env(rank, 0, world_size))
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        torch.manual_seed(cfg.train.seed)
        sequences = build_sequences(
            cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model
        )
        mesh = ParallelMesh(layout, device.type)
        trainer = Trainer(cfg, mesh, device, sequences, static_pipeline=True)
        if trainer.preference is not None and trainer.preference.pending_pass is not None:
            # preference.reference=precomputed: its pass over the data runs before the first step
            # and is no step's, so it is not run here (the sums it would give: zeros)
            sequences.reference = torch.zeros(int(sequences.pairs.sum()), 2)
            trainer.preference.pending_pass = None
        tracker = PeakTracker()
        # DPO's frozen copy, tracked now (its shards, before its forward leaves part of it gathered
        # in their place) and after the warm-up (what it left gathered)
        copies = _frozen_copies(trainer)
        copy_bytes = sum(local_bytes(p) for m in copies for p in m.parameters())
        tracker.track_external(*copies)
        trainer.train_step()
        trainer.zero_grad()
        tracker.track_external(trainer.model, trainer.optimizer, *copies)
        with tracker:
            trainer.train_step()
        peak = int(max(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values()))
        state = trainer.model_state_bytes() + copy_bytes
        trainer.zero_grad()
        times = []
        for _ in range(max(steps - 1, 1)):
            start = time.perf_counter()
            trainer.train_step()
            _synchronize(device)
            times.append(time.perf_counter() - start)
            trainer.zero_grad()
        pp_rank = mesh["pp"].get_local_rank() if mesh.layout.pp > 1 else 0
        trainer.close()
        return RankMeasurement(rank, world_size, pp_rank, str(device), peak, state, times)
    finally:
        dist.destroy_process_group()


def _frozen_copies(trainer: Trainer) -> list[torch.nn.Module]:
    """train.objective=dpo's reference model where it is a model of its own
    (preference.reference=copy)."""
    reference = trainer.preference.reference if trainer.preference else None
    return [] if reference is None or reference is trainer.model else [reference]


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":  # the step's kernels, queued on the accelerator, are part of its time
        torch.accelerator.synchronize(device)


def comparison(measured: RankMeasurement, estimate, cluster) -> dict:
    """The measured rank beside the planner's prediction for the same rank (its pipeline stage)."""
    predicted = estimate.memory_per_pp_rank[measured.pp_rank]
    return {
        "layout": estimate.candidate.short(),
        "measured": measured.as_json(),
        "predicted": {
            "peak_bytes": round(predicted.total),
            "model_state_bytes": round(predicted.model_state),
            "compute_s": estimate.compute_s,
            "device": cluster.device,
            "calibration": cluster.rates.note if cluster.rates else None,
        },
        "ratio": {
            "peak_bytes": measured.peak_bytes / predicted.total,
            "model_state_bytes": measured.model_state_bytes / predicted.model_state,
            "compute_s": measured.median_step_s / estimate.compute_s,
        },
    }
