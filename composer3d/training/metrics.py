"""What a run reports: metrics.jsonl and run.json in the run directory, console/progress bar, wandb,
tensorboard.

Only rank 0 writes; every rank computes, so the values (already reduced across the mesh) are the
job's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import secrets
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composer3d.config.schema import TrainConfig
from composer3d.launch.preflight import metrics_records
from composer3d.training.console import is_terminal, terminal_console

log = logging.getLogger("composer3d")


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t``: its shard, and for tensor subclasses (torchao's quantized
    optimizer state, float8 weights) the bytes of the tensors inside, not the logical dtype."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if hasattr(local, "__tensor_flatten__"):
        inner_names, _ = local.__tensor_flatten__()
        return sum(local_bytes(getattr(local, name)) for name in inner_names)
    return local.numel() * local.element_size()


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, gradient_buffers: int = 0
) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards, not the whole
    model); ``gradient_buffers``: gradients held apart from the parameters' .grad (ZeRO-1's
    buckets)."""
    params = list(model.parameters())
    total = gradient_buffers + sum(local_bytes(p) for p in params)
    total += sum(local_bytes(p.grad) for p in params if p.grad is not None)
    total += sum(
        local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return total


@contextlib.contextmanager
def memory_breakdown(model: nn.Module, optimizer: torch.optim.Optimizer):
    """Peak bytes per category (PARAM, GRAD, ACT, OPT, TEMP, …) on this rank while the block runs.

    torch's memory trackers count every tensor as it is allocated (a dispatch mode plus module
    hooks), so they work on the CPU, where there are no allocator statistics; they slow the step
    down, so they measure one. The FSDP tracker for a sharded model, the plain one where FSDP does
    not run (no data-parallel dim).
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
        tracker.track_inputs(())
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    result: dict[str, int] = {}
    with tracker:
        yield (
            result,
            tracker,
        )  # call tracker.reset_mod_stats() between micro-batches (it follows one pass)
    for stats in tracker.get_tracker_snapshot("peak").values():
        for category, value in stats.items():
            name = str(category).split(".")[-1]
            result[name] = max(result.get(name, 0), int(value))


def max_over_ranks(value: int | float, device: torch.device) -> float:
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """The memory peaks a record reports: on CPU the process's peak resident set size (all host
    memory); on an accelerator the peak allocated, and the peak its caching allocator reserved
    (allocated plus cached free blocks: the figure that meets the device's capacity, and the one
    torchtitan prints as its memory)."""
    if device.type == "cpu":
        return {
            "peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        }  # Linux reports KiB
    return {
        "peak_mem_bytes": torch.accelerator.max_memory_allocated(device),
        "peak_reserved_bytes": torch.accelerator.max_memory_reserved(device),
    }


def _number(value: float | None, spec: str) -> str:
    # None: NaN/inf, which JSON cannot hold
    return "non-finite" if value is None else format(value, spec)


class Throughput:
    """Per-device rates of a run from its job-wide tokens/s: tokens/s per device, model TFLOP/s per
    device and MFU (None where the device's peak is unknown, e.g. the CPU; ``logging.peak_tflops``
    sets it)."""

    def __init__(self, flops_per_token: int, peak_flops_per_device: float | None, world_size: int):
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_device
        self.world_size = world_size

    def of(self, tokens_per_s: float) -> dict:
        per_device = tokens_per_s / self.world_size
        flops = per_device * self.flops_per_token
        return {
            "tokens_per_s_per_device": per_device,
            "tflops_per_s": flops / 1e12,
            "mfu": flops / self.peak if self.peak else None,
        }


WANDB_RUN_ID_FILE = "wandb_run_id"


def _wandb_run_id(run_dir: Path, resume_step: int) -> str:
    """The wandb run of this run directory: a resumed run continues the one it started (its id kept
    in run.dir), a run from step 0 starts a new one."""
    path = run_dir / WANDB_RUN_ID_FILE
    if resume_step > 0 and path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)
    path.write_text(run_id + "\n")
    return run_id


def progress_bar(console):
    """The bar a terminal gets: its status is the loss and the speed (the full record is the log's
    line above it), so that it fits 80 columns whole: the bar gives up its width first."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("train"),
        BarColumn(bar_width=None),  # takes what the text columns leave
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        transient=False,
        console=console,
        expand=True,
    )


def bar_status(record: dict) -> str:
    return f"loss {_number(record['loss'], '.4f')} {record['tokens_per_s']:,.0f} tokens/s"


class MetricsSink:
    def __init__(
        self, run_dir: Path, cfg: TrainConfig, enabled: bool, total_steps: int, resume_step: int = 0
    ):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb = self.tensorboard = self.progress = None
        if not enabled:
            return
        self._truncate_after(resume_step)
        if cfg.logging.wandb:
            import wandb
            from omegaconf import OmegaConf

            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                name=cfg.run.name,
                dir=str(run_dir),
                config=OmegaConf.to_container(cfg, resolve=True),
                resume="allow",
                id=_wandb_run_id(run_dir, resume_step),
            )
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        # off a terminal it would print one cut-short line
        if cfg.logging.progress_bar and is_terminal():
            self.progress = progress_bar(terminal_console())
            self.task = self.progress.add_task(
                "train", total=total_steps, completed=resume_step, status=""
            )
            self.progress.start()

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines a crashed run logged past its last checkpoint: the file continues
        from ``step``."""
        if not self.path.exists():
            return
        kept = [line for line, record_step in metrics_records(self.path) if record_step <= step]
        text = "".join(line + "\n" for line in kept)
        # a finished run's file, resumed with nothing to train, stays untouched
        if text != self.path.read_text():
            self.path.write_text(text)

    def write_run_info(self, info: dict) -> None:
        if self.enabled:
            (self.path.parent / "run.json").write_text(json.dumps(info, indent=2) + "\n")

    def log(self, records: list[dict], to_console: bool) -> None:
        """Append a logging window's records (one per step); the console gets the last one when
        ``to_console``."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        for record in records:
            if self.wandb is not None:
                self.wandb.log(record, step=record["step"])
            if self.tensorboard is not None:
                for key, value in record.items():
                    if key != "step" and value is not None:
                        self.tensorboard.add_scalar(key, value, record["step"])
        record = records[-1]
        summary = (
            f"step {record['step']} loss {_number(record['loss'], '.4f')} grad_norm "
            f"{_number(record['grad_norm'], '.3f')} lr {record['lr']:.2e} tokens/s "
            f"{record['tokens_per_s']:,.0f} TFLOP/s/device {record['tflops_per_s']:.3g}"
            + (f" MFU {record['mfu']:.1%}" if record["mfu"] is not None else "")
            + f" mem {record['peak_mem_bytes'] / 2**30:.2f} GiB"
            + (
                f" reserved {record['peak_reserved_bytes'] / 2**30:.2f} GiB"
                if "peak_reserved_bytes" in record
                else ""
            )
            + (f" eval_loss {record['eval_loss']:.4f}" if "eval_loss" in record else "")
            + (
                f" reward accuracy {record['rewards/accuracies']:.3f} margin "
                f"{record['rewards/margins']:.4f}"
                if "rewards/margins" in record
                else ""
            )
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=bar_status(record))
        if to_console:
            log.info(summary)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
