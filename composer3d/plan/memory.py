"""Memory per GPU, by part, for one pipeline rank of a layout.

Model state (the ZeRO paper's 16 bytes per parameter for mixed-precision Adam — here 4 fp32 master weights + 4
fp32 gradients + 8 fp32 Adam moments, which composer3d keeps in every precision): divided by tp (each rank holds
its split) and by pp (its stages' layers), then per ZeRO stage: 3 and 2 shard all of it over dp_shard × cp (FSDP2; each
parameter's first dim rounded up per rank), 1 shards only the optimizer state over dp (slices of each flattened
parameter), replicas (DDP, dp_replicate) hold it whole. Offload moves it to host memory. Routed experts are
divided by ep and FSDP-sharded over dp_shard / ep.

Activations follow Korthikanti et al. (2022) in form — saved tensors per token per layer, split by tp, the norm and
residual part also by SP, a block input only under full checkpointing — with the terms read from composer3d's own
block (models/llama/) and verified by tests/test_plan.py's measurements: per token and layer the block keeps its
input, the two norm outputs and the attention residual (4·h), q's projection and rotation, attention's output and
o's input (4·q), k's rotation and v (2·kv), attention's log-sum-exp (heads) and the MLP's gate, up, SiLU and
product (4·f). Op-level selective checkpointing keeps only matmul and attention outputs (3·h + 2·q + 2·kv + heads +
2·f); torchtitan's ``alternate_matmuls`` every other linear's of them (``block_matmul_outputs``: 2·h + 2·q + kv +
heads + f); both keep the outputs of TP's reductions too (SP: the reduce-scattered 2·h/tp; without SP the
all-reduced 2·h), and under ``memory.ac_save_gathers`` SP's gathered 2·h (whole on every rank) and the all-gather
style's K/V, which they otherwise gather again in backward, as tests/test_plan.py measures. A MoE layer's
feed-forward part: ``_mlp_elements``. Logits: the head's output and its gradient in the compute dtype, plus the
loss's fp32 chunks (loss.py). Sequence tiling (``memory.tile_mlp``, ``memory.tile_loss``) leaves one tile's MLP
hidden and one tile's logits, recomputed in backward: those terms over the tile count. Op-level selective keeps
nothing computed inside a tile (parallel/activation.py): no MLP matmul outputs, no w2 output and none of the MLP's
collectives' (SP's gather and scatter, TP's all-reduce run inside the tile).
Activation offload keeps on the device the saved tensors of two blocks (the one in
backward and the one prefetched; parallel/activation_offload.py), the others in host memory.

Context parallel (plan/context.py): every term per token counts the seq_len / cp tokens a rank holds; on top,
``cp_attention`` adds what its style keeps: the all-gather's whole-sequence K/V (saved), the ring's K/V and gradient
buffers while a layer's attention runs backward, the all-gather's and Ulysses' mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from composer3d.parallel.fsdp import reshard_blocks_after_forward
from composer3d.plan.adapters import BLOCK_MODULES, Peft, Split, nf4_bytes, split_block, split_root
from composer3d.plan.bubble import microbatches_in_flight
from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate
from composer3d.plan.shapes import ModelShape, StageSet, Unit

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw_8bit": 2, "adamw_4bit": 1, "adamw_fp8": 2}  # per parameter
LOSS_CHUNK_ELEMENTS = 2**25  # composer3d.training.loss.CHUNK_ELEMENTS


@dataclass(frozen=True)
class Memory:
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    comm_buffers: float  # FSDP's gathered parameters; replicas' gradient all-reduce buffer and low-precision copies
    host: float  # offloaded model state (in host memory, not the GPU's)
    grads_at_peak: bool = True
    host_activations: float = 0.0  # activation offload: the saved tensors of the blocks not on the device
    disk: float = 0.0  # offload=optimizer with offload_dir: the masters and moments in files

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.host + self.disk

    @property
    def total(self) -> float:
        grads = self.gradients if self.grads_at_peak else 0.0
        return self.parameters + grads + self.optimizer + self.activations + self.logits + self.comm_buffers

    def as_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits, "comm_buffers": self.comm_buffers,
                "total": self.total, "host_offloaded": self.host, "host_activations": self.host_activations,
                "disk": self.disk}


def fsdp_shards(c: Candidate) -> bool:
    """FSDP shards parameters (ZeRO-2/3 over dp_shard × cp > 1); otherwise they are whole (replicas, ZeRO-1, no
    dp)."""
    return c.dp_shard * c.cp > 1 and c.zero_stage in (2, 3)


def shard_degree(c: Candidate, unit: Unit) -> int:
    """Ranks FSDP shards ``unit`` over: dp_shard × cp, or for routed experts what ep leaves of dp_shard."""
    return c.dp_shard // c.ep if unit.kind == "experts" else c.dp_shard * c.cp


def shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of the largest rank's FSDP shard (dim 0 cut in n, rounded up)."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def rank_sum(units: list[Unit], per_param) -> float:
    """``per_param(shape, unit)`` summed over a rank's parameters."""
    return sum(u.count * sum(per_param(s, u) for s in u.params) for u in units)


