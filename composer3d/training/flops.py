"""Model FLOPs per token and the accelerator's peak, for TFLOP/s and MFU (model FLOPs utilization).

FLOPs per token follow the PaLM paper's convention (appendix B): 6·N for the matmuls of forward and
backward, N the parameters without the embedding table (a lookup, not a matmul; an untied head
counts), plus the attention scores and their weighted sum: 12·L·H·Q·T over the full T × T matrix (L
layers, H heads, Q head dim, T sequence length), of which a causal model's attention needs half,
6·L·H·Q·T: the PaLM paper counts the full matrix, which overstates MFU the more the longer the
sequence (at 131k tokens attention is most of an 8B model's FLOPs). A layer whose queries see a
sliding window of w keys (Mistral, Gemma 2/3, gpt-oss) counts the scores it needs, w·(2T − w + 1) /
(T·(T + 1)) of a causal layer's, whatever kernel computes them. Activation recomputation is not
counted: MFU measures useful work, so checkpointing lowers it. The 6·N is 2·N forward, 2·N for the
activations' gradients and 2·N for the weights' gradients; a frozen weight (``peft``: the base) gets
none of the last, so a LoRA run counts 4·N + 2·(its trainable matmul parameters), N including the
adapters' own matmuls.
"""

from __future__ import annotations

import torch
import torch.nn as nn

# Dense (no sparsity) peak FLOP/s per device by compute dtype, from the vendors' data sheets;
# matched by a substring of the device name, most specific first. float8 training is reported
# against the bf16 peak, as torchtitan does (the matmuls that stay in bf16 would otherwise drag it
# down unfairly).
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bfloat16": 756e12, "tf32": 378e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "tf32": 418e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12}),  # SXM5
    ("H200", {"bfloat16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12}),
    ("H20", {"bfloat16": 148e12, "tf32": 74e12, "float32": 44e12}),
    ("B200", {"bfloat16": 2250e12, "tf32": 1100e12, "float32": 75e12}),
    ("A100", {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
    ("L40S", {"bfloat16": 362e12, "tf32": 183e12, "float32": 91.6e12}),
    ("A10G", {"bfloat16": 70e12, "tf32": 35e12, "float32": 31.2e12}),
    ("MI300X", {"bfloat16": 1307.4e12, "tf32": 653.7e12, "float32": 163.4e12}),
    ("MI325X", {"bfloat16": 1307.4e12, "tf32": 653.7e12, "float32": 163.4e12}),
    ("MI250X", {"bfloat16": 383e12, "float32": 95.7e12}),
]


def embedding_params(model: nn.Module) -> int:
    """Parameters of the model's embedding tables (each counted once; a tied head shares them)."""
    tables = {
        id(p): p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    return sum(p.numel() for p in tables.values())


def attended_share(window: int, seq_len: int) -> float:
    """The share of a causal layer's scores that a layer whose queries each see at most ``window``
    keys (itself included, as transformers' sliding_window; 0: every earlier key) computes over
    ``seq_len`` tokens."""
    if not window or window >= seq_len:
        return 1.0
    return window * (2 * seq_len - window + 1) / (seq_len * (seq_len + 1))


def attention_layers(windows: list[int], seq_len: int) -> float:
    """Layers' worth of causal attention a model computes: one per full layer, ``attended_share``
    per windowed one."""
    return sum(attended_share(w, seq_len) for w in windows)


def flops_per_token(
    num_params: int,
    num_embedding_params: int,
    n_layers: float,
    attention_width: int,
    seq_len: int,
    trainable_matmul_params: int | None = None,
) -> int:
    """4·N + 2·N_trained + 6·L·H·Q·T (``attention_width`` = H·Q, the query projection's width;
    causal attention; L: ``attention_layers``, the layers less what sliding windows leave out). N:
    the matmul parameters (``num_params`` without the embedding tables); N_trained: those that get a
    weight gradient (``trainable_matmul_params``; all of N when None), so 6·N when every weight
    trains."""
    matmul = num_params - num_embedding_params
    trained = matmul if trainable_matmul_params is None else trainable_matmul_params
    return round(4 * matmul + 2 * trained + 6 * n_layers * attention_width * seq_len)


def forward_flops_per_token(
    num_matmul_params: int, n_layers: float, attention_width: int, seq_len: int
) -> int:
    """A forward pass's share of ``flops_per_token``, 2·N + 2·L·H·Q·T: what a model computes per
    token where no gradient is taken (the reference model of train.objective=dpo)."""
    return round(2 * num_matmul_params + 2 * n_layers * attention_width * seq_len)


def compute_dtype_key(param_dtype: str) -> str:
    """The peak table's column for a run's compute dtype: fp32 matmuls use TF32 tensor cores when
    torch allows."""
    if param_dtype in ("bfloat16", "float16"):
        return "bfloat16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "float32"


def peak_flops(
    device: torch.device, param_dtype: str, override_tflops: float | None = None
) -> float | None:
    """Peak FLOP/s of one ``device`` for ``param_dtype`` compute; None where unknown (the CPU, an
    unlisted card).

    ``override_tflops`` (``logging.peak_tflops``) wins: for a card the table lacks, or a
    clock-limited one.
    """
    if override_tflops:
        return float(override_tflops) * 1e12
    if device.type != "cuda":  # ROCm builds report their GPUs as cuda too
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks.get(compute_dtype_key(param_dtype))
    return None
