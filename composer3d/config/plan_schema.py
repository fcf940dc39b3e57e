"""The planner's sections of the configuration schema (``schema.TrainConfig.cluster`` and
``.plan``): the machines a layout is planned for and composer3d-plan's own keys. Its comments are
the --help text, as ``schema``'s are (``help`` reads both)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClusterConfig:
    # composer3d-plan and parallel=auto: the machines the layout is planned for (composer3d-train
    # plans for its own world size; cluster.device=auto there means launch.device's: the CPU, or the
    # table's entry for the GPU)
    nodes: int = 1  # machines
    gpus_per_node: int = 8  # devices per machine (composer3d-train: launch.nproc_per_node)
    # h100 | h200 | b200 | a100 | mi300x | l40s | cpu: memory, peak FLOP/s, link bandwidths
    device: str = "h100"
    # usable memory per device; None: the table's (cpu: host memory / gpus_per_node)
    memory_gib: float | None = None
    # dense peak for the compute dtype; None: composer3d.training.flops' table
    peak_tflops: float | None = None
    # GB/s per device within a node (NVLink...); None: the table's
    intra_node_gbps: float | None = None
    # GB/s per device across nodes (its network share); None: the table's
    inter_node_gbps: float | None = None
    # of the dense peak FLOP/s that large GEMMs reach (the rest: plan/kernels.py)
    achievable_fraction: float = 0.8
    # the memory options' host side: GB/s per device to and from host memory (all devices copying at
    # once); None: the table's
    host_link_gbps: float | None = None
    # the fp32 parameter GB/s the host's AdamW updates per device (parallel.offload); None: the
    # table's
    host_optimizer_gbps: float | None = None
    host_memory_gib: float | None = None  # host memory per node; None: the table's
    # GB/s per device to and from parallel.offload_dir's files; None: 5
    disk_gbps: float | None = None
    # GB/s the device's memory gives its elementwise kernels; None: the table's
    hbm_gbps: float | None = None


@dataclass
class PlanConfig:
    # composer3d-plan: table (human) | json (one JSON object per layout, a line each)
    format: str = "table"
    top: int = 10  # composer3d-plan without a layout: how many of the ranked layouts to print
    # composer3d-plan: for the config's layout (parallel.*, default FSDP over every device), the
    # longest sequence each combination of memory options trains and the largest model (layers at
    # model.dim) each offload holds
    what_fits: bool = False
    # a layout fits when its predicted peak is at most this share of the memory
    memory_headroom: float = 0.9
    # composer3d-plan with a layout (parallel.*): run one of its ranks here (launch.device) with a
    # fake process group (no other rank, no communication) and print its peak memory and step
    # compute time beside the prediction
    measure: bool = False
    # plan.measure: which rank of the cluster.nodes × cluster.gpus_per_node to run
    measure_rank: int = 0
    # plan.measure: timed steps (after one warm-up step and one tracked for memory)
    measure_steps: int = 3
    # composer3d-plan: time the kernels the config's layout runs at its shapes on this machine's
    # device (launch.device): its GEMMs, attention per kernel and length, the optimizer step, a
    # copy; write their rates to this JSON file for plan.calibration, and exit
    calibrate: str | None = None
    # plan.calibrate: timed runs of each kernel (their median, after two warm-ups)
    calibrate_repeats: int = 5
    # a file plan.calibrate wrote on cluster.device: the rates it measured replace the planner's
    # constants (plan/rates.py); None: the constants
    calibration: str | None = None
    # price overlaps other stacks publish and composer3d-train does not run (to compare with their
    # results): TP/SP collectives inside the GEMMs (async TP), pipeline sends behind compute,
    # ZeRO-1's gather during the forward
    published_overlap: bool = False
    # price Megatron's expert-parallel overlap (overlap_moe_expert_parallel_comm: one micro-batch's
    # all-to-alls behind another's compute), which composer3d-train does not run and
    # plan.published_overlap leaves out
    published_ep_overlap: bool = False
    # the mixture-of-experts dispatch the planner prices across nodes: all_to_all (every routed copy
    # of a token sent to its expert's rank: composer3d-train's) | per_node (a token sent once to
    # each other node holding any of its experts, forwarded there over NVLink: DeepEP / HybridEP,
    # Megatron's flex dispatcher, in published runs)
    ep_dispatch: str = "all_to_all"
    # price the routed experts' GEMMs in float8 under precision.float8 (Transformer Engine's grouped
    # GEMMs, in published runs); composer3d-train's float8 converts nn.Linear layers, and its
    # stacked experts stay in bf16
    published_float8_experts: bool = False
    # the attention kernel the planner times attention at (plan/kernels.py): sdpa (torch >= 2.9's
    # scaled_dot_product_attention: cuDNN's fused kernel on Hopper, what composer3d-train runs) |
    # flash2 (FlashAttention-2, SDPA's flash backend: torch's default on Hopper before 2.9, as in
    # torchtitan's published runs)
    attention_kernel: str = "sdpa"
    # the RMSNorm the planner prices in an eager step (compiled steps fuse either): fused (torch's
    # nn.RMSNorm, one kernel forward and one backward: what composer3d-train runs) | composite (an
    # RMSNorm written as its ops, each a kernel forward and again in autograd's backward:
    # torchtitan's rmsnorm in its published 2024-12 runs)
    norm_kernel: str = "fused"