def whole(units: list[Unit]) -> float:
    """Elements of a rank's parameters before FSDP (split by tp, pp and ep only)."""
    return rank_sum(units, lambda s, u: math.prod(s))


def model_state(units: list[Unit], c: Candidate, optimizer: str, peft: Peft | None = None, compute_bytes: int = 4
                ) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes on this rank: fp32 weights and gradients, Adam's state (and
    ZeRO-1's fp32 masters of its slices when its gather carries a narrower ``compute_bytes``). Under ``peft``
    (plan/adapters.py) only the adapters and modules_to_save have gradients and state; the frozen weights are
    their bytes, QLoRA's NF4 ones theirs."""
    opt = OPTIMIZER_STATE_BYTES[optimizer]
    trainable, frozen = (units, 0.0) if peft is None else _peft_units(units, c, peft)
    if fsdp_shards(c):
        local = rank_sum(trainable, lambda s, u: shard_numel(s, shard_degree(c, u)))
        return frozen + 4 * local, 4 * local, opt * local
    n = whole(trainable)
    if c.zero_stage == 1 and c.dp > 1:  # gradients: the whole buckets, and the reduced slices this rank owns
        owned = n / c.dp
        masters = 4 * owned if compute_bytes < 4 else 0.0
        return frozen + 4 * n, 4 * n + 4 * owned, opt * owned + masters
    return frozen + 4 * n, 4 * n, opt * n


def _peft_units(units: list[Unit], c: Candidate, peft: Peft) -> tuple[list[Unit], float]:
    """The trainable parameters of ``units`` as units of their own, and the bytes of the frozen ones on this rank
    (FSDP's shard of each, an NF4 shard being an NF4 tensor of its own)."""
    trainable, frozen = [], 0.0
    for u in units:
        if u.kind == "block" and len(u.params) == len(BLOCK_MODULES):
            split = split_block(list(u.params), peft, c.tp)
        elif u.kind == "root":
            split = split_root(list(u.params), list(u.names), peft)
        else:  # a MoE block's or routed experts' parameters: peft leaves experts and routers frozen (checks)
            split = Split([], list(u.params), [])
        n = shard_degree(c, u) if fsdp_shards(c) else 1
        frozen += u.count * (sum(4 * shard_numel(s, n) for s in split.frozen)
                             + sum(nf4_bytes((math.ceil(s[0] / n), *s[1:])) for s in split.nf4))
        if split.trainable:
            trainable.append(Unit(tuple(split.trainable), u.count, u.kind))
    return trainable, frozen


@dataclass(frozen=True)
class LayerActivations:
    """Per token of one block, in elements of the compute dtype: what forward keeps for backward, and what is alive
    only while the block runs backward (its recomputation under checkpointing, the gradients it makes)."""
    saved: float
    transient: float


def _mlp_elements(shape: ModelShape, c: Candidate, moe: bool, compute_bytes: int) -> tuple[float, float, float]:
    """(kept without checkpointing, kept by op-level selective checkpointing, backward temporaries) of a block's
    feed-forward part, per token.

    Dense: gate, up, SiLU and product (4·f), of which the gate and up matmul outputs under selective. MoE
    (models/moe.py): the shared experts like a dense MLP; every routed copy of the token (top_k of them) keeps its
    row into the experts and the row out of them (2·k·h, whole on every TP rank) and the SwiGLU's four (4·k·f);
    the router keeps its fp32 scores (experts) and the int64 indices that sort and scatter the copies (3 per copy).
    Selective keeps the grouped matmuls' outputs (2·k·f + k·h), all-to-all's (2·k·h under ep) and the router's."""
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


