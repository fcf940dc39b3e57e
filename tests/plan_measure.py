"""Measure what composer3d-plan predicts, on real multi-process gloo training steps
(tests/test_plan.py).

Every layout of a list is trained for a few steps in one group of ``nproc`` processes (one
interpreter start-up for all of them, as ``harness.train_in_one_group``). A metered group runs three
meters on each rank around one steady-state ``Trainer.train_step`` (the second step: the optimizer
state exists):
  - collectives: a TorchDispatchMode sees every c10d op the step runs (FSDP's all-gathers and
    reduce-scatters, the functional collectives of DTensor's TP/SP, pipeline send/recv, the
    gradient-norm all-reduce, ZeRO-1's all-gather) and adds up the bytes each one carries, by kind
    and by the size of the group it runs on; it waits for each where it is issued (``_settle``), so
    that when gloo's thread lets go of a buffer cannot move the peak;
  - memory: torch's MemTracker (a dispatch mode with module and optimizer hooks, and FSDP's storage
    resizes; as composer3d-plan plan.measure=true runs it, ``plan.measure.PeakTracker``) gives the
    most bytes of tensors alive at once on the rank, parameters, gradients and optimizer state
    included.
A timed group of pipelines measures, in each of ``timed_steps`` steps after two untimed ones, the
time inside the stages' compute (``busy_s``: forward/backward chunks and the loss) and inside the
schedule's step (``schedule_s``) on each rank; a step's idle share is 1 − busy / the longest rank's
schedule time, as benchmarks/pipeline_bubble.py measures it (the loss, which the schedule computes
outside the last stage's chunks, counted as compute here). Each chunk's compute is lengthened by a
fixed wait (``pad_s`` per forward, twice that per backward, split between its input- and
weight-gradient halves where a schedule splits them): on a shared 2-core machine the ranks' own
compute runs at whatever share of a core the other processes leave it, so its length — and the idle
share it leaves — is the machine scheduler's, not the pipeline schedule's; a wait costs no core, so
every chunk takes the time the model gives it and what is left idle is the schedule's bubble and the
sends it waits on. Both groups collect garbage between steps, as training does (``train.gc_every``):
an automatic collection inside a chunk stalls one rank for 0.1–0.2 s. The model state (parameters,
gradients, optimizer state) is composer3d's own (``Trainer.model_state_bytes``). A pipeline's stages
also record what torch inferred they exchange (by messages at the first step) beside what
``parallel.pipeline.stage_boundary`` says from the config (plan.measure builds its stages with it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

c10d = torch.ops.c10d
funcol = torch.ops._c10d_functional

# c10d op → (kind, the argument whose bytes the collective carries: the gathered output, the reduced
# input)
C10D_OPS = {
    c10d._allgather_base_.default: ("all_gather", 0),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1),
    c10d.allreduce_.default: ("all_reduce", 0),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0),
    c10d.broadcast_.default: ("broadcast", 0),
    c10d.send.default: ("send", 0),
    c10d.alltoall_base_.default: ("all_to_all", 1),
}
FUNCOL_OPS = {
    funcol.all_gather_into_tensor.default: "all_gather",
    funcol.reduce_scatter_tensor.default: "reduce_scatter",
    funcol.all_reduce.default: "all_reduce",
    funcol.all_to_all_single.default: "all_to_all",
}


def _nbytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    return sum(_nbytes(a) for a in arg) if isinstance(arg, (list, tuple)) else 0


class CollectiveBytes(TorchDispatchMode):
    """Bytes per (kind, group size) of every collective dispatched while active: an all-gather
    counts its gathered output, a reduce-scatter its input, an all-reduce its tensor, a send what it
    sends (receives are not counted)."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}

    def _add(self, kind: str, group_size: int, nbytes: int) -> None:
        key = f"{kind}/{group_size}"
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in C10D_OPS:
            kind, index = C10D_OPS[func]
            group = next(a for a in args if isinstance(a, torch.ScriptObject))
            self._add(
                kind, torch.distributed.ProcessGroup.unbox(group).size(), _nbytes(args[index])
            )
            out = func(*args, **kwargs)
            # a send waits for its receive, which the peer may post after a send of its own
            if kind != "send":
                works = [
                    w
                    for w in (out if isinstance(out, tuple) else (out,))
                    if isinstance(w, torch.ScriptObject)
                ]
                _settle(
                    lambda: [torch.distributed.distributed_c10d.Work.unbox(w).wait() for w in works]
                )
            return out
        if func in FUNCOL_OPS:
            kind = FUNCOL_OPS[func]
            size = torch.distributed.distributed_c10d._resolve_process_group(args[-1]).size()
            self._add(kind, size, _nbytes(args[0]) * (size if kind == "all_gather" else 1))
            out = func(*args, **kwargs)
            _settle(lambda: funcol.wait_tensor(out))
            return out
        return func(*args, **kwargs)


def _settle(wait) -> None:
    """Wait for a collective where it is issued and give gloo's worker thread a moment to drop the
    buffers it holds. Otherwise the step goes on while that thread still references them (a block's
    gradients reduce-scattered, whose last Python reference FSDP or autograd drops at once), and
    when the thread next runs decides whether they are alive at the next block's peak: a block's
    gradient buffer more or less, from one run to the next."""
    wait()
    time.sleep(1e-3)


