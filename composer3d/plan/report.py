"""What composer3d-plan prints: one layout in detail, or the ranked layouts as a table; JSON lines
for machines."""

from __future__ import annotations

import json

from composer3d.plan.comm import members_on_node
from composer3d.plan.estimate import Estimate
from composer3d.plan.fits import Fit
from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import ZERO_BUBBLE
from composer3d.plan.rates import Rates
from composer3d.plan.search import why_slower


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def _rate(e: Estimate) -> str:
    mfu = f", MFU {e.mfu:.1%}" if e.mfu is not None else ""
    return (
        f"{e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {e.tflops_per_gpu:.1f} TFLOP/s per "
        f"GPU{mfu}"
    )


def detail(e: Estimate, cluster: Cluster) -> str:
    c = e.candidate
    lines = [
        f"layout: {c.short()}   ({' '.join(c.overrides())})",
        (
            f"cluster: {cluster.nodes} node(s) × {cluster.gpus_per_node} {cluster.device}, "
            f"{_gib(cluster.memory_bytes)} per device"
        ),
        "memory per GPU (the pipeline rank with the most):",
    ]
    for part, value in e.memory.as_dict().items():
        if part != "total" and (value or not (part.startswith("host_") or part == "disk")):
            lines.append(f"  {part:<16}{_gib(value):>14}")
    peak_note = "" if e.memory.grads_at_peak else " (gradients not at the peak: one micro-batch)"
    lines.append(
        f"  {'total':<16}{_gib(e.memory.total):>14}  "
        f"{'fits' if e.fits else 'DOES NOT FIT'}{peak_note}"
    )
    lines.append("bytes moved per step (the busiest pipeline rank), by dimension and link:")
    for col in e.collectives:
        link = (
            "intra-node"
            if members_on_node(c, col.dim, col.group_size, cluster) == col.group_size
            else "inter-node"
        )
        lines.append(
            f"  {col.dim:<13}{col.kind:<15} group {col.group_size:<5}{_gib(col.bytes):>14}  "
            f"{link}{'' if col.overlapped else ', on the critical path'}"
        )
    if c.pp > 1:
        ideal = (
            " (the zero-bubble ideal; torch's schedule measured up to 2.6× it: optimistic)"
            if c.pp_schedule in ZERO_BUBBLE
            else ""
        )
        lines.append(
            f"pipeline: {c.pp_schedule}, v={c.stages_per_rank}, M={c.microbatches}: bubble "
            f"{e.bubble_fraction:.1%} of the step{ideal}"
        )
    exposed = ", ".join(f"{d} {t * 1e3:.1f} ms" for d, t in e.exposed_comm_s.items()) or "none"
    lines.append(
        f"step: {e.step_time_s * 1e3:.1f} ms = compute {e.compute_s * 1e3:.1f} ms + bubble "
        f"{e.bubble_s * 1e3:.1f} ms + exposed communication ({exposed})"
    )
    lines.append(_rate(e))
    return "\n".join([*lines, *(f"note: {note}" for note in e.notes)])


def table(ranked: list[Estimate], tried: int, top: int, cluster: Cluster) -> str:
    first = ranked[0]
    head = (
        f"{len(ranked)} of {tried} valid layouts fit on {cluster.nodes} × {cluster.gpus_per_node} "
        f"{cluster.device}; the {min(top, len(ranked))} fastest:"
    )
    rows = [
        (
            f"{'#':>3}  {'layout':<58}{'mem/GPU':>12}{'step':>10}{'tok/s/GPU':>12}{'TFLOP/s':>9}"
            f"{'MFU':>7}{'bubble':>8}  why slower than #1"
        )
    ]
    for i, e in enumerate(ranked[:top], 1):
        mfu = f"{e.mfu:.1%}" if e.mfu is not None else "-"
        rows.append(
            f"{i:>3}  "
            f"{e.candidate.short():<58}{_gib(e.memory.total):>12}{e.step_time_s * 1e3:>8.0f}ms"
            f"{e.tokens_per_s_per_gpu:>12,.0f}{e.tflops_per_gpu:>9.1f}{mfu:>7}"
            f"{e.bubble_fraction:>8.1%}  {why_slower(e, first)}"
        )
    notes = dict.fromkeys(note for e in ranked[:top] for note in e.notes)
    return "\n".join(
        [
            head,
            *rows,
            f"#1: {' '.join(first.candidate.overrides())}",
            *(f"note: {n}" for n in notes),
        ]
    )


def json_lines(estimates: list[Estimate]) -> str:
    return "\n".join(json.dumps(e.as_json()) for e in estimates)


