"""Accelerators and links: memory, dense peak FLOP/s (composer3d.training.flops' table) and the
bandwidths collectives get.

Bandwidths are per GPU, one direction, as NCCL's bus bandwidth reports them for large messages
(roughly 80% of the link's rate): intra-node over NVLink / Infinity Fabric, inter-node over the
GPU's share of the network (one 400 Gb/s NIC per GPU on H100/H200/B200/MI300X systems, 200 Gb/s on
A100 ones). Every value can be overridden (``cluster.*``) for a machine that differs; a calibration
file (``plan.calibration``, plan/rates.py) gives the kernels' rates measured on the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from composer3d.plan.rates import Rates, read_rates
from composer3d.training.flops import PEAK_FLOPS

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Device:
    # what the framework can allocate (the card's memory less the driver's/context's share)
    memory_bytes: float
    flops_key: str  # the row of composer3d.training.flops.PEAK_FLOPS
    intra_node_bw: float  # bytes/s per GPU
    inter_node_bw: float  # bytes/s per GPU
    # The host side of the memory options (ZeRO-Offload, activation offload): pinned copies between
    # the device and host memory per GPU, one direction, with every GPU of the node copying at once
    # (PCIe Gen5 x16 moves ~50 GB/s alone; the node's host links are shared), and the host memory of
    # a node (DGX-class machines).
    host_link_bw: float = 25 * GB
    host_memory_bytes: float = 2048 * GIB
    # device memory bandwidth a large copy reaches: ~90% of the data sheet's (H100 SXM 3.35 TB/s,
    # H200 4.8, B200 8, A100 80 GB 2.04, MI300X 5.3, L40S 0.86); the bound of the step's elementwise
    # kernels (plan/kernels.py)
    hbm_bw: float = 3000 * GB


DEVICES: dict[str, Device] = {
    "h100": Device(79 * GIB, "H100", 360 * GB, 40 * GB),
    "h200": Device(139 * GIB, "H200", 360 * GB, 40 * GB, hbm_bw=4300 * GB),
    "b200": Device(
        178 * GIB, "B200", 720 * GB, 40 * GB, host_memory_bytes=4096 * GIB, hbm_bw=7200 * GB
    ),
    "a100": Device(
        79 * GIB,
        "A100",
        230 * GB,
        20 * GB,
        host_link_bw=12 * GB,
        host_memory_bytes=1024 * GIB,
        hbm_bw=1800 * GB,
    ),
    "mi300x": Device(190 * GIB, "MI300X", 300 * GB, 40 * GB, hbm_bw=4700 * GB),
    "l40s": Device(
        45 * GIB,
        "L40S",
        24 * GB,
        20 * GB,
        host_link_bw=12 * GB,
        host_memory_bytes=512 * GIB,  # PCIe
        hbm_bw=780 * GB,
    ),
    # The CPU (gloo): nominal rates, enough to rank layouts for a development run; memory: this
    # host's, shared by its local processes ("host" memory is the same memory: offloading moves
    # nothing across a link).
    "cpu": Device(
        0, "", 5 * GB, 1 * GB, host_link_bw=float("inf"), host_memory_bytes=0, hbm_bw=10 * GB
    ),
}
# fp32 parameter bytes a second that the host's fused AdamW updates for one GPU (parallel.offload).
# Measured: 500M parameters in 0.17 s, their gradients' and parameters' copies included (11.7 GB/s),
# on the 16 host cores an H100 had to itself (benchmarks/offload_optimizer.py). A node's 8 GPUs
# share their host: AdamW moves 28 bytes of host memory per parameter, so 8 × 11.7 GB/s would need
# ~650 GB/s of it, about a 2-socket server's whole bandwidth.
HOST_OPTIMIZER_BW = 5 * GB
# parallel.offload_dir: one PCIe Gen4 NVMe drive per GPU reads ~7 GB/s and writes ~5 GB/s
# sequentially
DISK_BW = 5 * GB
# nominal: one core's fp32 matmul rate, for ranking only (MFU is not reported on the CPU)
CPU_PEAK_FLOPS = 1e11


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    device: str
    memory_bytes: float
    peak_flops: float  # dense, for the compute dtype
    intra_node_bw: float
    inter_node_bw: float
    # of peak that large GEMMs reach (the other kernels: plan/kernels.py)
    achievable_fraction: float
    # bytes per element of the compute dtype (bf16 on accelerators, fp32 on the CPU)
    compute_bytes: int
    host_link_bw: float = float("inf")  # bytes/s per GPU between its memory and the host's
    # fp32 parameter bytes/s the host's AdamW updates per GPU
    host_optimizer_bw: float = HOST_OPTIMIZER_BW
    # per node; 0: the host is the device (the CPU), nothing to check apart
    host_memory_bytes: float = 0.0
    disk_bw: float = DISK_BW  # bytes/s per GPU to and from parallel.offload_dir's files
    hbm_bw: float = 3000 * GB  # bytes/s between the device's memory and its cores
    # the kernels' rates measured on the device (plan.calibration), where they replace the constants
    rates: Rates | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def accelerator(self) -> bool:
        return self.device != "cpu"

    @property
    def has_mfu(self) -> bool:
        return self.accelerator


def host_memory_bytes() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def compute_dtype(device: str, param_dtype: str) -> str:
    """The dtype a run on ``device`` (a row of the table) computes in: bf16 on accelerators, fp32 on
    the CPU, unless ``param_dtype`` (precision.param_dtype) names one."""
    return ("float32" if device == "cpu" else "bfloat16") if param_dtype == "auto" else param_dtype


def device_row(name: str) -> str | None:
    """The table's row for an accelerator torch calls ``name`` ("NVIDIA H200": h200), if any."""
    return next(
        (key for key, d in DEVICES.items() if d.flops_key and d.flops_key in name.upper()), None
    )


