"""Joining or starting a distributed job, and the one place that decides device and backend.

Three ways in: torchrun (RANK/WORLD_SIZE/MASTER_* in the environment), SLURM or submitit with one
task per device (SLURM_PROCID/SLURM_NTASKS; hydra/launcher=submitit_*), or a plain command that
starts ``launch.nproc_per_node`` local workers itself (``launcher``: torch's elastic agent, the one
torchrun runs, so the workers join the same way).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from composer3d.errors import ConfigError


@dataclass(frozen=True)
class Env:
    rank: int
    local_rank: int
    world_size: int


# A job's tasks, one per device, and where their launcher says which task each is (rank, tasks,
# local rank, job id, the first node's address): submitit's local executor
# (hydra/launcher=submitit_local) runs them on this machine under variables of its own; srun (SLURM,
# hydra/launcher=submitit_slurm too) sets SLURM's. Checked in this order: a submitit_local job
# started inside a SLURM allocation inherits that allocation's variables.
TASK_VARIABLES = (
    (
        "SUBMITIT_LOCAL_GLOBALID",
        "SUBMITIT_LOCAL_NTASKS",
        "SUBMITIT_LOCAL_LOCALID",
        "SUBMITIT_LOCAL_JOB_ID",
        None,
    ),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_LAUNCH_NODE_IPADDR"),
)


def job_env() -> Env | None:
    """This process's place in a job started by torchrun, SLURM or submitit; None when started as a
    plain command."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return Env(
            int(os.environ["RANK"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ["WORLD_SIZE"]),
        )
    for rank, ntasks, local_rank, job_id, address in TASK_VARIABLES:
        if rank not in os.environ:
            continue
        if int(os.environ.get(ntasks, "1")) == 1:
            # a job of one task (e.g. one task per node that runs torchrun): a plain command
            return None
        # Translate to the variables torch.distributed reads.
        os.environ["RANK"] = os.environ[rank]
        os.environ["WORLD_SIZE"] = os.environ[ntasks]
        os.environ["LOCAL_RANK"] = os.environ.get(local_rank, "0")
        os.environ.setdefault(
            "MASTER_ADDR", os.environ.get(address, "127.0.0.1") if address else "127.0.0.1"
        )
        # A port of the job's own (Lightning's rule): the jobs of a sweep may share a node.
        os.environ.setdefault("MASTER_PORT", str(15000 + int(os.environ.get(job_id, "0")) % 10000))
        return job_env()
    return None


def in_submitit_job() -> bool:
    """A task of a job submitit started (hydra/launcher=submitit_*): its ranks are the job's
    tasks."""
    return "SUBMITIT_EXECUTOR" in os.environ


def device_type(requested: str, local_processes: int = 1) -> str:
    """The device type ``launch.device`` names on this machine, checked: ``auto`` picks the
    machine's accelerator (CUDA, XPU, …) when there is one, otherwise the CPU; an accelerator must
    exist and have a device for each of the ``local_processes`` on this node. Touches no device (the
    launcher calls it before starting workers)."""
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if requested == "cpu" or (requested == "auto" and accelerator is None):
        return "cpu"
    if requested == "auto":
        requested = accelerator.type
    here = (
        f"this machine's accelerator is {accelerator.type}"
        if accelerator is not None
        else "this machine has none"
    )
    if accelerator is None or requested != accelerator.type:
        other = (
            accelerator.type
            if accelerator is not None
            else "an accelerator type on a machine with one"
        )
        raise ConfigError(
            f"launch.device: {requested!r} is not an accelerator here ({here}). Use "
            f"launch.device=auto (the accelerator if there is one, else the CPU), cpu, or {other}"
        )
    count = torch.accelerator.device_count()
    if local_processes > count:
        raise ConfigError(
            f"launch.nproc_per_node: {local_processes} processes on this node but it has {count} "
            f"{requested} device(s). Use launch.nproc_per_node<={count}, or launch.device=cpu to "
            f"run {local_processes} processes on the CPU",
            rank_specific=True,
        )
    return requested


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is this machine's accelerator rather than the CPU."""
    return (
        torch.accelerator.is_available()
        and device.type == torch.accelerator.current_accelerator().type
    )


