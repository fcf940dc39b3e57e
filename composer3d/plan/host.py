"""The host side of the memory options: ZeRO-Offload's (``parallel.offload``) copies between device
and host memory and the host's optimizer step, and activation offload's copies, in seconds of a
step; and whether a node's host memory holds what they move there.

``optimizer``: the step copies the gradients to the host and the updated parameters back (4 bytes
each per fp32 parameter of the rank's shard) and runs AdamW there, after the backward and before the
next forward: all of it is exposed. ``cpu`` (FSDP's CPUOffloadPolicy): each all-gather first copies
the fp32 shard to the device (twice a step when parameters are resharded after forward: ZeRO-3
without PP) and each reduce-scatter's gradients go back; FSDP issues these beside its collectives,
so they hide behind compute like its traffic, but the host step does not. Activation offload
(``memory.activation_offload``) copies what it moves out in the forward and back in the backward, on
a side stream beside the blocks' compute. With ``parallel.offload_dir`` the host step reads and
writes its masters and moments from files (``cluster.disk_gbps``), a bound the page cache can only
shorten.
"""

from __future__ import annotations

from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate
from composer3d.plan.memory import Memory, model_state
from composer3d.plan.shapes import ModelShape, StageSet


def host_seconds(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    optimizer: str,
    cluster: Cluster,
    memory: Memory,
    reference_forward: bool = False,
) -> tuple[float, float]:
    """(exposed, overlapped with compute) seconds of a step that the memory options add on this
    pipeline rank; ``reference_forward``: train.objective=dpo's reference model runs a forward."""
    activations = 2 * memory.host_activations * c.microbatches / cluster.host_link_bw
    exposed, overlapped = _offload_seconds(shape, c, stages, optimizer, cluster, reference_forward)
    # the host step reads and writes back its files' every byte
    files = 2 * memory.disk / cluster.disk_bw
    return exposed + files, overlapped + activations


def host_fits(memories: list[Memory], cluster: Cluster, headroom: float) -> bool:
    """Whether a node's host memory holds what its devices put there (every rank of a node alike:
    the busiest)."""
    if not cluster.host_memory_bytes:
        return True
    per_device = max(m.host + m.host_activations for m in memories)
    return per_device * cluster.gpus_per_node <= cluster.host_memory_bytes * headroom


def _offload_seconds(
    shape: ModelShape,
    c: Candidate,
    stages: StageSet,
    optimizer: str,
    cluster: Cluster,
    reference_forward: bool = False,
) -> tuple[float, float]:
    if c.offload == "none":
        return 0.0, 0.0
    # fp32 shard, grads
    param_bytes, grad_bytes, _ = model_state(stages.units(shape, c.tp, c.ep), c, optimizer)
    host_step = param_bytes / cluster.host_optimizer_bw
    if c.offload == "optimizer":
        return (param_bytes + grad_bytes) / cluster.host_link_bw + host_step, 0.0
    # the DPO reference's forward copies the shards again where blocks reshard after forward
    gathers = (3 if reference_forward else 2) if c.zero_stage == 3 and c.pp == 1 else 1
    return host_step, (gathers * param_bytes + grad_bytes) / cluster.host_link_bw
