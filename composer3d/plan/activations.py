"""A block's activations per token, by checkpointing mode: what forward keeps for backward and what
exists only while the block runs backward (elements of the compute dtype).

Activations follow Korthikanti et al. (2022) in form — saved tensors per token per layer, split by
tp, the norm and residual part also by SP, a block input only under full checkpointing — with the
terms read from composer3d's own block (models/llama/) and verified by tests/test_plan.py's
measurements: per token and layer the block keeps its input, the two norm outputs and the attention
residual (4·h), q's projection and rotation, attention's output and o's input (4·q), k's rotation
and v (2·kv), attention's log-sum-exp (heads) and the MLP's gate, up, SiLU and product (4·f).
Compiled without checkpointing, Inductor's partition keeps less (measured on the CPU): the block
input in the residual stream's dtype, the norm outputs and wo's output (3·h), q's rotation and
attention's output (2·q), k's rotation and v (2·kv), the fp32 log-sum-exp and the norms' 1/rms, the
gate, up and product (3·f); the rest of the pointwise work reruns in backward. Op-level selective
checkpointing keeps only matmul and attention outputs (3·h + 2·q + 2·kv + heads + 2·f); torchtitan's
``alternate_matmuls`` every other linear's of them (``block_matmul_outputs``: 2·h + 2·q + kv +
heads + f); both keep the outputs of TP's reductions too (SP: the reduce-scattered 2·h/tp; without
SP the all-reduced 2·h), and under ``memory.ac_save_gathers`` SP's gathered 2·h (whole on every
rank) and the all-gather style's K/V, which they otherwise gather again in backward, as
tests/test_plan.py measures. A MoE layer's feed-forward part: ``_mlp_elements``. Sequence tiling
(``memory.tile_mlp``) leaves one tile's MLP hidden, recomputed in backward: that term over the tile
count. Op-level selective keeps nothing computed inside a tile (memory/activation_checkpointing.py):
no MLP matmul outputs, no w2 output and none of the MLP's collectives' (SP's gather and scatter,
TP's all-reduce run inside the tile).

Context parallel (plan/context.py): every term per token counts the seq_len / cp tokens a rank
holds; on top, ``cp_attention`` adds what its style keeps: the all-gather's whole-sequence K/V
(saved), the ring's K/V and gradient buffers while a layer's attention runs backward, the
all-gather's and Ulysses' mask.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer3d.parallel.context import RING_STYLES
from composer3d.plan.layouts import Candidate
from composer3d.plan.shapes import ModelShape


@dataclass(frozen=True)
class LayerActivations:
    """Per token of one block, in elements of the compute dtype: what forward keeps for backward,
    and what is alive only while the block runs backward (its recomputation under checkpointing, the
    gradients it makes)."""

    saved: float
    transient: float


def _mlp_elements(
    shape: ModelShape, c: Candidate, moe: bool, compute_bytes: int
) -> tuple[float, float, float]:
    """(kept without checkpointing, kept by op-level selective checkpointing, backward temporaries)
    of a block's feed-forward part, per token.

    Dense: gate, up, SiLU and product (4·f), of which the gate and up matmul outputs under
    selective. MoE (models/moe.py): the shared experts like a dense MLP; every routed copy of the
    token (top_k of them) keeps its row into the experts and the row out of them (2·k·h, whole on
    every TP rank) and the SwiGLU's four (4·k·f); the router keeps its fp32 scores (experts) and the
    int64 indices that sort and scatter the copies (3 per copy). Selective keeps the grouped
    matmuls' outputs (2·k·f + k·h), all-to-all's (2·k·h under ep) and the router's."""
    t = c.tp
    if not moe:
        f = shape.ffn
        return 4 * f / t, 2 * f / t, 2 * f / t
    m, h = shape.moe, shape.dim
    k, f, shared = m.top_k, m.hidden, m.shared * m.hidden
    router = (m.experts * 4 + 3 * k * 8) / compute_bytes
    full = 4 * shared / t + 2 * k * h + 4 * k * f / t + router
    selective = 2 * shared / t + 2 * k * f / t + k * h + (2 * k * h if c.ep > 1 else 0) + router
    return full, selective, 2 * shared / t + 2 * k * f / t + k * h