# where torch reads its caching allocator's settings (the second: CUDA's older name, which every
# torch we run reads)
ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_settings() -> str | None:
    """The caching allocator's settings this process runs with, as the environment gives them."""
    return next((os.environ[name] for name in ALLOCATOR_SETTINGS if name in os.environ), None)


def resolve_device(
    requested: str, local_rank: int = 0, expandable_segments: bool = False
) -> torch.device:
    """This rank's device (see ``device_type``); an accelerator is made current for this process.
    Checked against the node's process count where the launcher says it (torchrun and the local
    launcher: every rank refuses alike), else against this rank's index (srun).
    ``expandable_segments`` (memory.expandable_segments): CUDA's caching allocator grows a segment
    in place instead of reserving a new one per size, so what it reserves stays near what is
    allocated (torchtitan's launcher sets the same); settings the environment gives win. Set before
    the device is first touched, when the allocator reads them."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    kind = device_type(requested, local_processes=local_processes)
    if kind == "cpu":
        share_compile_workers(local_processes)
        return torch.device("cpu")
    if (
        expandable_segments
        and kind == "cuda"
        and allocator_settings() is None
        and not torch.cuda.is_initialized()
    ):
        # the name every torch we run reads
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    torch.accelerator.set_device_index(local_rank)
    return torch.device(kind, local_rank)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a SLURM or container limit), else the
    machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_compile_workers(local_processes: int) -> None:
    """On the CPU the node's ranks share its cores: inductor's pool of compiling processes (one per
    core by default, in every rank) would start cores × ranks processes on them, and starting it
    costs more than compiling a small model's graphs (a compiled 4-step run on 2 ranks of 2 cores:
    27 s with the pools, 15 s without). Each rank takes its share of the cores; a setting the
    environment gives (TORCHINDUCTOR_COMPILE_THREADS) wins."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    import torch._inductor.config as inductor_config  # noqa: PLC0415 (imported with torch.compile's machinery)

    inductor_config.compile_threads = max(1, cpu_cores() // max(1, local_processes))


def init_process_group(
    device: torch.device,
    env: Env | None,
    timeout: timedelta | None = None,
    host_collectives: bool = False,
) -> Env:
    """``timeout``: how long a collective may wait for the other ranks before it fails
    (launch.timeout_minutes; None: torch's default). ``host_collectives``: collectives on tensors in
    host memory too (the gradient norm over CPU-offloaded gradients), through gloo beside an
    accelerator's own backend; every group of the mesh inherits it."""
    backend = dist.get_default_backend_for_device(device)
    if host_collectives and device.type != "cpu":
        backend = f"{device.type}:{backend},cpu:gloo"
    if env is None:  # a single process: no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return Env(0, 0, 1)
    dist.init_process_group(
        backend, timeout=timeout, device_id=device if device.type != "cpu" else None
    )
    return env


def agree_on(value: object) -> object:
    """Rank 0's value on every rank (e.g. a run directory computed from the clock on each rank)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shut_down(finished: bool) -> None:
    """Destroy the process group. After a clean finish, first collect garbage and wait for every
    rank: work still referenced (a pipeline schedule's point-to-point sends) then completes and is
    released while the interpreter is alive — gloo can otherwise abort at exit ("terminate called
    without an active exception"). After an error, no barrier: the other ranks may never reach
    it."""
    if finished:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def use_deterministic_algorithms(enabled: bool) -> None:
    """``train.deterministic``: bit-identical reruns and resumes on every device. torch's
    deterministic algorithms (which also pick flash attention's and flex attention's deterministic
    backward and refuse an op that has none), cuBLAS's fixed workspace (read when its handle is
    made: before the first matmul), cuDNN without autotuning, and inductor without on-device
    benchmarking (which can choose a different kernel each run). Set either way: a sweep's jobs
    share one process."""
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = enabled, False
    import torch._inductor.config as inductor_config  # noqa: PLC0415 (imported with torch.compile's machinery)

    inductor_config.deterministic = enabled
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
