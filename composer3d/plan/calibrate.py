"""``composer3d-plan plan.calibrate=FILE``: the kernels a layout runs, timed at its shapes on the
device at hand, written as the rates the planner reads back (``plan.calibration``: plan/rates.py).

For the config's model and layout (its micro-batch, tp, cp and FSDP degree), in the dtype a run on
this device computes in (bf16 on an accelerator, fp32 on the CPU, or ``precision.param_dtype``):
  - GEMMs: each distinct linear of a block on a TP rank (wq, wk, wv, wo, w1, w3, w2) and the output
    head, at rows = micro-batch × the rank's tokens: its forward, input-gradient and weight-gradient
    matmuls, each timed apart;
  - attention: causal SDPA forward and backward as the model calls it (the rank's heads, GQA
    native, the micro-batch's sequences) at the rank's sequence length, a half and a quarter of it
    and twice it, for each plan.attention_kernel this device runs (sdpa: what SDPA picks, as
    training runs it; flash2: its flash backend);
  - the optimizer step: the gradient norm, the clip and AdamW (``optim.implementation`` as it
    resolves here: training's kernels) over the rank's blocks as it holds them (TP-split, each
    parameter's rows sharded over dp_shard), at most ``OPTIMIZER_MAX_PARAMS`` elements;
  - memory bandwidth: a copy of a block's widest activation (rows × the MLP's width on the rank).
Each time is the median of ``repeats`` after warm-ups: between events on an accelerator's stream,
by the host's clock on the CPU. Other layouts' shapes (the search's) take the rates interpolated
between these (plan/rates.py).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from composer3d.config.schema import OptimConfig
from composer3d.dtypes import DTYPES
from composer3d.errors import ConfigError
from composer3d.launch.distributed import is_accelerator
from composer3d.optim.build import adamw_implementation, build_optimizer
from composer3d.parallel.mesh import Layout
from composer3d.plan.hardware import DEVICES, compute_dtype, device_row
from composer3d.plan.kernels import block_linears
from composer3d.plan.layouts import Candidate, WithKeys
from composer3d.plan.rates import Attention, Copy, Gemm, OptimizerStep, Rates
from composer3d.plan.shapes import ModelShape
from composer3d.training.grad import clip_grad_norm_

# plan.attention_kernel's kernels as SDPA's backends (None: SDPA's own pick)
ATTENTION_BACKENDS = {"sdpa": None, "flash2": [SDPBackend.FLASH_ATTENTION]}
# the optimizer step's parameters at most: bandwidth-bound long before (a 1B model's blocks on one
# rank would hold 16 GB of state for nothing more)
OPTIMIZER_MAX_PARAMS = 2**27
LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def timed(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 2) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls."""
    times = []
    for _ in range(warmup + repeats):
        if is_accelerator(device):  # the kernels' time on the stream, not their launch's
            start, end = (torch.Event(device, enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times[warmup:])


def gemm_seconds(m: int, n: int, k: int, dtype, device: torch.device, repeats: int) -> float:
    """A linear's [m, k] × [k, n] forward, [m, n] × [n, k] input gradient and [n, m] × [m, k]
    weight gradient, each timed."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    return sum(
        timed(f, repeats, device) for f in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x)
    )


def attention_seconds(
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype,
    device: torch.device,
    repeats: int,
    backends: list[SDPBackend] | None = None,
    expand: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[float, float]:
    """(forward, forward + backward) seconds of causal SDPA laid out as the model calls it (q, k, v
    viewed [batch, heads, seq, head_dim] from [batch, seq, heads, head_dim]). ``backends``: those
    SDPA may use (None: its own pick); ``expand``: K/V repeated to the query heads (torchtitan's
    model) rather than SDPA's ``enable_gqa``; ``mask``: a boolean mask in place of ``is_causal``.
    Raises RuntimeError where no allowed backend takes the call."""
    q = torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(
            batch, seq_len, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True
        )
        for _ in "kv"
    )
    grad = torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype)

    def forward():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if expand:
            kt, vt = (t.repeat_interleave(heads // kv_heads, 1) for t in (kt, vt))
        return F.scaled_dot_product_attention(
            qt,
            kt,
            vt,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=not expand and heads != kv_heads,
        )

    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        with torch.no_grad():
            fwd = timed(forward, repeats, device)
        both = timed(lambda: forward().backward(grad), repeats, device)
    return fwd, both


def optimizer_step_seconds(
    params: list[torch.nn.Parameter],
    grads: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    handed: bool,
    steps: int,
    device: torch.device,
    warmup: int = 3,
) -> tuple[float, float]:
    """The median seconds of the gradient norm, the clip at ``max_norm`` (``handed``: divided in the
    optimizer's step, as training hands it where the optimizer can) and the step, after ``warmup``
    steps, the same gradients each time; and the first step's seconds (a compiled step's
    compile)."""
    times = []
    for _ in range(steps + warmup):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if is_accelerator(device):
            torch.accelerator.synchronize(device)
        start = time.perf_counter()
        clip_grad_norm_(params, max_norm, Layout(), optimizer=optimizer if handed else None)
        optimizer.step()
        if is_accelerator(device):
            torch.accelerator.synchronize(device)
        times.append(time.perf_counter() - start)
        optimizer.grad_scale = None
    return statistics.median(times[warmup:]), times[0]


def device_names(device: torch.device) -> tuple[str, str]:
    """(cluster.device's name for ``device``, what torch calls it); refused where the planner's
    table has no row for it (nothing could plan with its file)."""
    if not is_accelerator(device):
        threads = torch.get_num_threads()
        return "cpu", f"{platform.machine()} CPU, {threads} thread{'s' * (threads != 1)}"
    # ROCm builds report their GPUs as cuda too
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    row = device_row(name)
    if row is None:
        raise ConfigError(
            f"launch.device: this machine's {name} has no row in the planner's device table "
            f"(cluster.device: {', '.join(sorted(DEVICES))}), so no plan could read its "
            "calibration. Calibrate on one of those, or plan this card with the closest row and "
            "its cluster.* overrides"
        )
    return row, name


def calibrate(
    shape: ModelShape,
    c: Candidate,
    seq_len: int,
    device: torch.device,
    param_dtype: str,
    optim: OptimConfig,
    grad_clip: float,
    repeats: int,
) -> Rates:
    """Time the kernels layout ``c`` of ``shape`` runs at ``seq_len`` tokens a sequence, here on
    ``device``; ``param_dtype`` (precision.param_dtype) sets the compute dtype as it would in a run
    here, ``optim`` and ``grad_clip`` (train.grad_clip) the optimizer step."""
    row, name = device_names(device)
    dtype_name = compute_dtype(row, param_dtype)
    dtype = DTYPES[dtype_name]
    rows = c.micro_batch_size * (seq_len // c.cp)
    src = torch.randn(rows * (shape.ffn // c.tp), device=device, dtype=dtype)
    dst = torch.empty_like(src)
    return Rates(
        device=row,
        device_name=name,
        dtype=dtype_name,
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        layout=c.short(),
        gemms=_gemms(shape, c.tp, rows, dtype, device, repeats),
        attention=_attention(shape, c, seq_len // c.cp, dtype, device, repeats),
        optimizer=_optimizer_step(shape, c, device, optim, grad_clip, repeats),
        copy=Copy(
            2 * src.numel() * src.element_size(), timed(lambda: dst.copy_(src), repeats, device)
        ),
    )


def _gemms(shape: ModelShape, tp: int, rows: int, dtype, device, repeats: int) -> tuple[Gemm, ...]:
    """Each distinct linear of a block on a TP rank, and the head."""
    names: dict[tuple[int, int], list[str]] = {}
    linears = [
        *zip(LINEAR_NAMES, block_linears(shape, tp)),
        ("output", (shape.vocab // tp, shape.dim)),
    ]
    for linear, (out, in_) in linears:
        names.setdefault((out, in_), []).append(linear)
    return tuple(
        Gemm(tuple(these), rows, n, k, gemm_seconds(rows, n, k, dtype, device, repeats))
        for (n, k), these in names.items()
    )


def _attention(
    shape: ModelShape, c: Candidate, tokens: int, dtype, device, repeats: int
) -> tuple[Attention, ...]:
    """Each kernel this device runs, at a quarter, a half, one and two times the rank's
    ``tokens``."""
    heads, kv_heads = shape.n_heads // c.tp, max(1, shape.n_kv_heads // c.tp)
    measured = []
    for kernel, backends in ATTENTION_BACKENDS.items():
        try:
            times = [
                (
                    s,
                    *attention_seconds(
                        c.micro_batch_size,
                        s,
                        heads,
                        kv_heads,
                        shape.head_dim,
                        dtype,
                        device,
                        repeats,
                        backends,
                    ),
                )
                for s in sorted({tokens // 4, tokens // 2, tokens, 2 * tokens} - {0})
            ]
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # a kernel this device or build lacks: its constant stays
            continue
        measured += [
            Attention(kernel, s, c.micro_batch_size, heads, kv_heads, shape.head_dim, fwd, both)
            for s, fwd, both in times
        ]
    return tuple(measured)


def _optimizer_step(
    shape: ModelShape, c: Candidate, device, optim: OptimConfig, grad_clip: float, repeats: int
) -> OptimizerStep:
    """AdamW over the rank's blocks: each linear TP-split, each parameter's rows sharded over
    dp_shard; at most OPTIMIZER_MAX_PARAMS elements, one block at least."""
    block = [(math.ceil(out / c.dp_shard), in_) for out, in_ in block_linears(shape, c.tp)]
    block += [(math.ceil(shape.dim / c.dp_shard),)] * 2  # the norms
    numel = sum(math.prod(s) for s in block)
    blocks = max(1, min(shape.n_layers // c.pp, OPTIMIZER_MAX_PARAMS // numel))
    # named as a model's blocks are ("0.3"): the compiled step takes a call a block
    module = torch.nn.ModuleList(
        torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in block
        )
        for _ in range(blocks)
    )
    params = list(module.parameters())
    optimizer, _ = build_optimizer(module, WithKeys(optim, name="adamw"), device=device)
    grads = [torch.randn_like(p) for p in params]
    seconds, _ = optimizer_step_seconds(params, grads, optimizer, grad_clip, True, repeats, device)
    return OptimizerStep(
        adamw_implementation(optim.implementation, params), blocks * numel, len(params), seconds
    )