def cluster_from_config(c, param_dtype: str = "auto", calibration: str | None = None) -> Cluster:
    """``c``: the ``cluster`` config section (device names are checked by plan/validation.py);
    ``calibration`` (plan.calibration): a calibration file measured on ``c.device``, whose rates
    replace the constants it measured."""
    device = DEVICES[c.device]
    dtype = compute_dtype(c.device, param_dtype)
    rates = read_rates(calibration, c.device, dtype) if calibration else None
    if c.peak_tflops:
        peak = c.peak_tflops * 1e12
    elif c.device == "cpu":
        peak = CPU_PEAK_FLOPS
    else:
        peaks = dict(PEAK_FLOPS)[device.flops_key]
        peak = (
            peaks["bfloat16"]
            if dtype in ("bfloat16", "float16")
            else peaks.get("tf32", peaks["float32"])
        )
    memory = (
        c.memory_gib * GIB
        if c.memory_gib
        else (host_memory_bytes() / c.gpus_per_node if c.device == "cpu" else device.memory_bytes)
    )
    return Cluster(
        nodes=c.nodes,
        gpus_per_node=c.gpus_per_node,
        device=c.device,
        memory_bytes=memory,
        peak_flops=peak,
        intra_node_bw=(c.intra_node_gbps or device.intra_node_bw / GB) * GB,
        inter_node_bw=(c.inter_node_gbps or device.inter_node_bw / GB) * GB,
        achievable_fraction=c.achievable_fraction,
        compute_bytes=2 if dtype in ("bfloat16", "float16") else 4,
        host_link_bw=(c.host_link_gbps or device.host_link_bw / GB) * GB,
        host_optimizer_bw=(c.host_optimizer_gbps or HOST_OPTIMIZER_BW / GB) * GB,
        host_memory_bytes=(
            c.host_memory_gib * GIB if c.host_memory_gib else device.host_memory_bytes
        ),
        disk_bw=(c.disk_gbps or DISK_BW / GB) * GB,
        hbm_bw=(
            c.hbm_gbps * GB
            if c.hbm_gbps
            else rates.copy.bytes_per_s
            if rates and rates.copy
            else device.hbm_bw
        ),
        rates=rates,
    )
