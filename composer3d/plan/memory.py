"""Memory per GPU, by part, for one pipeline rank of a layout.

Model state (the ZeRO paper's 16 bytes per parameter for mixed-precision Adam — here 4 fp32 master
weights + 4 fp32 gradients + 8 fp32 Adam moments, which composer3d keeps in every precision):
divided by tp (each rank holds its split) and by pp (its stages' layers), then per ZeRO stage: 3 and
2 shard all of it over dp_shard × cp (FSDP2; each parameter's first dim rounded up per rank), 1
shards only the optimizer state over dp × cp (slices of each flattened parameter), replicas (DDP,
dp_replicate) hold it whole. Offload moves it to host memory. Routed experts are divided by ep and
sharded (FSDP, or ZeRO-1's state) over what ep leaves of those ranks.

Activations: a block's saved tensors per token (``plan.activations``), times the tokens and layers
in flight. Activation offload keeps on the device the saved tensors of two blocks (the one in
backward and the one prefetched; memory/activation_offload.py), the others in host memory. Logits:
the head's output and its gradient in the compute dtype, plus the loss's fp32 chunks (loss.py);
under ``memory.tile_loss`` one tile's, recomputed in backward.

The DPO reference model (train.objective=dpo; training/preference.py): ``preference.reference=copy``
is a frozen copy of the initial policy, its parameters stored and sharded as the policy's, with no
gradients and no optimizer state. FSDP reshards what it gathered in backward, which the copy never
runs, and after forward only blocks (ZeRO-3): the copy's root (embedding, norm, head) stays gathered
from its first forward on, under ZeRO-2 its blocks too, under DDP (FSDP2's replicate) all of it. Its
no-grad forward's transients (a block's working set, its logits) are freed before the policy's
forward, below whose peak they stay (its log-probabilities, 4 bytes a token, are left out).
``adapters_off`` (the policy with LoRA's adapters off) and SimPO (no reference) add nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from composer3d.parallel.data_parallel.fsdp import reshard_blocks_after_forward
from composer3d.peft.planning import BLOCK_MODULES, Peft, Split, nf4_bytes, split_block, split_root
from composer3d.plan.activations import cp_attention, cp_mask_bytes, layer_activations
from composer3d.plan.bubble import microbatches_in_flight
from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate
from composer3d.plan.shapes import ModelShape, StageSet, Unit

OPTIMIZER_STATE_BYTES = {
    "adamw": 8,
    "adamw_8bit": 2,
    "adamw_4bit": 1,
    "adamw_fp8": 2,
    "muon": 8,  # AdamW's moments, for what Muon leaves to it; Muon's own: MUON_STATE_BYTES
}  # per parameter
# optim.name=muon: one fp32 momentum buffer per parameter Muon steps (``muon_numel``)
MUON_STATE_BYTES = 4
LOSS_CHUNK_ELEMENTS = 2**25  # composer3d.training.loss.CHUNK_ELEMENTS


@dataclass(frozen=True)
class Memory:
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    # FSDP's gathered parameters; replicas' gradient all-reduce buffer and low-precision copies
    comm_buffers: float
    host: float  # offloaded model state (in host memory, not the GPU's)
    grads_at_peak: bool = True
    # activation offload: the saved tensors of the blocks not on the device
    host_activations: float = 0.0
    disk: float = 0.0  # offload=optimizer with offload_dir: the masters and moments in files

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.host + self.disk

    @property
    def total(self) -> float:
        grads = self.gradients if self.grads_at_peak else 0.0
        return (
            self.parameters
            + grads
            + self.optimizer
            + self.activations
            + self.logits
            + self.comm_buffers
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "comm_buffers": self.comm_buffers,
            "total": self.total,
            "host_offloaded": self.host,
            "host_activations": self.host_activations,
            "disk": self.disk,
        }


def fsdp_shards(c: Candidate) -> bool:
    """FSDP shards parameters (ZeRO-2/3 over dp_shard × cp > 1); otherwise they are whole (replicas,
    ZeRO-1, no dp)."""
    return c.dp_shard * c.cp > 1 and c.zero_stage in (2, 3)


def shard_degree(c: Candidate, unit: Unit) -> int:
    """Ranks FSDP shards ``unit`` over: dp_shard × cp, or for routed experts what ep leaves of it
    (ep takes every cp rank first: parallel/mesh.py)."""
    return c.dp_shard * c.cp // c.ep if unit.kind == "experts" else c.dp_shard * c.cp


def zero1_degree(c: Candidate, unit: Unit) -> int:
    """Ranks ZeRO-1 shards ``unit``'s optimizer state and gradients over: every data-parallel rank
    (dp × cp), or for routed experts the ranks holding the same ones (what ep leaves of them;
    parallel/data_parallel/zero.py)."""
    return c.dp * c.cp // c.ep if unit.kind == "experts" else c.dp * c.cp


def shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of the largest rank's FSDP shard (dim 0 cut in n, rounded up)."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


@cache  # the search prices the same units at the same degrees over and over
def sharded_numel(unit: Unit, n: int) -> int:
    """Elements of the largest rank's FSDP shards of one copy of ``unit``, over ``n`` ranks."""
    return sum(shard_numel(s, n) for s in unit.params)