def block_matmul_outputs(
    shape: ModelShape, c: Candidate, moe: bool, compute_bytes: int
) -> list[float]:
    """A block's linear matmuls' outputs per token (elements of the compute dtype), in the order
    they run: what ``alternate_matmuls`` (memory/activation_checkpointing.py) counts afresh in each
    block, keeping the 1st, 3rd, … and recomputing the others (plan/kernels.py charges the rerun of
    the same ones, by their GEMMs' shapes).

    Attention: wq wk wv wo. Dense: w1 w3 w2, so alternate_matmuls recomputes wk, wo and w3. MoE: the
    router's fp32 logits and the shared experts' w1 w3 w2 (the routed experts' grouped matmuls are
    not counted: always kept), so wk, wo, shared w1 and w2. Under ``tile_mlp`` attention's only: the
    policy neither keeps nor counts a sequence tile's matmuls (memory/tiling.py), whose own
    checkpoint recomputes them."""
    t, h = c.tp, shape.dim
    q, kv = shape.n_heads * shape.head_dim / t, shape.n_kv_heads * shape.head_dim / t
    attention = [q, kv, kv, h]
    if not moe:
        return attention + ([] if c.tile_mlp > 1 else [shape.ffn / t, shape.ffn / t, h])
    shared = shape.moe.shared * shape.moe.hidden / t
    return (
        attention
        + [shape.moe.experts * 4 / compute_bytes]
        + ([shared, shared, h] if shared else [])
    )


