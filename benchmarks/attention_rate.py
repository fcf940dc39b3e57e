"""Causal attention's rate by SDPA kernel, sequence length and head size, and a Llama block's step
by length.

    python benchmarks/attention_rate.py [--lengths 4096 8192 16384 32768] [--steps 5]

What composer3d-plan's attention term rests on (plan/kernels.py, ``plan.attention_kernel``): the
FLOP/s that scaled-dot-product attention reaches, causal, batch 1, forward and backward apart, for
each kernel SDPA has here: flash (FlashAttention-2: torch's default on Hopper before 2.9), cudnn
(cuDNN's fused kernel: the default there since), what SDPA picks unasked, and what it picks under a
dense boolean causal mask (masked: how context parallel's allgather and ulysses styles attend, their
mask of global token indices; no flash kernel takes one). Shapes: Llama 3 8B's heads (32 query, 8 KV
heads of 128; GQA expanded as torchtitan's model does, and as ``enable_gqa``) and Llama 3.2 1B's (32
of 64). FLOPs are the causal count (half the score matrix): forward 2·s²·h·d, backward 2.5× that (it
recomputes the scores). Then one Llama 3 8B block in plain PyTorch (RMSNorm, GQA attention, SwiGLU),
forward + backward, per token at each length: what the length adds to a block. Each time is the
median of ``--steps`` after two warm-ups. On an accelerator in bf16; on the CPU (a smoke run) small
shapes in fp32, where only the flash kernel exists.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from composer3d.launch.distributed import is_accelerator, resolve_device
from composer3d.plan.calibrate import attention_seconds, timed

KERNELS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "default": [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ],
}
KERNELS["masked"] = KERNELS["default"]


def attention(
    s: int,
    heads: int,
    kv_heads: int,
    d: int,
    gqa: str,
    kernel: str,
    dtype,
    device,
    steps: int,
) -> tuple[float, float]:
    """(forward s, forward + backward s) of causal SDPA over one sequence; ``gqa``: expand (K/V
    repeated) or native (composer3d-plan plan.calibrate's timing: plan/calibrate.py)."""
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril() if kernel == "masked" else None
    return attention_seconds(
        1,
        s,
        heads,
        kv_heads,
        d,
        dtype,
        device,
        steps,
        KERNELS[kernel],
        expand=gqa == "expand",
        mask=mask,
    )


class Block(torch.nn.Module):
    """A Llama 3 block without RoPE (elementwise, and the same per token at every length): pre-norm
    GQA attention, pre-norm SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = (
            linear(dim, dim),
            linear(dim, kv_heads * self.d),
            linear(dim, kv_heads * self.d),
            linear(dim, dim),
        )
        self.w1, self.w3, self.w2 = linear(dim, ffn), linear(dim, ffn), linear(ffn, dim)
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)

    def forward(self, x):
        b, s, dim = x.shape
        h = self.norm1(x)
        q, k, v = (
            w(h).view(b, s, n, self.d).transpose(1, 2)
            for w, n in ((self.wq, self.heads), (self.wk, self.kv_heads), (self.wv, self.kv_heads))
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, dim))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--lengths", type=int, nargs="+", help="sequence lengths (default 4k-32k; the CPU: 64, 128)"
    )
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    device = resolve_device("auto")
    accelerator = is_accelerator(device)
    dtype = torch.bfloat16 if accelerator else torch.float32
    lengths = args.lengths or ([4096, 8192, 16384, 32768] if accelerator else [64, 128])
    # (heads, kv heads, head dim, GQA) and the block's (dim, heads, kv heads, ffn): Llama 3 8B's;
    # the CPU's small
    shapes = (
        [(32, 8, 128, "expand"), (32, 8, 128, "native"), (32, 8, 64, "native")]
        if accelerator
        else [(4, 2, 16, "expand"), (4, 2, 16, "native")]
    )
    block_shape = (4096, 32, 8, 14336) if accelerator else (64, 4, 2, 128)
    order = [SDPBackend(i).name for i in torch._C._get_sdp_priority_order()]
    print(
        f"{device.type} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}, torch "
        f"{torch.__version__},"
        f" {str(dtype).removeprefix('torch.')}; SDPA's general priority: {order}"
    )
    print(
        f"{'kernel':<8}{'heads':>6}{'d':>5}{'gqa':>8}{'seq':>7}{'fwd ms':>10}{'bwd ms':>10}"
        f"{'fwd TF/s':>10}{'bwd TF/s':>10}{'all TF/s':>10}"
    )
    for kernel in KERNELS:
        for heads, kv_heads, d, gqa in shapes:
            for s in lengths:
                try:
                    fwd, both = attention(
                        s, heads, kv_heads, d, gqa, kernel, dtype, device, args.steps
                    )
                    bwd = both - fwd
                except RuntimeError:  # a kernel this device or build lacks (cuDNN's on the CPU)
                    print(f"{kernel:<8}{heads:>6}{d:>5}{gqa:>8}{s:>7}  not available here")
                    break
                flops = 2 * s * s * heads * d  # causal forward
                print(
                    f"{kernel:<8}{heads:>6}{d:>5}{gqa:>8}{s:>7}{fwd * 1e3:>10.3f}{bwd * 1e3:>10.3f}"
                    # significant digits: a
                    f"{flops / fwd / 1e12:>10.4g}{2.5 * flops / bwd / 1e12:>10.4g}"
                    f"{3.5 * flops / (fwd + bwd) / 1e12:>10.4g}"
                )  # slow CPU step's rate is not rounded to 0
    block = Block(*block_shape).to(device=device, dtype=dtype)
    print(
        f"block (dim {block_shape[0]}, SDPA unasked), forward + backward: {'ms':>9}{'us/token':>10}"
    )
    for s in lengths:
        x = torch.randn(1, s, block_shape[0], device=device, dtype=dtype, requires_grad=True)
        t = timed(lambda: block(x).sum().backward(), args.steps, device)
        print(f"  seq {s:<37}{t * 1e3:>9.3f}{t / s * 1e6:>10.3f}")


if __name__ == "__main__":
    main()