def whole(units: list[Unit]) -> float:
    """Elements of a rank's parameters before FSDP (split by tp, pp and ep only)."""
    return sum(u.count * u.numel for u in units)


def muon_steps(unit: Unit, index: int, router: bool) -> bool:
    """Whether optim.name=muon's Muon steps ``unit``'s parameter ``index`` (optim/muon.py's
    ``muon_parameter``): two or more dims inside a block (attention and MLP matrices, shared and
    stacked routed experts, LoRA's adapters), the router only where ``router`` (by default
    optim.muon_adamw_params leaves it to AdamW); the root (embedding, head, final norm) and every
    1-D parameter (norms) are AdamW's."""
    return unit.kind != "root" and len(unit.params[index]) >= 2 and (router or index != unit.router)


@cache  # the search prices the same units at the same degrees over and over
def muon_numel(unit: Unit, n: int, router: bool) -> int:
    """Elements of one copy of ``unit`` that Muon steps, as the largest rank's FSDP shards over
    ``n`` ranks hold them (1: whole)."""
    return sum(shard_numel(s, n) for i, s in enumerate(unit.params) if muon_steps(unit, i, router))


def stepped(
    units: list[Unit], c: Candidate, peft: Peft | None = None, muon_router: bool = False
) -> tuple[float, float]:
    """(elements, of them Muon's) that this rank's optimizer steps: its FSDP shards, ZeRO-1's owned
    slices, or whole (replicas); the trainable ones under ``peft``."""
    trainable = units if peft is None else _peft_units(units, c, peft)[0]
    if fsdp_shards(c):
        return (
            sum(u.count * sharded_numel(u, shard_degree(c, u)) for u in trainable),
            sum(u.count * muon_numel(u, shard_degree(c, u), muon_router) for u in trainable),
        )
    if c.zero_stage == 1 and c.dp * c.cp > 1:
        return (
            sum(u.count * u.numel / zero1_degree(c, u) for u in trainable),
            sum(u.count * muon_numel(u, 1, muon_router) / zero1_degree(c, u) for u in trainable),
        )
    return whole(trainable), sum(u.count * muon_numel(u, 1, muon_router) for u in trainable)