def _timed(method, into: list[float], pad_s: float = 0.0):
    """``method`` preceded by a wait of ``pad_s`` (simulated compute), adding its wall time to
    ``into`` per call."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        time.sleep(pad_s)
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return timed


def _stage_timer(trainer, busy: list[float], schedule_time: list[float], pad_s: float) -> None:
    """Time inside the stages' compute (``busy``: their forward/backward chunks, each lengthened by
    its share of the simulated compute, and the loss, which the schedule computes outside the last
    stage's forward chunk) and inside the schedule's step (``schedule_time``): the idle share of the
    schedule is the bubble (and the sends it waits on), not the optimizer step after it."""
    pipeline = trainer.pipeline
    pipeline.step = _timed(pipeline.step, schedule_time)
    pipeline._maybe_compute_loss = _timed(pipeline._maybe_compute_loss, busy)
    for stage in getattr(pipeline, "_stages", None) or [pipeline._stage]:
        stage.forward_one_chunk = _timed(stage.forward_one_chunk, busy, pad_s)
        backward = stage.backward_one_chunk

        def backward_one_chunk(*args, _backward=backward, **kwargs):
            # the full backward (2× a forward) or, where the schedule runs the weight gradients
            # apart, its half
            full = kwargs.get("full_backward", True)
            return _timed(_backward, busy, pad_s * (2 if full else 1))(*args, **kwargs)

        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = _timed(stage.backward_weight_one_chunk, busy, pad_s)


def _meta(tensor) -> list:
    return [list(tensor.shape), str(tensor.dtype), tensor.requires_grad]


def stage_shapes(trainer) -> dict[str, dict]:
    """Per stage of ``trainer``'s pipeline: its input and (but the last's, which stays on the rank)
    output as torch inferred them, and as ``stage_boundary`` gives them."""
    from composer3d.parallel.pipeline.stages import stage_boundary

    boundary = stage_boundary(trainer.cfg, trainer.mesh, trainer.accumulation_steps)
    shapes = {}
    for stage in getattr(trainer.pipeline, "_stages", None) or [trainer.pipeline._stage]:
        given = boundary.stage_args(stage.submod.plan)
        inferred = (stage._stage_meta.inputs[0], stage._stage_meta.outputs[0])
        sent = 1 if stage.is_last else 2
        shapes[str(stage.stage_index)] = {
            "inferred": [_meta(t) for t in inferred[:sent]],
            "boundary": [_meta(t) for t in given[:sent]],
        }
    return shapes


def measure_layouts(
    rank: int,
    nproc: int,
    jobs: list[list[str]],
    out_dir: str,
    timed_steps: int,
    pad_s: float,
    store: str,
) -> None:
    """Worker of ``mp.spawn``: each job (overrides) trained for two steps (the first creates the
    optimizer state); with ``timed_steps`` = 0 the second is metered (collectives, peak memory,
    model state), otherwise a pipeline is timed for ``timed_steps`` more, with ``pad_s`` of
    simulated compute per forward chunk. Rank R writes out_dir/<job>.rankR.json."""
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc)
    )
    import torch.distributed as dist
    from hydra import compose, initialize_config_module

    from composer3d.config.registration import register_configs
    from composer3d.data import build_sequences
    from composer3d.launch.distributed import Env, shut_down
    from composer3d.launch.rank import prepare_rank
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.plan.measure import PeakTracker
    from composer3d.training.garbage import StepGarbageCollection
    from composer3d.training.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nproc)
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        for index, overrides in enumerate(jobs):
            cfg = compose(
                "train", overrides=[f"launch.nproc_per_node={nproc}", "run.dir=unused", *overrides]
            )
            layout, device = prepare_rank(cfg, Env(rank, rank, nproc))
            torch.manual_seed(cfg.train.seed)
            sequences = build_sequences(
                cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model
            )
            trainer = Trainer(cfg, ParallelMesh(layout, device.type), device, sequences)
            busy: list[float] = []
            schedule_time: list[float] = []
            result: dict = {"busy_s": [], "schedule_s": []} if timed_steps else {}
            with StepGarbageCollection(every=1) as garbage:  # as training collects: between steps
                for step in range(2 + timed_steps):
                    dist.barrier()
                    if step == 2:
                        _stage_timer(trainer, busy, schedule_time, pad_s)
                    busy.clear()
                    schedule_time.clear()
                    if step == 1 and not timed_steps:
                        comms, tracker = CollectiveBytes(), PeakTracker()
                        tracker.track_external(trainer.model, trainer.optimizer)
                        with tracker, comms:
                            trainer.train_step()
                        result["collective_bytes"] = comms.bytes
                        result["peak_bytes"] = int(
                            max(
                                stats["Total"]
                                for stats in tracker.get_tracker_snapshot("peak").values()
                            )
                        )
                        result["model_state_bytes"] = trainer.model_state_bytes()
                        if trainer.pipeline is not None:
                            result["stage_shapes"] = stage_shapes(trainer)
                    else:
                        trainer.train_step()
                    if step >= 2:
                        result["busy_s"].append(sum(busy))
                        result["schedule_s"].append(sum(schedule_time))
                    trainer.zero_grad()
                    garbage.after_step(step)
            trainer.close()
            Path(out_dir, f"{index}.rank{rank}.json").write_text(json.dumps(result))
            del trainer
    shut_down(finished=True)


def run_measurements(
    jobs: list[list[str]], nproc: int, out_dir: Path, timed_steps: int = 0, pad_s: float = 0.0
) -> list[list[dict]]:
    """Per job, per rank: what ``measure_layouts`` recorded (metered, or timed pipelines with
    ``timed_steps``)."""
    from harness import processes

    out_dir.mkdir(parents=True, exist_ok=True)
    processes(
        measure_layouts,
        nproc,
        nproc,
        jobs,
        str(out_dir),
        timed_steps,
        pad_s,
        str(out_dir / "store"),
    )
    return [
        [json.loads((out_dir / f"{i}.rank{r}.json").read_text()) for r in range(nproc)]
        for i in range(len(jobs))
    ]