def layer_activations(
    shape: ModelShape,
    c: Candidate,
    moe: bool,
    compute_bytes: int,
    cp_saved: float = 0.0,
    cp_transient: float = 0.0,
    compiled: bool = False,
    fp32_residual: bool = False,
) -> LayerActivations:
    """A block's activations per token, for the candidate's AC mode, TP, SP and MLP tiling;
    ``cp_saved`` and ``cp_transient``: what context parallel's attention adds (``cp_attention``);
    ``compiled``: torch.compile'd blocks; ``fp32_residual``: the residual stream in fp32 while the
    matmuls run in the compute dtype (autocast)."""
    t = c.tp
    h, q, kv, heads = (
        shape.dim,
        shape.n_heads * shape.head_dim,
        shape.n_kv_heads * shape.head_dim,
        shape.n_heads,
    )
    mlp, mlp_selective, mlp_backward = _mlp_elements(shape, c, moe, compute_bytes)
    # SP: attention's and MLP's all-gathered inputs, kept by the matmuls
    gathered = 2 * h if c.sequence_parallel else 0
    mlp_tile = 0.0
    tiled = c.tile_mlp > 1 and not moe
    if tiled:
        # memory/tiling.py: the feed-forward keeps only its tiles' inputs (the norm's output,
        # counted in the residual part; SP gathers inside the tile); one tile's hidden and gradients
        # exist at a time, in backward.
        mlp_tile = (mlp + mlp_backward) / c.tile_mlp
        mlp = mlp_selective = mlp_backward = 0.0
        gathered = h if c.sequence_parallel else 0
    residual = 4 * h / t if c.sequence_parallel else 4 * h
    full = residual + gathered + (4 * q + 2 * kv + heads) / t + mlp + cp_saved
    block_input = h / t if c.sequence_parallel else h
    kept = full
    if compiled and not moe and not tiled:
        # Inductor's partition of a dense block keeps the matmuls' inputs and outputs and SDPA's,
        # and reruns the pointwise work between them: not q's projection (RoPE reruns), o's input (a
        # view of attention's output) or the SiLU output; wo's output stands for the attention
        # residual. The block input stays in the residual stream's dtype; the norms' 1/rms and
        # attention's log-sum-exp are fp32.
        fp32 = 4 / compute_bytes
        stream = block_input * (fp32 if fp32_residual else 1)
        rms = (2 / t if c.sequence_parallel else 2) * fp32
        kept = (
            stream
            + 3 * block_input
            + gathered
            + (2 * q + 2 * kv + heads * fp32) / t
            + rms
            + 3 * shape.ffn / t
            + cp_saved
        )
    # the MLP's input gradients and the residual's, while a block runs backward (a tile's under
    # tiling)
    backward_temporaries = mlp_backward + h + mlp_tile + cp_transient
    if c.activation_checkpointing == "full":
        return LayerActivations(block_input, full + backward_temporaries)
    if c.activation_checkpointing == "selective" and c.ac_every == 0:
        # The policy keeps wo's and w2's outputs (residual width) and TP's reductions' too: SP's
        # reduce-scattered outputs, without SP the all-reduced ones (of attention and MLP each); the
        # all-gathered inputs (SP's, cp's K/V) only under ac_save_gathers, else recomputed with the
        # rest of the block. Tiled, the MLP's (w2, its gather and scatter or all-reduce) are inside
        # the tiles, which it keeps nothing of.
        if not c.ac_save_gathers:
            gathered, cp_saved = 0.0, 0.0
        outputs = 1 if tiled else 2
        collectives = gathered + outputs * (h / t if c.sequence_parallel else h if t > 1 else 0)
        saved = (
            block_input
            + outputs * h
            + (2 * q + 2 * kv + heads) / t
            + mlp_selective
            + collectives
            + cp_saved
        )
        if c.ac_policy == "alternate_matmuls":
            saved -= sum(block_matmul_outputs(shape, c, moe, compute_bytes)[1::2])
        if compiled and not moe and not tiled and t == 1 and c.cp == 1:
            # Inductor drops what backward never reads, kept or not: w2's output. The block input
            # stays in the residual stream's dtype and the log-sum-exp is fp32 (a CPU count of a
            # compiled block, to the byte: autocast's stream and bf16 parameters, either policy).
            fp32 = 4 / compute_bytes
            saved += block_input * ((fp32 if fp32_residual else 1) - 1) + heads * (fp32 - 1) - h
        return LayerActivations(saved, full - saved + backward_temporaries)
    if c.activation_checkpointing == "selective":  # every ac_every-th block fully checkpointed
        share = 1 / c.ac_every
        return LayerActivations(
            share * block_input + (1 - share) * kept, full + backward_temporaries
        )
    return LayerActivations(kept, mlp_tile + cp_transient)


def cp_attention(shape: ModelShape, c: Candidate, compute_bytes: int) -> tuple[float, float]:
    """(saved, transient) elements per local token and layer that context parallel's style adds to
    the block's (plan/context.py): the all-gather saves the whole sequence's K/V; the ring holds,
    while a layer's attention runs backward, the K/V block and the one arriving, their fp32
    gradients (held and arriving) and the queries'."""
    if c.cp == 1:
        return 0.0, 0.0
    kv, q = 2 * shape.n_kv_heads * shape.head_dim / c.tp, shape.n_heads * shape.head_dim / c.tp
    if c.cp_style == "allgather":
        return kv * (c.cp - 1), 0.0
    if c.cp_style in RING_STYLES:  # hierarchical's ring: u× the tokens, 1/u the heads
        return 0.0, 2 * kv + (2 * kv + q) * 4 / compute_bytes
    return 0.0, 0.0


def cp_mask_bytes(c: Candidate, seq_len: int) -> float:
    """The boolean mask the all-gather and Ulysses styles build once per micro-batch (every layer's
    attention keeps it): local (all-gather) or all (Ulysses) queries × all keys, per sequence. The
    ring's block masks exist only for chunk pairs a document boundary cuts: left out."""
    if c.cp == 1 or c.cp_style in RING_STYLES:
        return 0.0
    return c.micro_batch_size * (seq_len / c.cp if c.cp_style == "allgather" else seq_len) * seq_len
