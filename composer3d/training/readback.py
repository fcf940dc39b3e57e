"""Reading a logging window's metrics back from the device: the steps' losses (and a DPO run's
metric sums) summed over the mesh in one collective, then read back with the gradient norms and peak
memory in one host sync, as metrics.jsonl records."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from composer3d.parallel.mesh import ParallelMesh
from composer3d.training.expert_load import ExpertLoad
from composer3d.training.metrics import Throughput, peak_memory_bytes
from composer3d.training.preference import METRICS


def window_records(
    pending: list[tuple[int, dict]],
    window_start: float,
    mesh: ParallelMesh,
    device: torch.device,
    pipelined: bool,
    expert_load: ExpertLoad | None,
    throughput: Throughput,
) -> list[dict]:
    """The logging window's records: the steps' losses summed over the mesh in one collective, then
    read back with the gradient norms and peak memory in one host sync; times are the window's
    average."""
    # the preference metrics' sums (train.objective=dpo) ride in the losses' collective
    preference = [metrics["preference"] for _, metrics in pending if "preference" in metrics]
    losses = torch.cat([torch.stack([metrics["loss"] for _, metrics in pending]), *preference])
    dist.all_reduce(losses, group=mesh.loss.get_group())
    if pipelined:  # only the last stage's ranks hold it; the others add zero
        dist.all_reduce(losses, group=mesh["pp"].get_group())
    losses, preference_sums = losses[: len(pending)], losses[len(pending) :]
    peaks = peak_memory_bytes(device)
    peak = torch.tensor(list(peaks.values()), dtype=torch.float64, device=device)
    # optim.muon_clip_threshold: each step's largest attention logit (a pipeline stage's own
    # layers), in the same maximum
    logits = [
        metrics["attention_logit_max"] for _, metrics in pending if "attention_logit_max" in metrics
    ]
    maxima = torch.cat([peak, torch.stack(logits).double()]) if logits else peak
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    # on the host where the gradients are (parallel.offload=cpu): brought over for the one read-back
    norms = torch.stack([metrics["grad_norm"].float() for _, metrics in pending]).to(device)
    values = torch.cat([losses.double(), norms.double(), maxima, preference_sums.double()]).tolist()
    peaks = dict(zip(peaks, map(int, values[2 * len(pending) : 2 * len(pending) + len(peaks)])))
    logit_max = iter(values[2 * len(pending) + len(peaks) : 2 * len(pending) + len(maxima)])
    sums = iter(values[2 * len(pending) + len(maxima) :])
    experts = expert_load.read(len(pending)) if expert_load is not None else {}
    step_time = (time.perf_counter() - window_start) / len(pending)
    records = []
    for i, (step, metrics) in enumerate(pending):
        tokens_per_s = metrics["tokens"] / step_time
        records.append(
            {
                "step": step,
                "loss": _finite_or_none(values[i]),
                "grad_norm": _finite_or_none(values[len(pending) + i]),
                "lr": metrics["lr"],
                "tokens_per_s": tokens_per_s,
                "step_time_s": step_time,
                **peaks,
                **throughput.of(tokens_per_s),
                **experts,
                **{
                    k: metrics[k]
                    for k in ("loss_scale", "skipped_steps", "nonfinite_skipped_steps")
                    if k in metrics
                },
                **({"update_skipped": True} if metrics["update_skipped"] else {}),
                **(
                    {"attention_logit_max": next(logit_max)}
                    if "attention_logit_max" in metrics
                    else {}
                ),
                # per pair of the global batch (its target count), as TRL averages them
                **(
                    {k: next(sums) / metrics["target_tokens"] for k in METRICS}
                    if "preference" in metrics
                    else {}
                ),
            }
        )
    return records


def _finite_or_none(value: float) -> float | None:
    """metrics.jsonl is strict JSON, which has no NaN or infinity: such values are written as
    null."""
    return value if math.isfinite(value) else None
