"""Memory per GPU, by part, for one pipeline rank of a layout.

Model state (the ZeRO paper's 16 bytes per parameter for mixed-precision Adam — here 4 fp32 master weights + 4
fp32 gradients + 8 fp32 Adam moments, which composer3d keeps in every precision): divided by tp (each rank holds
its split) and by pp (its stages' layers), then per ZeRO stage: 3 and 2 shard all of it over dp_shard (FSDP2; each
parameter's first dim rounded up per rank), 1 shards only the optimizer state over dp (slices of each flattened
parameter), replicas (DDP, dp_replicate) hold it whole. Offload moves it to host memory.

Activations follow Korthikanti et al. (2022) in form — saved tensors per token per layer, split by tp, the norm and
residual part also by SP, a block input only under full checkpointing — with the terms read from composer3d's own
block (models/llama.py) and verified by tests/test_plan.py's measurements: per token and layer the block keeps its
input, the two norm outputs and the attention residual (4·h), q's projection and rotation, attention's output and
o's input (4·q), k's rotation and v (2·kv), attention's log-sum-exp (heads) and the MLP's gate, up, SiLU and
product (4·f). Op-level selective checkpointing keeps only matmul and attention outputs (3·h + 2·q + 2·kv + heads +
2·f). Logits: the head's output and its gradient in the compute dtype, plus the loss's fp32 chunks (loss.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from composer3d.plan.bubble import microbatches_in_flight
from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate
from composer3d.plan.shapes import ModelShape, StageSet

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw_8bit": 2, "adamw_4bit": 1, "adamw_fp8": 2}  # per parameter
LOSS_CHUNK_ELEMENTS = 2**25  # composer3d.loss.CHUNK_ELEMENTS


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

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.host

    @property
    def total(self) -> float:
        grads = self.gradients if self.grads_at_peak else 0.0
        return self.parameters + grads + self.optimizer + self.activations + self.logits + self.comm_buffers

    def as_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits, "comm_buffers": self.comm_buffers,
                "total": self.total, "host_offloaded": self.host}


def root_params(shape: ModelShape, stages: StageSet, tp: int) -> list[tuple[int, ...]]:
    """Shapes of this pipeline rank's embedding, final norm and head, on one tensor-parallel rank."""
    return (shape.embedding_params(tp) if stages.first else []) + (shape.head_params(tp) if stages.last else [])


def fsdp_shards(c: Candidate) -> bool:
    """FSDP shards parameters (ZeRO-2/3 over dp_shard > 1); otherwise they are whole (replicas, ZeRO-1, no dp)."""
    return c.dp_shard > 1 and c.zero_stage in (2, 3)


def shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of the largest rank's FSDP shard (dim 0 cut in n, rounded up)."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def rank_sum(shape: ModelShape, stages: StageSet, tp: int, per_param) -> float:
    """``per_param(shape)`` summed over this rank's parameters: its blocks' (all alike) and its root modules'."""
    return (stages.n_layers * sum(per_param(s) for s in shape.block_params(tp))
            + sum(per_param(s) for s in root_params(shape, stages, tp)))


def model_state(shape: ModelShape, stages: StageSet, c: Candidate, optimizer: str) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes on this rank: fp32 weights and gradients, Adam's state."""
    opt = OPTIMIZER_STATE_BYTES[optimizer]
    if fsdp_shards(c):
        local = rank_sum(shape, stages, c.tp, lambda s: shard_numel(s, c.dp_shard))
        return 4 * local, 4 * local, opt * local
    whole = rank_sum(shape, stages, c.tp, math.prod)
    if c.zero_stage == 1 and c.dp > 1:
        return 4 * whole, 4 * whole, opt * rank_sum(shape, stages, c.tp, lambda s: math.ceil(math.prod(s) / c.dp))
    return 4 * whole, 4 * whole, opt * whole