def block_matmul_outputs(shape: ModelShape, c: Candidate, moe: bool, compute_bytes: int) -> list[float]:
    """A block's linear matmuls' outputs per token (elements of the compute dtype), in the order they run: what
    ``alternate_matmuls`` (parallel/activation.py) counts afresh in each block, keeping the 1st, 3rd, … and
    recomputing the others.

    Attention: wq wk wv wo. Dense: w1 w3 w2, so alternate_matmuls recomputes wk, wo and w3. MoE: the router's
    fp32 logits and the shared experts' w1 w3 w2 (the routed experts' grouped matmuls are not counted: always
    kept), so wk, wo, shared w1 and w2. Under ``tile_mlp`` attention's only: the policy neither keeps nor counts
    a sequence tile's matmuls (parallel/tiling.py), whose own checkpoint recomputes them."""
    t, h = c.tp, shape.dim
    q, kv = shape.n_heads * shape.head_dim / t, shape.n_kv_heads * shape.head_dim / t
    attention = [q, kv, kv, h]
    if not moe:
        return attention + ([] if c.tile_mlp > 1 else [shape.ffn / t, shape.ffn / t, h])
    shared = shape.moe.shared * shape.moe.hidden / t
    return attention + [shape.moe.experts * 4 / compute_bytes] + ([shared, shared, h] if shared else [])


def layer_activations(shape: ModelShape, c: Candidate, moe: bool, compute_bytes: int, cp_saved: float = 0.0,
                      cp_transient: float = 0.0) -> LayerActivations:
    """A block's activations per token, for the candidate's AC mode, TP, SP and MLP tiling; ``cp_saved`` and
    ``cp_transient``: what context parallel's attention adds (``cp_attention``)."""
    t = c.tp
    h, q, kv, heads = shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim, shape.n_heads
    mlp, mlp_selective, mlp_backward = _mlp_elements(shape, c, moe, compute_bytes)
    gathered = 2 * h if c.sequence_parallel else 0  # SP: attention's and MLP's all-gathered inputs, kept by the matmuls
    mlp_tile = 0.0
    tiled = c.tile_mlp > 1 and not moe
    if tiled:
        # parallel/tiling.py: the feed-forward keeps only its tiles' inputs (the norm's output, counted in the
        # residual part; SP gathers inside the tile); one tile's hidden and gradients exist at a time, in backward.
        mlp_tile = (mlp + mlp_backward) / c.tile_mlp
        mlp = mlp_selective = mlp_backward = 0.0
        gathered = h if c.sequence_parallel else 0
    residual = 4 * h / t if c.sequence_parallel else 4 * h
    full = residual + gathered + (4 * q + 2 * kv + heads) / t + mlp + cp_saved
    block_input = h / t if c.sequence_parallel else h
    # the MLP's input gradients and the residual's, while a block runs backward (a tile's under tiling)
    backward_temporaries = mlp_backward + h + mlp_tile + cp_transient
    if c.activation_checkpointing == "full":
        return LayerActivations(block_input, full + backward_temporaries)
    if c.activation_checkpointing == "selective" and c.ac_every == 0:
        # The policy keeps wo's and w2's outputs (residual width) and TP's reductions' too: SP's reduce-scattered
        # outputs, without SP the all-reduced ones (of attention and MLP each); the all-gathered inputs (SP's, cp's
        # K/V) only under ac_save_gathers, else recomputed with the rest of the block. Tiled, the MLP's (w2, its
        # gather and scatter or all-reduce) are inside the tiles, which it keeps nothing of.
        if not c.ac_save_gathers:
            gathered, cp_saved = 0.0, 0.0
        outputs = 1 if tiled else 2
        collectives = gathered + outputs * (h / t if c.sequence_parallel else h if t > 1 else 0)
        saved = block_input + outputs * h + (2 * q + 2 * kv + heads) / t + mlp_selective + collectives + cp_saved
        if c.ac_policy == "alternate_matmuls":
            saved -= sum(block_matmul_outputs(shape, c, moe, compute_bytes)[1::2])
        return LayerActivations(saved, full - saved + backward_temporaries)
    if c.activation_checkpointing == "selective":  # every ac_every-th block fully checkpointed
        share = 1 / c.ac_every
        return LayerActivations(share * block_input + (1 - share) * full, full + backward_temporaries)
    return LayerActivations(full, mlp_tile + cp_transient)