def model_state(
    units: list[Unit],
    c: Candidate,
    optimizer: str,
    peft: Peft | None = None,
    compute_bytes: int = 4,
    muon_router: bool = False,
) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes on this rank: fp32 weights and gradients, Adam's
    state (and ZeRO-1's fp32 masters of its slices when its gather carries a narrower
    ``compute_bytes``). Under ``peft`` (peft/planning.py) only the adapters and modules_to_save have
    gradients and state; the frozen weights are their bytes, QLoRA's NF4 ones theirs. Under
    optim.name=muon the parameters Muon steps (``muon_steps``; the router too where
    ``muon_router``) keep one fp32 momentum (4 bytes) where AdamW keeps two moments (8)."""
    opt = OPTIMIZER_STATE_BYTES[optimizer]
    trainable, frozen = (units, 0.0) if peft is None else _peft_units(units, c, peft)
    # what Muon's parameters keep less than AdamW's 8 bytes (its 4), on this rank
    saved = (
        (opt - MUON_STATE_BYTES) * stepped(trainable, c, None, muon_router)[1]
        if optimizer == "muon"
        else 0
    )
    if fsdp_shards(c):
        local = sum(u.count * sharded_numel(u, shard_degree(c, u)) for u in trainable)
        return frozen + 4 * local, 4 * local, opt * local - saved
    n = whole(trainable)
    # gradients: the whole buckets, and the reduced slices this rank owns
    if c.zero_stage == 1 and c.dp * c.cp > 1:
        owned = sum(u.count * u.numel / zero1_degree(c, u) for u in trainable)
        # a bucket reduced over no other rank is its own reduced slice (the experts under ep =
        # dp_shard × cp)
        slices = sum(
            u.count * u.numel / zero1_degree(c, u) for u in trainable if zero1_degree(c, u) > 1
        )
        masters = 4 * owned if compute_bytes < 4 else 0.0
        return frozen + 4 * n, 4 * n + 4 * slices, opt * owned + masters - saved
    return frozen + 4 * n, 4 * n, opt * n - saved


def _peft_units(units: list[Unit], c: Candidate, peft: Peft) -> tuple[list[Unit], float]:
    """The trainable parameters of ``units`` as units of their own, and the bytes of the frozen ones
    on this rank (FSDP's shard of each, an NF4 shard being an NF4 tensor of its own)."""
    trainable, frozen = [], 0.0
    for u in units:
        if u.kind == "block" and len(u.params) == len(BLOCK_MODULES):
            split = split_block(list(u.params), peft, c.tp)
        elif u.kind == "root":
            split = split_root(list(u.params), list(u.names), peft)
        # a MoE block's or routed experts' parameters: peft leaves experts and routers frozen
        # (checks)
        else:
            split = Split([], list(u.params), [])
        n = shard_degree(c, u) if fsdp_shards(c) else 1
        frozen += u.count * (
            sum(4 * shard_numel(s, n) for s in split.frozen)
            + sum(nf4_bytes((math.ceil(s[0] / n), *s[1:])) for s in split.nf4)
        )
        if split.trainable:
            trainable.append(Unit(tuple(split.trainable), u.count, u.kind))
    return trainable, frozen


def logits_bytes(
    shape: ModelShape, c: Candidate, seq_len: int, compute_bytes: int, in_flight: float = 1.0
) -> float:
    """The head's output (kept for backward by the loss, for every micro-batch in flight: GPipe runs
    every loss before the first backward; backward writes their gradient over them), and beside them
    the larger of the loss's one fp32 temporary of a chunk (its exponentials) and the head's weight
    gradient in the compute dtype, which the head's backward makes while their gradient still exists
    (an H200's allocator trace, 1B: its peak). Under ``tile_loss`` (no pipeline) one tile's logits,
    recomputed in backward, are all there is."""
    vocab = math.ceil(shape.vocab / c.tp)
    elements = c.micro_batch_size * seq_len * vocab
    if c.tile_loss > 1:
        elements, in_flight = elements / c.tile_loss, 1.0
    beside = max(min(elements, LOSS_CHUNK_ELEMENTS) * 4, vocab * shape.dim * compute_bytes)
    return elements * in_flight * compute_bytes + beside


def _autocast_casts(
    trained: list[Unit], c: Candidate, compute_bytes: int, compiled: bool
) -> tuple[float, float]:
    """Autocast's low-precision copies of the trained weights (an embedding lookup casts none), as
    (kept through backward, more at the end of forward). Their matmuls save them for backward; a
    checkpointed block's are cast again in its recomputation, then one at a time. Eager, autocast's
    cache holds every cast until the forward's autocast region ends (an H200, 1B, selective: 28.5
    GiB, where one block's casts predicted 26.6); compiled blocks cast inside their graphs, which
    keep only what backward needs. The head keeps none either: it casts its weight again in backward
    (``parallel.autocast.cast_head_in_backward``), except a tensor-parallel head."""
    uncast = ("embedding", "head") if c.tp == 1 else ("embedding",)
    uncast_numel = sum(
        math.prod(s)
        for u in trained
        if u.kind == "root"
        for s, name in zip(u.params, u.names)
        if name in uncast
    )
    recast = whole([u for u in trained if u.kind != "root"]) * _recomputed_blocks(c)
    one_block = max(u.numel for u in trained if u.kind != "root") if recast else 0.0
    kept = (whole(trained) - uncast_numel - recast + one_block) * compute_bytes
    return kept, (0.0 if compiled else (recast - one_block) * compute_bytes)


def _recomputed_blocks(c: Candidate) -> float:
    """The share of the blocks whose forward checkpointing reruns in backward."""
    if c.activation_checkpointing == "full" or (
        c.activation_checkpointing == "selective" and not c.ac_every
    ):
        return 1.0
    return 1 / c.ac_every if c.activation_checkpointing == "selective" else 0.0


def memory(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    seq_len: int,
    cluster: Cluster,
    optimizer: str = "adamw",
    peft: Peft | None = None,
    casts_once: bool = False,
    compiled: bool = False,
    reference: str | None = None,
    muon_router: bool = False,
) -> Memory:
    """One pipeline rank's peak device memory (and host and disk bytes). ``casts_once``: one device
    with precision.cast=params (``parallel.cast_once``; ``parallel.autocast.auto_cast``); else,
    without a data-parallel dim that shards, autocast. ``reference``: train.objective=dpo's
    reference model (preference.reference), None where none runs. ``muon_router``: under
    optim.name=muon, Muon steps the MoE router (``model_state``)."""
    units = stages.units(shape, c.tp, c.ep)
    params, grads, opt = model_state(units, c, optimizer, peft, cluster.compute_bytes, muon_router)
    # the frozen copy's parameters: the policy's, as stored and sharded
    copy = params if reference == "copy" else 0.0
    host = 0.0
    if c.offload == "cpu":  # FSDP's CPU offload keeps the copy's shards there too
        host, params, grads, opt = params + copy + grads + opt, 0.0, 0.0, 0.0
        copy = 0.0
    # the host keeps fp32 masters, moments and a gradient buffer (or files do)
    elif c.offload == "optimizer":
        host, opt = params + grads + opt, 0.0
    disk = 0.0
    # masters and moments in files; the gradient buffer stays
    if c.offload == "optimizer" and c.offload_dir:
        disk, host = host - grads, grads
    params += copy
    cb = cluster.compute_bytes
    held = seq_len // c.cp  # this rank's tokens of each sequence
    tokens = c.micro_batch_size * held
    cp_saved, cp_transient = cp_attention(shape, c, cb)
    fsdp_casts = fsdp_shards(c) or c.offload == "cpu"  # FSDP runs on one rank too under offload=cpu
    # fp32 residual stream, low-precision matmuls
    autocast = cb != 4 and not casts_once and not fsdp_casts
    dense = layer_activations(shape, c, False, cb, cp_saved, cp_transient, compiled, autocast)
    moe = (
        layer_activations(shape, c, True, cb, cp_saved, cp_transient, compiled, autocast)
        if stages.moe_layers
        else None
    )
    in_flight = microbatches_in_flight(c, stages.rank)
    logits = logits_bytes(shape, c, held, cb, in_flight) if stages.last else 0.0
    # The peak is the end of forward (every layer's saved tensors, the logits) or, under
    # checkpointing, a block's recomputation in backward (its whole activations, once the logits are
    # gone).
    saved = dense.saved * stages.dense_layers + (moe.saved * stages.moe_layers if moe else 0.0)
    acts = saved * tokens * in_flight * cb + cp_mask_bytes(c, seq_len) * in_flight
    host_acts = 0.0
    # on the device: the block being computed and the one prefetched; the rest on the host
    if c.activation_offload:
        per_block = sorted(
            [dense.saved] * stages.dense_layers + ([moe.saved] * stages.moe_layers if moe else [])
        )
        on_device = sum(per_block[-2:]) * tokens * cb
        acts, host_acts = on_device, acts - on_device
    recompute = max(layer.transient for layer in (dense, moe) if layer) * tokens * cb
    # what trains: a frozen weight has no gradient to all-reduce, and autocast keeps no cast of it
    # (it caches those of leaves that require a gradient; NF4 weights are dequantized op by op)
    trained = units if peft is None else _peft_units(units, c, peft)[0]
    casts, forward_casts = _autocast_casts(trained, c, cb, compiled) if autocast else (0.0, 0.0)
    in_backward = recompute > logits + forward_casts
    if in_backward:
        acts, logits = acts + recompute, 0.0
    # Gradients exist during forward only from the second micro-batch on: a single micro-batch's
    # backward frees activations about as fast as it creates gradients, so they do not add to its
    # peak — except where they are whole (replicas): FSDP's all-reduce copies them into a buffer of
    # their size. ZeRO-1's gradient buckets are allocated once for the whole run.
    grads_at_peak = c.microbatches > 1 or c.pp > 1 or (c.zero_stage == 1 and c.dp * c.cp > 1)
    buffers = 0.0
    layers = [u for u in units if u.kind != "root"]
    root = sum(u.numel for u in units if u.kind == "root") * cb
    # The most one layer gathers at once: a dense block, or a MoE block with its routed experts.
    kinds = ([shape.block_params(c.tp)] if stages.dense_layers else []) + (
        [shape.moe_block_params(c.tp) + shape.expert_params(c.tp, c.ep)]
        if stages.moe_layers
        else []
    )
    layer = max(sum(math.prod(s) for s in params) for params in kinds) * cb
    # every parameter's low-precision copy, kept through backward; a block's gradients in it
    if casts_once:
        buffers = whole(units) * cb + (layer if in_backward else 0.0)
    elif fsdp_casts:
        keeps_gathered = not reshard_blocks_after_forward(
            c.reshard_after_forward, c.zero_stage, c.pp
        )
        all_layers = sum(u.count * u.numel for u in layers) * cb
        buffers = root + (all_layers if keeps_gathered else 2 * layer)
        # what the copy's forward left gathered: its root, and its blocks where they stay
        if reference == "copy":
            buffers += root + (all_layers if keeps_gathered else 0.0)
        # the pipeline syncs gradients at its last micro-batch: until then they are whole
        if c.pp > 1:
            buffers += all_layers + root
        # a block's whole gradients and the reduce-scatter's copy of them, in reduce dtype
        elif in_backward:
            buffers += 2 * layer / cb * 4
    else:
        # replicas' all-reduce copies the whole gradients into a buffer
        if c.dp > 1 and c.zero_stage != 1:
            buffers += whole(trained) * 4
            # the copy's parameters in the compute dtype, as its forward left them (replicate)
            if reference == "copy":
                buffers += whole(units) * cb
        buffers += casts + (0.0 if in_backward else forward_casts)
    return Memory(params, grads, opt, acts, logits, buffers, host, grads_at_peak, host_acts, disk)
