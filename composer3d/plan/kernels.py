"""Compute time of one pipeline rank's step on its device, from the shapes of the work, not one flat
efficiency.

Four kinds of kernel, each with its own bound (a roofline per kernel, compute and memory time added:
a kernel this size overlaps little of its loads with its math):
  GEMMs: every linear's forward, input-gradient and weight-gradient matmul, 2·m·n·k FLOPs each at
    the fraction of peak that large cuBLAS GEMMs reach (``cluster.achievable_fraction``) plus its
    operands' and output's bytes over HBM. A GEMM of a small hidden size or a small micro-batch has
    less work per byte: that is why a 2048-wide model or a TP-split 8B runs further below peak than
    a 70B. Float8 (torchao / Transformer Engine): the same GEMMs at twice the dense rate with 1-byte
    operands, plus the casts that scale each operand (read for its amax, read again and written in 1
    byte); the rest of the step is unchanged.
  Attention (flash attention, causal): forward 2 matmuls over half the score matrix, backward 5 (it
    recomputes the scores; Dao 2023): 7·s·H·Q FLOPs per token and layer at the fraction of peak its
    kernel reaches (``ATTENTION_FRACTION``, by ``plan.attention_kernel``): the kernel sets it, not
    the length (past a few thousand tokens a flash kernel's rate is flat in it), and kernels differ:
    on an H100 cuDNN's runs ~1.6× FlashAttention-2's.
  Elementwise work (norms, RoPE, SwiGLU, residual adds, casts, the loss's softmax): memory-bound, so
    bytes over HBM bandwidth: passes over the block's activations and the logits, many in eager mode
    (one kernel per op, each reading its inputs and writing its output), few when torch.compile
    fuses them.
  The optimizer step: AdamW reads every local fp32 parameter, gradient and moment once and writes
    back the parameters and moments. optim.name=muon (plan/muon.py): its eager kernels' bytes for
    each local parameter Muon steps (``muon_bytes``), and this rank's share of the Newton–Schulz
    iterations (``newton_schulz_s``: three GEMMs a step, by shape, at the GEMMs' fraction of peak,
    and the elementwise kernels between them).
Recomputation by checkpointing mode: full reruns the forward (GEMMs, attention, elementwise);
op-level selective (``all_matmuls``) reruns the forward's elementwise work, torchtitan's
``alternate_matmuls`` also every other forward GEMM; and in eager mode op-level selective
checkpointing routes every op of a block through a Python dispatch mode, a fixed host cost per block
and micro-batch that the device waits for (``EAGER_SAC_S``). train.objective=dpo's reference model
(a frozen copy, or the policy with LoRA's adapters off) runs one forward more per micro-batch: its
GEMMs and head, attention's forward, a forward's share of the elementwise work; no recomputation and
no dispatch (torch's checkpoint does nothing without gradients).

The free constants (four, each measured, each the same for every layout and model):
  ATTENTION_FRACTION's sdpa rate and the compiled ELEMENTWISE_PASSES from composer3d's own
  single-H100 runs (issue 29: Llama 3.2 1B and 3B at 8192 tokens, compiled, with and without
  selective AC); the eager ELEMENTWISE_PASSES and EAGER_SAC_S from its eager 1B on an H200 at the
  current code (since the issue's eager runs the loss is fused and one device casts once a step: the
  constants set on those runs predicted this step 29% slow); its flash2 rate is FlashAttention-2's
  own published H100 benchmark, set on no training run. ``cluster.achievable_fraction`` (the
  large-GEMM fraction) is the fourth, and the devices' HBM bandwidths are their data sheets'
  (plan/hardware.py).

A calibration file (``plan.calibration``: plan/rates.py, written by plan/calibrate.py on the device
planned for) replaces what it measured: the GEMMs' rates by shape (both roofline terms: its times
hold the bytes), attention's per kernel by length, the optimizer step's seconds per parameter, and
the memory bandwidth the elementwise kernels run at.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate
from composer3d.plan.shapes import ModelShape, StageSet

# Causal attention forward + backward, bf16: the fraction of the dense peak its FLOPs run at, by
# kernel (plan.attention_kernel). sdpa: torch's scaled_dot_product_attention since 2.9 (cuDNN's
# fused kernel on Hopper and Blackwell, pytorch#162073), what composer3d-train runs; set by its 1B
# runs (torch 2.11), whose attention is a third of their FLOPs. flash2: FlashAttention-2, SDPA's
# flash backend (torch's default on Hopper before 2.9: torchtitan's published H100 runs): it issues
# Ampere's warp-level MMAs, not Hopper's wgmma, and reaches about a third of an H100's peak: 335
# TFLOP/s causal forward and 322 backward at head dim 128, 16k tokens, flat from 4k on
# (FlashAttention-3 paper, Shah et al. 2024, H100 SXM5 figures): 3.5 / (1/335 + 2.5/322) = 326
# of 989.
ATTENTION_FRACTION = {"sdpa": 0.38, "flash2": 0.33}
# HBM bytes the elementwise kernels move per byte of a block's activations (forward + backward), and
# per byte of the logits. Compiled: Inductor's fused kernels, from the 1B's compiled step without
# checkpointing (46,788 tok/s on one H100; its selective step on an H200 at the current code,
# 48,307, is predicted within 1%). Eager: a kernel per op, where torch has no fused one (RMSNorm
# has: aten::_fused_rms_norm; the loss is a compiled chunk function even in eager mode): from the
# 1B's eager selective step on an H200 (torch 2.11, 2026-11-26), whose profile puts 41.8 ms in
# elementwise kernels, copies and the loss (benchmarks/step_profile.py) where 8 passes predict 40.5.
ELEMENTWISE_PASSES = {False: 8.0, True: 6.0}  # keyed by compiled


def _bytes(*ops: tuple[int, int]) -> int:
    """HBM bytes per element of a chain of elementwise kernels, each (bytes read, bytes written)."""
    return sum(read + written for read, written in ops)


# An RMSNorm's bytes per element of its (bf16) input in an eager step, (forward, backward), by
# plan.norm_kernel; the passes above count the fused one, a composite one adds its difference.
# fused: forward reads x and writes y, backward reads x and dy and writes dx. composite (x.float(),
# pow, mean, ·rsqrt, type_as, ·weight; fp32 between): backward is each op's own backward kernel:
# ·weight (dx, dw's product and sum), type_as, ·rsqrt (dx, and the product summed for the rsqrt's
# gradient), mean's expansion, pow's, the two dx added, the cast back to bf16.
NORM_BYTES = {
    "fused": (_bytes((2, 2)), _bytes((4, 2))),
    "composite": (
        _bytes((2, 4), (4, 4), (4, 0), (4, 4), (4, 2), (2, 2)),
        _bytes(
            (2, 2), (4, 2), (2, 0), (2, 4), (4, 4), (8, 4), (4, 0), (0, 4), (8, 4), (8, 4), (4, 2)
        ),
    ),
}
# Host seconds per block and micro-batch the device waits for in an eager step under op-level
# selective checkpointing (torch's selective checkpoint dispatch mode runs in Python for every op,
# forward and recomputation): that H200 step's 43,011 tok/s less its predicted kernels (9.9 ms over
# 16 blocks), as its autocast twin's profile shows the device idle (9.6 ms).
EAGER_SAC_S = 0.6e-3
# AdamW per local parameter as an accelerator steps it (optim.implementation=auto: the compiled
# update): fp32 parameter, gradient and two moments read (16 B), parameter and moments written (12
# B); the norm's read of the gradients (4 B more) is left out. On an H200 the 1.5B model's step,
# norm included, moves 32 B a parameter at 79% of the memory bandwidth
# (benchmarks/optimizer_step.py: 12.6 ms); fused AdamW stores the clipped gradient too.
OPTIMIZER_BYTES = 28


def muon_bytes(ns_bytes: int, nesterov: bool) -> int:
    """HBM bytes of optim.name=muon's eager kernels per element of a parameter Muon steps on this
    rank (optim/muon.py, optim/orthogonalize.py: fp32 weights, gradient and momentum; ``ns_bytes``
    the Newton–Schulz dtype's), its Newton–Schulz itself apart (``newton_schulz_s``): the momentum
    m·μ (read 4, write 4) and m + g (8, 4); Nesterov's g + μ·m (8, 4); the update cast to the
    Newton–Schulz dtype on its way out (4, b) and concatenated into the gather's buffer or copied
    into its matrix on the owner (b, b); the result's pieces copied and concatenated into the
    scatter's buffer (≈ 2b, 2b: nearly every piece goes to another holder) and stored where they
    land (b, b); the update cast back (b, 4) and the weights decayed (4, 4) and moved (8, 4).
    Counted from the code, not measured: 60 + 10b bytes with Nesterov, 48 + 10b without."""
    return (60 if nesterov else 48) + 10 * ns_bytes


def newton_schulz_s(
    rows: int, cols: int, steps: int, ns_bytes: int, flops_rate: float, hbm_bw: float
) -> float:
    """One rows × cols matrix orthogonalized on its owner (orthogonalize.newton_schulz, n the
    smaller side, m the larger): per step the GEMMs X·Xᵀ [n, m]×[m, n], its square and the product
    with X [n, n]×[n, m] at ``flops_rate`` (``orthogonalize.newton_schulz_flops`` in all), each with
    its operands and output over HBM, as ``_gemm_s``; and the eager kernels between them (b·A and
    c·A and their sum over n², a·X and its sum over n·m: 7 passes of n² and 5 of n·m); before them
    one normalization (a norm's read, a division's read and write)."""
    n, m = min(rows, cols), max(rows, cols)

    def gemm(a: int, b: int, k: int) -> float:
        return 2 * a * b * k / flops_rate + (a * k + b * k + a * b) * ns_bytes / hbm_bw

    step = (
        gemm(n, n, m) + gemm(n, n, n) + gemm(n, m, n) + (7 * n * n + 5 * n * m) * ns_bytes / hbm_bw
    )
    return steps * step + 3 * n * m * ns_bytes / hbm_bw


@dataclass(frozen=True)
class Work:
    """What the device does in one step, in the terms its time comes from."""

    compiled: bool
    float8: bool
    attention: str = "sdpa"  # plan.attention_kernel
    norm: str = "fused"  # plan.norm_kernel
    # float8 covers the routed experts' GEMMs too (plan.published_float8_experts: Transformer
    # Engine's grouped GEMMs); composer3d's float8 converts nn.Linear layers, its stacked experts
    # stay in the compute dtype
    float8_experts: bool = False


def _gemm_s(m: float, n: float, k: float, cluster: Cluster, float8: bool) -> float:
    """One GEMM [m, k] × [k, n] (forward, or either backward one: the same shapes permuted)."""
    measured = cluster.rates.gemm_rate(m, n, k) if cluster.rates and not float8 else None
    if measured:
        return 2 * m * n * k / measured
    cb = cluster.compute_bytes
    if float8:
        flops_s = 2 * m * n * k / (2 * cluster.peak_flops * cluster.achievable_fraction)
        # operands, output, their casts
        bytes_ = m * k + n * k + m * n * cb + (m * k + n * k) * (2 * cb + 1)
    else:
        flops_s = 2 * m * n * k / (cluster.peak_flops * cluster.achievable_fraction)
        bytes_ = (m * k + n * k + m * n) * cb
    return flops_s + bytes_ / cluster.hbm_bw


def attention_rate(cluster: Cluster, kernel: str, seq_len: int) -> float:
    """FLOP/s of causal attention's forward + backward under ``kernel`` (plan.attention_kernel) at
    ``seq_len`` tokens a sequence: the calibration's where it measured the kernel, else the
    kernel's fraction of the peak."""
    measured = cluster.rates.attention_rate(kernel, seq_len) if cluster.rates else None
    return measured or cluster.peak_flops * ATTENTION_FRACTION[kernel]


def block_linears(shape: ModelShape, tp: int) -> list[tuple[int, int]]:
    """(out, in) of one dense block's linears on a TP rank: wq, wk, wv, wo, w1, w3, w2."""
    h, q, kv, f = (
        shape.dim,
        shape.n_heads * shape.head_dim,
        shape.n_kv_heads * shape.head_dim,
        shape.ffn,
    )
    return [
        (q // tp, h),
        (kv // tp, h),
        (kv // tp, h),
        (h, q // tp),
        (f // tp, h),
        (f // tp, h),
        (h, f // tp),
    ]


def _moe_linears(
    shape: ModelShape, tp: int, ep: int
) -> tuple[list[tuple[int, int, float, int]], list[tuple[int, int, float, int]]]:
    """(out, in, rows per token, GEMMs the rows are split over) of a MoE block's linears on a (TP,
    EP) rank, as (attention, router and shared experts: every token; the routed experts: top_k rows
    per token, balanced, so a rank's experts take as many copies as its tokens make, one GEMM per
    local expert, each reading its own weights and writing their gradient)."""
    h, m = shape.dim, shape.moe
    every = [(o, i, 1.0, 1) for o, i in block_linears(shape, tp)[:4]] + [(m.experts, h, 1.0, 1)]
    s = m.shared * m.hidden
    if s:
        every += [(s // tp, h, 1.0, 1), (s // tp, h, 1.0, 1), (h, s // tp, 1.0, 1)]
    f, local = m.hidden // tp, m.experts // ep
    return every, [(f, h, m.top_k, local), (f, h, m.top_k, local), (h, f, m.top_k, local)]


def _activation_elements(shape: ModelShape, tp: int, moe: bool) -> float:
    """Elements per token a block's forward writes (plan/activations.py's terms without
    checkpointing, MoE's routed copies counted per copy)."""
    h, q, kv, heads = (
        shape.dim,
        shape.n_heads * shape.head_dim,
        shape.n_kv_heads * shape.head_dim,
        shape.n_heads,
    )
    if moe:
        mlp = 4 * shape.moe.shared * shape.moe.hidden / tp + shape.moe.top_k * (
            2 * h + 4 * shape.moe.hidden / tp
        )
    else:
        mlp = 4 * shape.ffn / tp
    return 4 * h + (4 * q + 2 * kv + heads) / tp + mlp


def _norm_extra_bytes(
    shape: ModelShape, stages: StageSet, rows: int, rerun: float, work: Work
) -> float:
    """What an eager step's norms (two a block, the final one on the last stage) move beyond fused
    RMSNorms, their forward once more for each ``rerun`` (checkpointing's of the elementwise work,
    the DPO reference's forward)."""
    if work.compiled or work.norm == "fused":
        return 0.0
    (forward, backward), (fused_forward, fused_backward) = (
        NORM_BYTES[work.norm],
        NORM_BYTES["fused"],
    )
    norms = 2 * (stages.dense_layers + stages.moe_layers) + (1 if stages.last else 0)
    return (
        norms
        * rows
        * shape.dim
        * ((forward - fused_forward) * (1 + rerun) + backward - fused_backward)
    )


@dataclass(frozen=True)
class StepCompute:
    """Seconds of one step's compute on a rank, by kind (recomputation included in each)."""

    gemm: float
    attention: float
    elementwise: float
    optimizer: float
    host: float  # eager selective checkpointing's dispatch

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.optimizer + self.host


def step_compute(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    local_params: float,
    cluster: Cluster,
    work: Work,
    reference_forward: bool = False,
    muon_s: float = 0.0,
) -> StepCompute:
    """One step of this pipeline rank: every micro-batch's forward and backward, recomputation, the
    optimizer step. ``seq_len``: the tokens of a sequence this rank holds (seq_len / cp);
    ``local_params``: the parameters its AdamW steps (after FSDP's or ZeRO-1's sharding);
    ``reference_forward``: train.objective=dpo's reference model runs a forward (no gradients)
    every micro-batch: its GEMMs, head, attention and elementwise work once more, as a forward;
    ``muon_s``: optim.name=muon's seconds for the parameters Muon steps (plan/muon.py), in the
    optimizer step."""
    # a GEMM's m: SP gathers the sequence back before each matmul
    rows = c.micro_batch_size * seq_len
    full = c.activation_checkpointing == "full"
    every = c.ac_every if c.activation_checkpointing == "selective" else 0
    op_level = c.activation_checkpointing == "selective" and not every
    layers = stages.dense_layers + stages.moe_layers
    # forward GEMMs rerun per block: full checkpointing all of them, every ac_every-th block's
    rerun_gemm = 1.0 if full else 1 / every if every else 0.0
    alternate = op_level and c.ac_policy == "alternate_matmuls"
    # attention's forward and the whole block's
    rerun_fwd = 1.0 if full else 1 / every if every else 0.0
    rerun_elementwise = 1.0 if (full or op_level) else 1 / every if every else 0.0
    reference = 1.0 if reference_forward else 0.0

    def block_gemms(linears, float8: bool) -> float:
        return sum(g * _gemm_s(rows * r / g, o, i, cluster, float8) for o, i, r, g in linears)

    linears = [(o, i, 1.0, 1) for o, i in block_linears(shape, c.tp)]
    dense = block_gemms(linears, work.float8)
    # alternate_matmuls reruns the 2nd, 4th, … matmul it counts in a block (plan/activations.py's
    # block_matmul_outputs): wk, wo, w3, about a third of a dense block's GEMM FLOPs (charging half
    # predicted its H200 rows 4–7% slow). A sequence tile's matmuls are not counted.
    counted = linears[:4] if c.tile_mlp > 1 else linears
    rerun_alternate = (
        stages.dense_layers * block_gemms(counted[1::2], work.float8) if alternate else 0.0
    )
    moe = 0.0
    if stages.moe_layers:
        every, routed = _moe_linears(shape, c.tp, c.ep)
        moe = block_gemms(every, work.float8) + block_gemms(
            routed, work.float8 and work.float8_experts
        )
        if alternate:  # the routed experts' grouped matmuls are not counted: always kept
            rerun_alternate += stages.moe_layers * block_gemms(every[1::2], work.float8)
    forward_gemm = stages.dense_layers * dense + stages.moe_layers * moe
    # the output head stays in the compute dtype under float8 (precision/float8.py, as torchtitan's
    # and Megatron's)
    head = block_gemms([(shape.vocab // c.tp, shape.dim, 1.0, 1)], False) if stages.last else 0.0
    gemm = (3 + rerun_gemm + reference) * forward_gemm + rerun_alternate + (3 + reference) * head

    # causal flash attention: forward 2·s·H·Q per token and layer, backward 2.5× that; cp: a rank's
    # queries against the whole sequence's keys, half of them masked on average
    attention_fwd = 2 * shape.n_heads / c.tp * shape.head_dim * seq_len * c.cp * rows
    attention = (
        layers
        * attention_fwd
        * (3.5 + rerun_fwd + reference)
        / attention_rate(cluster, work.attention, seq_len)
    )

    passes = ELEMENTWISE_PASSES[work.compiled]
    block_bytes = (
        rows
        * cluster.compute_bytes
        * (
            stages.dense_layers * _activation_elements(shape, c.tp, False)
            + stages.moe_layers
            * (_activation_elements(shape, c.tp, True) if stages.moe_layers else 0.0)
        )
    )
    logits_bytes = rows * 4 * shape.vocab / c.tp if stages.last else 0.0  # the loss works in fp32
    # forward is about a third of the elementwise traffic: what recomputation repeats, and the
    # reference's forward (its log-probabilities too: the loss's forward)
    elementwise = (
        passes * (block_bytes + logits_bytes)
        + passes / 3 * (rerun_elementwise * block_bytes + reference * (block_bytes + logits_bytes))
        + _norm_extra_bytes(shape, stages, rows, rerun_elementwise + reference, work)
    ) / cluster.hbm_bw

    host = layers * EAGER_SAC_S if op_level and not work.compiled else 0.0
    m = c.microbatches
    per_param = (
        cluster.rates.optimizer.seconds_per_param
        if cluster.rates and cluster.rates.optimizer
        else OPTIMIZER_BYTES / cluster.hbm_bw
    )
    optimizer = local_params * per_param + muon_s
    return StepCompute(m * gemm, m * attention, m * elementwise, optimizer, m * host)