def what_fits(
    sequences: list[Fit],
    models: list[Fit],
    cluster: Cluster,
    layout: str,
    seq_len: int,
    width: int,
    max_seq_len: int,
    notes: list[str],
) -> str:
    """``plan.what_fits``: the longest sequence per option set, then the largest model per offload
    and checkpointing, each with its memory (device, host) and speed; what the first row of each
    needs, as overrides; ``notes`` (what it assumed beyond the config)."""
    where = (
        f"{cluster.nodes} × {cluster.gpus_per_node} {cluster.device} ({_gib(cluster.memory_bytes)} "
        "each"
        f"{f', host {_gib(cluster.host_memory_bytes)} a node' if cluster.host_memory_bytes else ''}"
        f"), {layout}"
    )
    head = f"  {'options':<52}{{:>14}}{'device':>12}{'host/GPU':>12}{'tok/s/GPU':>11}"
    lines = [f"longest sequence on {where}, per memory option set:", head.format("tokens")]
    lines += [_fits_row(f, f"{f.amount:,}") for f in sequences]
    lines += [
        f"largest model at dim {width} and sequence {seq_len:,}, per offload and checkpointing:",
        head.format("layers"),
    ]
    lines += [_fits_row(f, f"{f.amount} ({f.params / 1e9:.1f}B)") for f in models]
    if sequences and sequences[0].estimate:
        seq = sequences[0].amount
        # RoPE's tables must reach it
        longer = [f"model.max_seq_len={seq}"] if seq > max_seq_len else []
        lines.append(
            "longest sequence takes: "
            + " ".join(
                [*sequences[0].estimate.candidate.overrides(), f"train.seq_len={seq}", *longer]
            )
        )
    if models and models[0].estimate:
        lines.append(
            "largest model takes: "
            + " ".join(
                [*models[0].estimate.candidate.overrides(), f"model.n_layers={models[0].amount}"]
            )
        )
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _fits_row(f: Fit, amount: str) -> str:
    if f.estimate is None:
        return f"  {f.options.label():<52}{'nothing fits':>14}"
    m = f.estimate.memory
    return (
        f"  {f.options.label():<52}{amount:>14}{_gib(m.total):>12}"
        f"{_gib(m.host + m.host_activations):>12}{f.estimate.tokens_per_s_per_gpu:>11,.0f}"
    )


def measured(result: dict) -> str:
    """plan.measure's rank beside the prediction for it."""
    m, p, r = result["measured"], result["predicted"], result["ratio"]
    return "\n".join(
        [
            f"layout: {result['layout']}; rank {m['rank']} of {m['world_size']} (pp rank "
            f"{m['pp_rank']}) run on {m['device']} with a fake process group (collectives free)",
            f"  {'':<18}{'measured':>14}{'predicted':>14}{'ratio':>8}",
            f"  {'peak memory':<18}{_gib(m['peak_bytes']):>14}{_gib(p['peak_bytes']):>14}"
            f"{r['peak_bytes']:>8.2f}",
            f"  {'model state':<18}{_gib(m['model_state_bytes']):>14}"
            f"{_gib(p['model_state_bytes']):>14}{r['model_state_bytes']:>8.2f}",
            f"  {'step compute':<18}{m['median_step_s'] * 1e3:>11.1f} "
            f"ms{p['compute_s'] * 1e3:>11.1f} ms{r['compute_s']:>8.2f}   (predicted for "
            f"{p['device']}; comparable where that is this device)",
            *([f"note: {p['calibration']}"] if p["calibration"] else []),
        ]
    )


def calibrated(rates: Rates, path: str) -> str:
    """plan.calibrate's measurements, as written to ``path``."""
    lines = [
        f"{rates.layout} timed on {rates.device_name} (cluster.device={rates.device}, "
        f"{rates.dtype}, torch {rates.torch}); written to {path} for plan.calibration",
        f"  {'GEMM':<24}{'m × n × k':>28}{'ms (fwd+bwd)':>14}{'TFLOP/s':>10}",
    ]
    lines += [
        f"  {', '.join(g.names):<24}{f'{g.m} × {g.n} × {g.k}':>28}{g.seconds * 1e3:>14.3f}"
        f"{g.flops_per_s / 1e12:>10.4g}"
        for g in rates.gemms
    ]
    lines.append(f"  {'attention':<24}{'tokens':>28}{'ms (fwd+bwd)':>14}{'TFLOP/s':>10}")
    lines += [
        f"  {a.kernel:<24}{a.seq_len:>28,}{a.seconds * 1e3:>14.3f}{a.flops_per_s / 1e12:>10.4g}"
        for a in rates.attention
    ]
    o, c = rates.optimizer, rates.copy
    lines += [
        f"  optimizer step ({o.implementation} AdamW, the norm and clip): {o.params:,} parameters "
        f"in {o.seconds * 1e3:.3f} ms, {o.seconds_per_param * 1e9:.3g} ns a parameter",
        f"  memory: a copy moving {_gib(c.bytes)} in {c.seconds * 1e3:.3f} ms, "
        f"{c.bytes_per_s / 1e9:.4g} GB/s",
    ]
    return "\n".join(lines)