def cp_attention(shape: ModelShape, c: Candidate, compute_bytes: int) -> tuple[float, float]:
    """(saved, transient) elements per local token and layer that context parallel's style adds to the block's
    (plan/context.py): the all-gather saves the whole sequence's K/V; the ring holds, while a layer's attention
    runs backward, the K/V block and the one arriving, their fp32 gradients (held and arriving) and the queries'."""
    if c.cp == 1:
        return 0.0, 0.0
    kv, q = 2 * shape.n_kv_heads * shape.head_dim / c.tp, shape.n_heads * shape.head_dim / c.tp
    if c.cp_style == "allgather":
        return kv * (c.cp - 1), 0.0
    if c.cp_style == "ring":
        return 0.0, 2 * kv + (2 * kv + q) * 4 / compute_bytes
    return 0.0, 0.0


def cp_mask_bytes(c: Candidate, seq_len: int) -> float:
    """The boolean mask the all-gather and Ulysses styles build once per micro-batch (every layer's attention
    keeps it): local (all-gather) or all (Ulysses) queries × all keys, per sequence. The ring's block masks exist
    only for chunk pairs a document boundary cuts: left out."""
    if c.cp == 1 or c.cp_style == "ring":
        return 0.0
    return c.micro_batch_size * (seq_len / c.cp if c.cp_style == "allgather" else seq_len) * seq_len


def logits_bytes(shape: ModelShape, c: Candidate, seq_len: int, compute_bytes: int, in_flight: float = 1.0) -> float:
    """The head's output (kept for backward by the loss, for every micro-batch in flight: GPipe runs every loss
    before the first backward) and its gradient (compute dtype), and the loss's fp32 chunk and its exponentials.
    Under ``tile_loss`` (no pipeline) one tile's logits and gradient, recomputed in backward, are all there is."""
    elements = c.micro_batch_size * seq_len * math.ceil(shape.vocab / c.tp)
    if c.tile_loss > 1:
        elements, in_flight = elements / c.tile_loss, 1.0
    return elements * (in_flight + 1) * compute_bytes + min(elements, LOSS_CHUNK_ELEMENTS) * 4 * 2


def _recomputed_blocks(c: Candidate) -> float:
    """The share of the blocks whose forward checkpointing reruns in backward."""
    if c.activation_checkpointing == "full" or (c.activation_checkpointing == "selective" and not c.ac_every):
        return 1.0
    return 1 / c.ac_every if c.activation_checkpointing == "selective" else 0.0


