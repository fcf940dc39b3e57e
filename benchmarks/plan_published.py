"""composer3d-plan against published large-scale throughput: the README's table, regenerated.

    python benchmarks/plan_published.py [extra composer3d-plan overrides, e.g. cluster.achievable_fraction=0.44]

Each row is a published H100 result (source in the README, next to the table): its model and layout are given to
``composer3d-plan`` as they are, nothing tuned per row, and the predicted TFLOP/s per GPU is printed next to the
published one. Where a source gives tokens/s only, its TFLOP/s is those tokens times the planner's FLOPs per token
(6N + 6·L·H·Q·T, composer3d's convention: causal attention). Megatron-LM's TFLOP/s count the full attention matrix
(6N + 12·L·H·Q·T): they are recounted in composer3d's convention (the same tokens/s). Megatron-LM's GPT models are Llama-shaped configs of the same
parameters and FLOPs: multi-head attention, an MLP of 8h/3 (rounded to 64) with three matrices instead of 4h
with two, vocabulary 131072, untied head.
"""

from __future__ import annotations

import json
import subprocess
import sys

LLAMA_8B = ["model=llama3_8b", "train.seq_len=8192"]
LLAMA_70B = ["model=llama3_70b", "train.seq_len=8192"]


def _gpt(hidden: int, layers: int, heads: int, tp: int, pp: int, batch: int) -> list[str]:
    """Megatron-LM's model table (sequence 4096, DP 48): one micro-batch per data-parallel rank without PP, 1 with
    (the table gives no micro-batch size), DDP for its distributed optimizer (the same bytes moved)."""
    return ["model=llama3_8b", f"model.dim={hidden}", f"model.n_layers={layers}", f"model.n_heads={heads}",
            f"model.n_kv_heads={heads}", "model.vocab_size=131072",
            f"model.ffn_hidden_dim={round(8 * hidden / 3 / 64) * 64}", "train.seq_len=4096",
            f"train.global_batch_size={batch}", f"train.micro_batch_size={batch // 48 if pp == 1 else 1}",
            f"cluster.nodes={tp * pp * 48 // 8}", f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.dp_shard=1",
            "parallel.dp_replicate=48"] + (["parallel.sequence_parallel=true"] if tp > 1 else [])


# (row, source, overrides, published tokens/s per GPU or None, published TFLOP/s per GPU or None)
ROWS = [
    (1, "torchtitan Llama 3.1 8B, 8 GPUs, FSDP", [*LLAMA_8B, "train.global_batch_size=16", "train.micro_batch_size=2",
     "cluster.nodes=1", "parallel.dp_shard=8", "memory.activation_checkpointing=selective"], 5762, None),
    (2, "torchtitan Llama 3.1 8B, 128 GPUs, FSDP", [*LLAMA_8B, "train.global_batch_size=256",
     "train.micro_batch_size=2", "cluster.nodes=16", "parallel.dp_shard=128", "memory.activation_checkpointing=selective"],
     5605, None),
    (3, "torchtitan Llama 3.1 8B, 64 GPUs, FSDP 8 x TP 8", [*LLAMA_8B, "train.global_batch_size=96",
     "train.micro_batch_size=12", "cluster.nodes=8", "parallel.dp_shard=8", "parallel.tp=8",
     "parallel.sequence_parallel=true", "memory.activation_checkpointing=selective"], 4378, None),
    (4, "torchtitan Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8", [*LLAMA_70B, "train.global_batch_size=512",
     "train.micro_batch_size=16", "cluster.nodes=32", "parallel.dp_shard=32", "parallel.tp=8",
     "parallel.sequence_parallel=true", "memory.activation_checkpointing=full"], 597.3, None),
    *[(5 + i, f"Megatron-LM GPT {name}", _gpt(*shape), None, tflops) for i, (name, shape, tflops) in enumerate([
        ("1.7B", (2048, 24, 16, 1, 1, 192), 408.8), ("7.1B", (4096, 30, 32, 2, 1, 192), 465.9),
        ("16B", (6144, 32, 48, 4, 1, 192), 489.1), ("32B", (7168, 48, 56, 8, 1, 192), 459.6),
        ("70B", (8192, 84, 64, 8, 2, 384), 419.7), ("119B", (10240, 92, 80, 8, 4, 768), 420.5),
        ("177B", (12288, 96, 96, 8, 6, 1152), 432.8), ("314B", (16384, 96, 128, 8, 8, 1536), 474.4),
        ("462B", (18432, 112, 144, 8, 16, 3072), 459.9)])],
    (14, "Megatron-Bridge Llama 3 8B, 8 GPUs, FSDP (FP8)", [*LLAMA_8B, "train.global_batch_size=128",
     "train.micro_batch_size=1", "cluster.nodes=1", "parallel.dp_shard=8"], 14451, None),
    (15, "Megatron-Bridge Llama 3 70B, 64 GPUs, TP 4 x PP 8 (v=5) (FP8)", [*LLAMA_70B, "train.global_batch_size=128",
     "train.micro_batch_size=1", "cluster.nodes=8", "parallel.dp_shard=1", "parallel.dp_replicate=2", "parallel.tp=4",
     "parallel.pp=8", "parallel.sequence_parallel=true", "parallel.pp_schedule=interleaved_1f1b",
     "parallel.pp_stages_per_rank=5"], 1602, None),
]


def _causal_half(overrides: list[str]) -> float:
    """6·L·H·Q·T: what counting the full attention matrix adds per token to composer3d's causal count (Megatron's
    GPT rows: multi-head attention, H·Q = the hidden size)."""
    value = {k: v for k, v in (o.split("=", 1) for o in overrides)}
    return 6 * int(value["model.n_layers"]) * int(value["model.dim"]) * int(value["train.seq_len"])


def main() -> None:
    extra = sys.argv[1:]
    print(f"{'#':>3}  {'source':<58}{'published':>10}{'predicted':>10}{'error':>8}   TFLOP/s per GPU")
    for row, source, overrides, tokens, tflops in ROWS:
        proc = subprocess.run([sys.executable, "-m", "composer3d.plan.cli", *overrides, "cluster.device=h100",
                               "plan.format=json", *extra], check=False, capture_output=True, text=True)
        if proc.returncode:
            print(f"{row:>3}  {source:<58}{proc.stderr.strip()}")
            continue
        e = json.loads(proc.stdout.splitlines()[-1])
        flops_per_token = e["tflops_per_gpu"] * 1e12 / e["tokens_per_s_per_gpu"]  # composer3d's count
        if tokens is None:  # Megatron's TFLOP/s: its tokens/s, from its count with the full attention matrix
            tokens = tflops * 1e12 / (flops_per_token + _causal_half(overrides))
        published = tokens * flops_per_token / 1e12
        print(f"{row:>3}  {source:<58}{published:>10.1f}{e['tflops_per_gpu']:>10.1f}"
              f"{e['tflops_per_gpu'] / published - 1:>+8.0%}")


if __name__ == "__main__":
    main()