def layer_activation_elements(shape: ModelShape, c: Candidate, seq_len: int) -> tuple[float, float]:
    """(saved, recomputed-transient) elements per token of one block, for the candidate's AC mode, TP and SP."""
    t = c.tp
    h, q, kv, f, heads = shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim, shape.ffn, shape.n_heads
    residual = 4 * h / t if c.sequence_parallel else 4 * h
    gathered = 2 * h if c.sequence_parallel else 0  # SP: attention's and MLP's all-gathered inputs, kept by the matmuls
    inner = (4 * q + 2 * kv + heads + 4 * f) / t
    full = residual + gathered + inner
    block_input = h / t if c.sequence_parallel else h
    backward_temporaries = 2 * f / t + h  # the MLP's two input gradients and the residual's, while a block runs backward
    if c.activation_checkpointing == "full":
        return block_input, full + backward_temporaries
    if c.activation_checkpointing == "selective" and c.ac_every == 0:
        saved = block_input + 2 * h + (2 * q + 2 * kv + heads + 2 * f) / t  # + wo, w2 outputs (residual width)
        return saved, full - saved + backward_temporaries
    if c.activation_checkpointing == "selective":  # every ac_every-th block fully checkpointed
        share = 1 / c.ac_every
        return share * block_input + (1 - share) * full, full + backward_temporaries
    return full, 0.0


def logits_bytes(shape: ModelShape, c: Candidate, seq_len: int, compute_bytes: int) -> float:
    """The head's output and its gradient (compute dtype) and the loss's fp32 chunk and its exponentials."""
    elements = c.micro_batch_size * seq_len * math.ceil(shape.vocab / c.tp)
    return elements * 2 * compute_bytes + min(elements, LOSS_CHUNK_ELEMENTS) * 4 * 2


def memory(shape: ModelShape, c: Candidate, stages: StageSet, seq_len: int, cluster: Cluster,
           optimizer: str = "adamw") -> Memory:
    params, grads, opt = model_state(shape, stages, c, optimizer)
    host = 0.0
    if c.offload == "cpu":
        host, params, grads, opt = params + grads + opt, 0.0, 0.0, 0.0
    cb = cluster.compute_bytes
    tokens = c.micro_batch_size * seq_len
    saved, transient = layer_activation_elements(shape, c, seq_len)
    in_flight = microbatches_in_flight(c, stages.rank)
    logits = logits_bytes(shape, c, seq_len, cb) if stages.last else 0.0
    # The peak is the end of forward (every layer's saved tensors, the logits) or, under checkpointing, a block's
    # recomputation in backward (its whole activations, once the logits are gone).
    acts = saved * tokens * stages.n_layers * in_flight * cb
    recompute = transient * tokens * cb
    in_backward = recompute > logits
    if in_backward:
        acts, logits = acts + recompute, 0.0
    # Gradients exist during forward only from the second micro-batch on: a single micro-batch's backward frees
    # activations about as fast as it creates gradients, so they do not add to its peak — except where they are
    # whole (replicas, ZeRO-1): FSDP's all-reduce copies them into a buffer of their size.
    grads_at_peak = c.microbatches > 1 or c.pp > 1
    buffers = 0.0
    block = sum(math.prod(s) for s in shape.block_params(c.tp)) * cb
    root = sum(math.prod(s) for s in root_params(shape, stages, c.tp)) * cb
    if fsdp_shards(c):
        keeps_gathered = c.zero_stage == 2 or c.pp > 1 or c.reshard_after_forward == "never"
        if c.reshard_after_forward == "always":
            keeps_gathered = False
        buffers = root + (stages.n_layers * block if keeps_gathered else 2 * block)
        if c.pp > 1:  # the pipeline syncs gradients at its last micro-batch: until then they are whole
            buffers += stages.n_layers * block + root
        elif in_backward:  # a block's whole gradients and the reduce-scatter's copy of them, in reduce dtype
            buffers += 2 * block / cb * 4
    else:
        whole = rank_sum(shape, stages, c.tp, math.prod)
        if c.dp > 1:  # replicas' all-reduce copies the whole gradients into a buffer of the reduce dtype
            buffers += whole * 4
        if cb != 4:
            buffers += whole * cb  # low-precision copies of whole weights (casts)
    return Memory(params, grads, opt, acts, logits, buffers, host, grads_at_peak)