def memory(shape: ModelShape, c: Candidate, stages: StageSet, seq_len: int, cluster: Cluster,
           optimizer: str = "adamw", peft: Peft | None = None, casts_once: bool = False) -> Memory:
    """One pipeline rank's peak device memory (and host and disk bytes). ``casts_once``: one device with
    precision.cast=params (``parallel.cast_once``; ``parallel.autocast.auto_cast``); else, without a data-parallel
    dim that shards, autocast."""
    units = stages.units(shape, c.tp, c.ep)
    params, grads, opt = model_state(units, c, optimizer, peft, cluster.compute_bytes)
    host = 0.0
    if c.offload == "cpu":
        host, params, grads, opt = params + grads + opt, 0.0, 0.0, 0.0
    elif c.offload == "optimizer":  # the host keeps fp32 masters, moments and a gradient buffer (or files do)
        host, opt = params + grads + opt, 0.0
    disk = 0.0
    if c.offload == "optimizer" and c.offload_dir:  # masters and moments in files; the gradient buffer stays
        disk, host = host - grads, grads
    cb = cluster.compute_bytes
    held = seq_len // c.cp  # this rank's tokens of each sequence
    tokens = c.micro_batch_size * held
    cp_saved, cp_transient = cp_attention(shape, c, cb)
    dense = layer_activations(shape, c, False, cb, cp_saved, cp_transient)
    moe = layer_activations(shape, c, True, cb, cp_saved, cp_transient) if stages.moe_layers else None
    in_flight = microbatches_in_flight(c, stages.rank)
    logits = logits_bytes(shape, c, held, cb, in_flight) if stages.last else 0.0
    # The peak is the end of forward (every layer's saved tensors, the logits) or, under checkpointing, a block's
    # recomputation in backward (its whole activations, once the logits are gone).
    saved = dense.saved * stages.dense_layers + (moe.saved * stages.moe_layers if moe else 0.0)
    acts = saved * tokens * in_flight * cb + cp_mask_bytes(c, seq_len) * in_flight
    host_acts = 0.0
    if c.activation_offload:  # on the device: the block being computed and the one prefetched; the rest on the host
        per_block = sorted([dense.saved] * stages.dense_layers + ([moe.saved] * stages.moe_layers if moe else []))
        on_device = sum(per_block[-2:]) * tokens * cb
        acts, host_acts = on_device, acts - on_device
    recompute = max(layer.transient for layer in (dense, moe) if layer) * tokens * cb
    in_backward = recompute > logits
    if in_backward:
        acts, logits = acts + recompute, 0.0
    # Gradients exist during forward only from the second micro-batch on: a single micro-batch's backward frees
    # activations about as fast as it creates gradients, so they do not add to its peak — except where they are
    # whole (replicas): FSDP's all-reduce copies them into a buffer of their size. ZeRO-1's gradient buckets are
    # allocated once for the whole run.
    grads_at_peak = c.microbatches > 1 or c.pp > 1 or (c.zero_stage == 1 and c.dp > 1)
    buffers = 0.0
    layers = [u for u in units if u.kind != "root"]
    root = sum(u.numel for u in units if u.kind == "root") * cb
    # The most one layer gathers at once: a dense block, or a MoE block with its routed experts.
    kinds = ([shape.block_params(c.tp)] if stages.dense_layers else []) + (
        [shape.moe_block_params(c.tp) + shape.expert_params(c.tp, c.ep)] if stages.moe_layers else [])
    layer = max(sum(math.prod(s) for s in params) for params in kinds) * cb
    if casts_once:  # every parameter's low-precision copy, kept through backward; a block's gradients in it
        buffers = whole(units) * cb + (layer if in_backward else 0.0)
    elif fsdp_shards(c) or c.offload == "cpu":  # FSDP runs on one rank too under offload=cpu
        keeps_gathered = not reshard_blocks_after_forward(c.reshard_after_forward, c.zero_stage, c.pp)
        all_layers = sum(u.count * u.numel for u in layers) * cb
        buffers = root + (all_layers if keeps_gathered else 2 * layer)
        if c.pp > 1:  # the pipeline syncs gradients at its last micro-batch: until then they are whole
            buffers += all_layers + root
        elif in_backward:  # a block's whole gradients and the reduce-scatter's copy of them, in reduce dtype
            buffers += 2 * layer / cb * 4
    else:
        # what trains: a frozen weight has no gradient to all-reduce, and autocast keeps no cast of it (it caches
        # those of leaves that require a gradient; NF4 weights are dequantized op by op)
        trained = units if peft is None else _peft_units(units, c, peft)[0]
        n = whole(trained)
        if c.dp > 1 and c.zero_stage != 1:  # replicas' all-reduce copies the whole gradients into a buffer
            buffers += n * 4
        if cb != 4:
            # low-precision copies of whole weights (casts), which their matmuls save for backward (an embedding
            # lookup casts none); a checkpointed block's are cast again in its recomputation: then one at a time
            tables = sum(math.prod(s) for u in trained if u.kind == "root"
                         for s, name in zip(u.params, u.names) if name == "embedding")
            recast = whole([u for u in trained if u.kind != "root"]) * _recomputed_blocks(c)
            one_block = max(u.numel for u in trained if u.kind != "root") if recast else 0.0
            buffers += (n - tables - recast + one_block) * cb
    return Memory(params, grads, opt, acts, logits, buffers, host, grads_at_peak, host_acts, disk)
