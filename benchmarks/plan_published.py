"""composer3d-plan against published throughput: recipes/README.md's table, regenerated.

    python benchmarks/plan_published.py [extra composer3d-plan overrides,
                                         e.g. cluster.achievable_fraction=0.75]

Each row is a published H100 result (source in recipes/README.md, next to the table) or composer3d's
own run on one GPU (issue 29: H100 rows from its start, H200 rows at the code since the fused loss
and one-device casts): its model and layout are given to ``composer3d-plan`` as published (ZeRO
stage, micro-batch, precision incl. float8, checkpointing and its policy, eager or compiled,
pipeline schedule, the overlaps the source turned on, the source's own GPUs where they differ from
an H100 SXM), nothing tuned per row, and the predicted TFLOP/s per GPU is printed next to the
published one. Where a source gives tokens/s only, its TFLOP/s is those tokens times the planner's
FLOPs per token (6N + 6·L·H·Q·T, composer3d's convention: causal attention). Megatron-LM's TFLOP/s
count the full attention matrix (6N + 12·L·H·Q·T): they are recounted in composer3d's convention
(the same tokens/s). Megatron-LM's GPT models are Llama-shaped configs of the same parameters and
FLOPs: multi-head attention, an MLP of 8h/3 (rounded to 64) with three matrices instead of 4h with
two, vocabulary 131072, untied head. The Llama 3 paper's TFLOP/s (its 405B's pre-training, rows
29-31) do not say their count: they are taken as PaLM's MFU count, the full matrix, which
torchtitan, Meta's own trainer, counts too, and recounted the same way.

Under the table, where each row's predicted step goes (its seconds, and the share of them compute
takes by kernel kind, the pipeline's bubble, each dimension's exposed communication); then held-out
rows, printed in tokens/s and setting nothing: every other row of the
torchtitan file its rows 1-2 and 22 come from, and Megatron-Bridge's H100 mixture of experts
(Qwen3-30B-A3B, its config.json's sizes in benchmarks/published_models/).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

# Megatron-LM's table and Megatron-Bridge's recipes overlap TP (--tp-comm-overlap), pipeline sends
# and the distributed optimizer's parameter gather (--overlap-param-gather) with compute, which
# composer3d-train does not
OVERLAP = ["plan.published_overlap=true"]
LLAMA_8B = ["model=llama3_8b", "train.seq_len=8192"]
LLAMA_70B = ["model=llama3_70b", "train.seq_len=8192"]
# torchtitan's H100s (both its files): Grand Teton's 96 GB HBM2e parts, 2.4 TB/s (90% of it, as the
# device table takes of each data sheet), at a 500 W power limit: a dense peak "between SXM and NVL"
# (835-989), its middle; and its attention: SDPA on torch nightlies of 2024-12 and 2025-06 ran
# FlashAttention-2 on an H100 (cuDNN's kernel became SDPA's default there in torch 2.9)
GRAND_TETON = ["cluster.hbm_gbps=2160", "cluster.peak_tflops=912", "plan.attention_kernel=flash2"]
# torchtitan's code of 2024-12 (commit 9dec370, its llama3_8b.toml's norm_type = "rmsnorm"): its own
# RMSNorm, written as its ops (torchtitan/models/norms.py), a kernel each where it is not compiled
TITAN_2024 = [*GRAND_TETON, "plan.norm_kernel=composite"]


def _gpt(hidden: int, layers: int, heads: int, tp: int, pp: int, batch: int) -> list[str]:
    """Megatron-LM's model table (sequence 4096, DP 48): micro-batch 1, its distributed optimizer
    (ZeRO-1), its fused kernels (Transformer Engine: compile.enabled stands for them), no
    recomputation, plain 1F1B under PP."""
    return [
        "model=llama3_8b",
        f"model.dim={hidden}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={heads}",
        "model.vocab_size=131072",
        f"model.ffn_hidden_dim={round(8 * hidden / 3 / 64) * 64}",
        "train.seq_len=4096",
        f"train.global_batch_size={batch}",
        "train.micro_batch_size=1",
        "compile.enabled=true",
        f"cluster.nodes={tp * pp * 48 // 8}",
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        "parallel.dp_shard=1",
        "parallel.dp_replicate=48",
        "parallel.zero_stage=1",
        *OVERLAP,
    ] + (["parallel.sequence_parallel=true"] if tp > 1 else [])


def _one_gpu(compiled: bool, ac: str, *model: str) -> list[str]:
    """composer3d's own runs on one GPU (issue 29): sequence 8192, micro-batch 1, bf16, torch
    2.11."""
    return [
        "model=llama3_1b",
        *model,
        "train.seq_len=8192",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "parallel.dp_shard=1",
        f"compile.enabled={str(compiled).lower()}",
        f"memory.activation_checkpointing={ac}",
    ]


# composer3d's runs on one H200 (2026-11-26 and 27, side by side with torchtitan in one call): its
# model, untied head
H200_1B = ["model.tie_embeddings=false", "cluster.device=h200"]
LLAMA_3B = ["model.dim=3072", "model.n_layers=28", "model.n_heads=24", "model.ffn_hidden_dim=8192"]
FP8 = [
    "precision.float8.enabled=true",
    "compile.enabled=true",
]  # Megatron-Bridge: FP8 current scaling, TE kernels
TITAN_SAC = ["memory.activation_checkpointing=selective", "memory.ac_policy=alternate_matmuls"]


def _llama3_405b(nodes: int, dp: int, cp: int, seq: int, batch_per_dp: int) -> list[str]:
    """Llama 3 405B's pre-training (the Llama 3 paper, arXiv 2407.21783, Table 4 and section 3.3).

    As the paper gives it: TP 8 inside a node; CP with K/V all-gathered, two of 2·CP chunks a rank;
    PP 16, interleaved; FSDP outermost, not resharded after the forward (composer3d's default under
    PP); gradients reduce-scattered in fp32; micro-batch 1, the DP rank's batch its micro-batches;
    no activation checkpointing ("we could pretrain Llama 3 on sequences of 8K tokens without
    activation checkpointing"); bf16.

    Its pipeline puts one layer in each model chunk, the embedding alone in the first and the head
    alone in the last (126 layers + 2 = 16 × 8 chunks). A composer3d stage holds a layer at least,
    so these rows run 4 chunks a rank of two layers each (one in the first and the last): each rank
    holds the paper's layers, but the ramps are twice as long.

    What the paper leaves open, set as the other rows set it: SP, as every published TP 8 row;
    FlashAttention-2, the 2024 kernel (FlashAttention-3 came out with the paper); eager, the paper
    naming no compiler; its asynchronous pipeline sends not priced as hidden (1-2% of these steps).
    """
    return [
        "model=llama3_405b",
        f"train.seq_len={seq}",
        f"train.global_batch_size={dp * batch_per_dp}",
        "train.micro_batch_size=1",
        f"cluster.nodes={nodes}",
        f"parallel.dp_shard={dp}",
        "parallel.tp=8",
        "parallel.pp=16",
        f"parallel.cp={cp}",
        "parallel.sequence_parallel=true",
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_stages_per_rank=4",
        "plan.attention_kernel=flash2",
    ] + (["parallel.cp_style=allgather", "parallel.cp_balance=head_tail"] if cp > 1 else [])


# (row, source, overrides, published tokens/s per GPU or None, published TFLOP/s per GPU or None:
# Megatron-LM's and Llama 3's count the full attention matrix, recounted)
ROWS = [
    (
        1,
        "torchtitan Llama 3.1 8B, 8 GPUs, FSDP",
        [
            *LLAMA_8B,
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
            "cluster.nodes=1",
            "parallel.dp_shard=8",
            *TITAN_SAC,
            *TITAN_2024,
        ],
        5762,
        None,
    ),
    (
        2,
        "torchtitan Llama 3.1 8B, 128 GPUs, FSDP",
        [
            *LLAMA_8B,
            "train.global_batch_size=256",
            "train.micro_batch_size=2",
            "cluster.nodes=16",
            "parallel.dp_shard=128",
            *TITAN_SAC,
            *TITAN_2024,
        ],
        5605,
        None,
    ),
    (
        3,
        "torchtitan Llama 3.1 8B, 64 GPUs, FSDP 8 x TP 8",
        [
            *LLAMA_8B,
            "train.global_batch_size=96",
            "train.micro_batch_size=12",
            "cluster.nodes=8",
            "parallel.dp_shard=8",
            "parallel.tp=8",
            "parallel.sequence_parallel=true",
            "compile.enabled=true",
            *TITAN_SAC,
            *GRAND_TETON,
        ],
        4378,
        None,
    ),
    (
        4,
        "torchtitan Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8",
        [
            *LLAMA_70B,
            "train.global_batch_size=512",
            "train.micro_batch_size=16",
            "cluster.nodes=32",
            "parallel.dp_shard=32",
            "parallel.tp=8",
            "parallel.sequence_parallel=true",
            "compile.enabled=true",
            "memory.activation_checkpointing=full",
            *GRAND_TETON,
        ],
        597.3,
        None,
    ),
    *[
        (5 + i, f"Megatron-LM GPT {name}", _gpt(*shape), None, tflops)
        for i, (name, shape, tflops) in enumerate(
            [
                ("1.7B", (2048, 24, 16, 1, 1, 192), 408.8),
                ("7.1B", (4096, 30, 32, 2, 1, 192), 465.9),
                ("16B", (6144, 32, 48, 4, 1, 192), 489.1),
                ("32B", (7168, 48, 56, 8, 1, 192), 459.6),
                ("70B", (8192, 84, 64, 8, 2, 384), 419.7),
                ("119B", (10240, 92, 80, 8, 4, 768), 420.5),
                ("177B", (12288, 96, 96, 8, 6, 1152), 432.8),
                ("314B", (16384, 96, 128, 8, 8, 1536), 474.4),
                ("462B", (18432, 112, 144, 8, 16, 3072), 459.9),
            ]
        )
    ],
    (
        14,
        "Megatron-Bridge Llama 3 8B, 8 GPUs, FSDP (FP8)",
        [
            *LLAMA_8B,
            "train.global_batch_size=128",
            "train.micro_batch_size=1",
            "cluster.nodes=1",
            "parallel.dp_shard=8",
            *FP8,
        ],
        14451,
        None,
    ),
    (
        15,
        "Megatron-Bridge Llama 3 70B, 64 GPUs, TP 4 x PP 8 (v=5) (FP8)",
        [
            *LLAMA_70B,
            "train.global_batch_size=128",
            "train.micro_batch_size=1",
            "cluster.nodes=8",
            "parallel.dp_shard=1",
            "parallel.dp_replicate=2",
            "parallel.tp=4",
            "parallel.pp=8",
            "parallel.sequence_parallel=true",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_stages_per_rank=5",
            "parallel.zero_stage=1",
            *FP8,
            *OVERLAP,
        ],
        1602,
        None,
    ),
    (16, "composer3d Llama 3.2 1B, 1 GPU, compiled", _one_gpu(True, "none"), 46788, None),
    (
        17,
        "composer3d Llama 3.2 1B, 1 GPU, compiled, selective AC",
        _one_gpu(True, "selective"),
        45750,
        None,
    ),
    (
        18,
        "composer3d Llama 3.2 3B, 1 GPU, compiled, selective AC",
        _one_gpu(True, "selective", *LLAMA_3B),
        19439,
        None,
    ),
    (
        19,
        "composer3d Llama 3.2 1B, 1 H200, eager, selective AC",
        _one_gpu(False, "selective", *H200_1B),
        43011,
        None,
    ),
    (
        20,
        "composer3d Llama 3.2 1B, 1 H200, eager, selective AC, autocast",
        _one_gpu(False, "selective", *H200_1B, "precision.cast=autocast"),
        41476,
        None,
    ),
    (
        21,
        "Megatron-Bridge Llama 3.1 405B, 1024 GPUs, TP 8 x PP 8 (v=8) x CP 2 (FP8)",
        [
            "model=llama3_405b",
            "train.seq_len=8192",
            "train.global_batch_size=512",
            "train.micro_batch_size=1",
            "cluster.nodes=128",
            "parallel.dp_shard=1",
            "parallel.dp_replicate=8",
            "parallel.tp=8",
            "parallel.pp=8",
            "parallel.cp=2",
            "parallel.sequence_parallel=true",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_stages_per_rank=8",
            "parallel.zero_stage=1",
            *FP8,
            *OVERLAP,
        ],
        292,
        None,
    ),
    # torchtitan's Table 2, first row: FSDP 8, CP 1, sequence 32,768, local batch 1, full AC,
    # compile + float8
    (
        22,
        "torchtitan Llama 3.1 8B, 8 GPUs, FSDP, 32,768 tokens (FP8)",
        [
            "model=llama3_8b",
            "train.seq_len=32768",
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
            "cluster.nodes=1",
            "parallel.dp_shard=8",
            "memory.activation_checkpointing=full",
            "compile.enabled=true",
            "precision.float8.enabled=true",
            *TITAN_2024,
        ],
        3890,
        None,
    ),
    # 2026-11-28 (the head casting its weight in backward); 50,105 on 2026-11-27 with the optimizer
    # step compiled (auto's on an accelerator since), 48,827 with fused AdamW, 48,307 the day before
    # without the clip in its step
    (
        23,
        "composer3d Llama 3.2 1B, 1 H200, compiled, selective AC",
        _one_gpu(True, "selective", *H200_1B),
        50235,
        None,
    ),
    (
        24,
        "composer3d Llama 3.2 1B, 1 H200, compiled, selective AC (alternate)",
        _one_gpu(True, "selective", *H200_1B, "memory.ac_policy=alternate_matmuls"),
        47119,
        None,
    ),
    # 2026-11-27, a later call: cast=params without FSDP (precision/cast_once.py); 46,582 through
    # FSDP's path before
    (25, "composer3d Llama 3.2 1B, 1 H200, eager", _one_gpu(False, "none", *H200_1B), 46824, None),
    (
        26,
        "composer3d Llama 3.2 1B, 1 H200, compiled",
        _one_gpu(True, "none", *H200_1B),
        51381,
        None,
    ),  # 11-28
    (
        27,
        "composer3d Llama 3.2 3B, 1 H200, compiled, selective AC",
        _one_gpu(True, "selective", *H200_1B, *LLAMA_3B),
        20583,
        None,
    ),
    (
        28,
        "composer3d Llama 3.2 3B, 1 H200, compiled, selective AC (alternate)",  # 2026-11-28
        _one_gpu(True, "selective", *H200_1B, *LLAMA_3B, "memory.ac_policy=alternate_matmuls"),
        19882,
        None,
    ),
    (
        29,
        "Llama 3 405B pre-training, 8,192 GPUs, TP 8 x PP 16 x DP 64",
        _llama3_405b(1024, 64, 1, 8192, 32),
        None,
        430,
    ),
    (
        30,
        "Llama 3 405B pre-training, 16,384 GPUs, TP 8 x PP 16 x DP 128",
        _llama3_405b(2048, 128, 1, 8192, 16),
        None,
        400,
    ),
    (
        31,
        "Llama 3 405B pre-training, 16,384 GPUs, TP 8 x CP 16 x PP 16 x DP 8, 131,072 tokens",
        _llama3_405b(2048, 8, 16, 131072, 16),
        None,
        380,
    ),
]


# Held out: the other rows of torchtitan's 2024-12 file (its tables 1-6), set nothing and are not in
# recipes/README.md's table; (table and row, source, overrides, published tokens/s per GPU). Tables
# 5-6 ran micro-batches = PP degree (its default then) and interleaved 1F1B at two stages a rank
# (its default split); async TP is published_overlap.
TITAN_COMPILED = [*LLAMA_8B, *TITAN_SAC, *TITAN_2024, "compile.enabled=true"]
TITAN_8_GPUS = [
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "cluster.nodes=1",
    "parallel.dp_shard=8",
]
TITAN_128_GPUS = [
    "train.global_batch_size=256",
    "train.micro_batch_size=2",
    "cluster.nodes=16",
    "parallel.dp_shard=128",
]
TITAN_FP8 = ["precision.float8.enabled=true"]
TITAN_LONG = [
    "model=llama3_8b",
    "model.max_seq_len=262144",
    "train.micro_batch_size=1",
    "cluster.nodes=1",
    "memory.activation_checkpointing=full",
    "compile.enabled=true",
    *TITAN_FP8,
    *TITAN_2024,
]
TITAN_70B_2D = [
    *LLAMA_70B,
    "train.global_batch_size=512",
    "train.micro_batch_size=16",
    "cluster.nodes=32",
    "parallel.dp_shard=32",
    "parallel.tp=8",
    "parallel.sequence_parallel=true",
    "compile.enabled=true",
    "memory.activation_checkpointing=full",
    *TITAN_FP8,
    *TITAN_2024,
]
TITAN_405B = [
    "model=llama3_405b",
    "model.max_seq_len=262144",
    "cluster.nodes=64",
    "parallel.tp=8",
    "parallel.pp=8",
    "parallel.sequence_parallel=true",
    "compile.enabled=true",
    "memory.activation_checkpointing=full",
    *TITAN_FP8,
    "plan.published_overlap=true",
    *TITAN_2024,
]


def _titan_long(dp: int, cp: int) -> list[str]:
    """Table 2: FSDP dp × CP cp on 8 GPUs, local batch 1, 32,768 tokens a GPU."""
    return [
        *TITAN_LONG,
        f"train.seq_len={32768 * cp}",
        f"train.global_batch_size={dp}",
        f"parallel.dp_shard={dp}",
        f"parallel.cp={cp}",
    ]


def _titan_4d(dp: int, cp: int) -> list[str]:
    """Table 6: FSDP dp × CP cp × TP 8 × PP 8 (1F1B) on 512 GPUs, local batch 8 in micro-batches
    of 1."""
    return [
        *TITAN_405B,
        f"train.seq_len={32768 * cp}",
        f"train.global_batch_size={8 * dp}",
        "train.micro_batch_size=1",
        f"parallel.dp_shard={dp}",
        f"parallel.cp={cp}",
        "parallel.pp_schedule=1f1b",
    ]


# Hugging Face models the rows name, as their config.json (sizes only: composer3d-plan reads nothing
# else)
PUBLISHED_MODELS = Path(__file__).parent / "published_models"
CONF_MODELS = Path(__file__).parent.parent / "conf" / "model"
MB_MOE = ["train.seq_len=4096", "train.micro_batch_size=1", "parallel.zero_stage=1", *OVERLAP]

HELD_OUT = [
    ("T1.2", "torchtitan 8B, 8 GPUs, FSDP, compiled", [*TITAN_COMPILED, *TITAN_8_GPUS], 6667),
    (
        "T1.3",
        "torchtitan 8B, 8 GPUs, FSDP, compiled (FP8)",
        [*TITAN_COMPILED, *TITAN_8_GPUS, *TITAN_FP8],
        8532,
    ),
    ("T3.2", "torchtitan 8B, 128 GPUs, FSDP, compiled", [*TITAN_COMPILED, *TITAN_128_GPUS], 6514),
    (
        "T3.3",
        "torchtitan 8B, 128 GPUs, FSDP, compiled (FP8)",
        [*TITAN_COMPILED, *TITAN_128_GPUS, *TITAN_FP8],
        8380,
    ),
    ("T2.2", "torchtitan 8B, FSDP 4 x CP 2, 65,536 tokens (FP8)", _titan_long(4, 2), 2540),
    ("T2.3", "torchtitan 8B, FSDP 2 x CP 4, 131,072 tokens (FP8)", _titan_long(2, 4), 1071),
    ("T2.4", "torchtitan 8B, CP 8, 262,144 tokens (FP8)", _titan_long(1, 8), 548),
    ("T4.1", "torchtitan 70B, FSDP 32 x TP 8 (FP8)", TITAN_70B_2D, 829),
    (
        "T4.2",
        "torchtitan 70B, FSDP 32 x TP 8, async TP (FP8)",
        [*TITAN_70B_2D, "plan.published_overlap=true"],
        876,
    ),
    (
        "T5.1",
        "torchtitan 405B, FSDP 8 x TP 8 x PP 8, 1F1B (FP8)",
        [
            *TITAN_405B,
            "train.seq_len=8192",
            "train.global_batch_size=256",
            "train.micro_batch_size=4",
            "parallel.dp_shard=8",
        ],
        100,
    ),
    (
        "T5.2",
        "torchtitan 405B, as T5.1, interleaved 1F1B (FP8)",
        [
            *TITAN_405B,
            "train.seq_len=8192",
            "train.global_batch_size=256",
            "train.micro_batch_size=4",
            "parallel.dp_shard=8",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_stages_per_rank=2",
        ],
        128,
    ),
    *[
        (
            f"T6.{i + 1}",
            f"torchtitan 405B, FSDP {8 // cp} x CP {cp} x TP 8 x PP 8 (FP8)",
            _titan_4d(8 // cp, cp),
            tokens,
        )
        for i, (cp, tokens) in enumerate([(1, 76), (2, 47), (4, 31), (8, 16)])
    ],
    # Megatron-Bridge's H100 mixtures of experts, 26.04.01 container (the layouts its configs of
    # that release set: force-balanced routing, its distributed optimizer as ZeRO-1 with the
    # experts' state over their expert data-parallel ranks, the gradient reduce and parameter gather
    # overlapped), sequence 4096, micro-batch 1. Qwen3-30B-A3B: EP 16 over two nodes through
    # HybridEP (a token crosses to the other node once), no all-to-all overlap
    # (moe_a2a_overlap=False), FP8 (tensorwise current scaling)
    (
        "MB.Q3",
        "Megatron-Bridge Qwen3-30B-A3B, EP 16, HybridEP (FP8)",
        [
            *MB_MOE,
            "model=hf",
            "model.pretrained=false",
            f"model.path={PUBLISHED_MODELS / 'qwen3_30b_a3b'}",
            "train.global_batch_size=1024",
            "cluster.nodes=2",
            "parallel.dp_shard=16",
            "parallel.ep=16",
            "plan.ep_dispatch=per_node",
            "plan.published_float8_experts=true",
            *FP8,
        ],
        8960,
    ),
]


def on_device(overrides: list[str]) -> list[str]:
    """The row's overrides on its GPU: an H100 SXM unless the row names another."""
    named = any(o.startswith("cluster.device=") for o in overrides)
    return overrides if named else [*overrides, "cluster.device=h100"]


def _causal_half(overrides: list[str]) -> float:
    """6·L·H·Q·T: what counting the full attention matrix adds per token to composer3d's causal
    count (H·Q: the query heads' width, the hidden size in every such row), from the row's
    overrides over its model's preset (conf/model/)."""
    value = {k: v for k, v in (o.split("=", 1) for o in overrides)}
    preset = OmegaConf.load(CONF_MODELS / f"{value['model']}.yaml")
    model = {
        **preset,
        **{k.split(".", 1)[1]: v for k, v in value.items() if k.startswith("model.")},
    }
    return 6 * int(model["n_layers"]) * int(model["dim"]) * int(value["train.seq_len"])


def published_tflops(
    overrides: list[str], tokens: float | None, tflops: float | None, tflop_per_token: float
) -> float:
    """A row's published TFLOP/s per GPU in composer3d's count (``tflop_per_token``: the planner's
    for the row): its tokens/s times that count, or, where the source gives TFLOP/s in the full
    matrix's count, the tokens/s that count gives, times ours."""
    if tokens is None:
        tokens = tflops / (tflop_per_token + _causal_half(overrides) / 1e12)
    return tokens * tflop_per_token


def _predict(overrides: list[str], extra: list[str]) -> dict | str:
    """composer3d-plan's JSON estimate for the layout, or its one-line refusal."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer3d.commands.plan",
            *on_device(overrides),
            "plan.format=json",
            *extra,
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    return proc.stderr.strip() if proc.returncode else json.loads(proc.stdout.splitlines()[-1])


# the terms of a predicted step (composer3d/plan/estimate.py) as the breakdown prints them: compute
# by kernel kind (plan/kernels.py), the pipeline's bubble, each mesh dimension's exposed
# communication (grouped), anything else
COMPUTE = ("gemm", "attention", "elementwise", "optimizer")
EXPOSED = {
    "tp": ("tp",),
    "dp": ("dp", "dp_shard", "dp_replicate"),
    "pp": ("pp",),
    "cp": ("cp", "cp_a2a", "cp_ring"),
    "ep": ("ep",),
}
TERMS = (*COMPUTE, "bubble", *EXPOSED, "other")


def step_shares(e: dict) -> list[float]:
    """Where a predicted step goes (``e``: composer3d-plan's JSON estimate): its seconds, then the
    share of it each of ``TERMS`` takes; other: eager selective checkpointing's host dispatch and
    anything else exposed (Muon's all-to-alls, the host's optimizer step)."""
    step, kinds, exposed = e["step_time_s"], dict(e["compute_by_kind_s"]), dict(e["exposed_comm_s"])
    parts = [kinds.pop(k) for k in COMPUTE] + [e["bubble_s"]]
    parts += [sum(exposed.pop(d, 0.0) for d in dims) for dims in EXPOSED.values()]
    parts.append(sum(kinds.values()) + sum(exposed.values()))
    return [step] + [p / step for p in parts]


def main() -> None:
    extra = sys.argv[1:]
    print(
        f"{'#':>4}  {'source':<58}{'published':>10}{'predicted':>10}{'error':>8}   TFLOP/s per GPU"
    )
    steps = []
    for row, source, overrides, tokens, tflops in ROWS:
        e = _predict(overrides, extra)
        if isinstance(e, str):
            print(f"{row:>4}  {source:<58}{e}")
            continue
        steps.append((row, source, e))
        published = published_tflops(
            overrides, tokens, tflops, e["tflops_per_gpu"] / e["tokens_per_s_per_gpu"]
        )
        print(
            f"{row:>4}  {source:<58}{published:>10.1f}{e['tflops_per_gpu']:>10.1f}"
            f"{e['tflops_per_gpu'] / published - 1:>+8.0%}"
        )
    print(
        f"\n{'where each predicted step goes, as shares of it':<64}{'step s':>8}"
        + "".join(f"{t[:7]:>8}" for t in TERMS)
    )
    for row, source, e in steps:
        step, *shares = step_shares(e)
        print(f"{row:>4}  {source:<58}{step:>8.2f}" + "".join(f"{x:>8.0%}" for x in shares))
    print(
        f"\nheld out (set nothing){'':<36}{'published':>10}{'predicted':>10}{'error':>8}   "
        "tokens/s per GPU"
    )
    for row, source, overrides, tokens in HELD_OUT:
        e = _predict(overrides, extra)
        if isinstance(e, str):
            print(f"{row:>4}  {source:<58}{e}")
            continue
        print(
            f"{row:>4}  {source:<58}{tokens:>10,}{e['tokens_per_s_per_gpu']:>10,.0f}"
            f"{e['tokens_per_s_per_gpu'] / tokens - 1:>+8.0%}"
        )


if __name__ == "__main__":
    main()
