"""Every valid layout for a world size, predicted, those that fit kept, ranked by throughput; the
first validated by composer3d's own checks (config/checks/) before it is used."""

from __future__ import annotations

import bisect
import copy

from composer3d.config.checks import validate
from composer3d.config.schema import TrainConfig
from composer3d.errors import ConfigError
from composer3d.plan.estimate import Estimate, Workload, estimate, rank_memories
from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate, apply_to_config, enumerate_candidates


def ranked(cfg: TrainConfig, cluster: Cluster) -> tuple[list[Estimate], int]:
    """(layouts that fit, best first; how many valid layouts there were)."""
    candidates = enumerate_candidates(cfg, cluster.world_size, cluster.gpus_per_node)
    work = Workload.from_config(cfg)
    # memory first: the rest of a step is priced only for the layouts that fit (at 16 GPUs of a
    # mixture of experts, one in thirteen)
    priced = [(c, rank_memories(work, c, cluster)) for c in candidates]
    fitting = [estimate(work, c, cluster, p) for c, p in priced if p.fits]
    if not fitting:
        smallest = min((p.worst.total for _, p in priced), default=None)
        need = (
            f"; the smallest needs {smallest / 2**30:.1f} GiB per device"
            if smallest is not None
            else ""
        )
        raise ConfigError(
            f"cluster.nodes: no layout of {cluster.world_size} devices fits in "
            f"{cluster.memory_bytes * cfg.plan.memory_headroom / 2**30:.1f} GiB per device "
            f"({len(candidates)} valid layouts tried{need}). Add nodes, lower train.seq_len or "
            "train.global_batch_size, or use a larger cluster.device"
        )
    return _faster_then_smaller(fitting), len(candidates)


SAME_SPEED = 0.001  # throughputs this close are one to the planner: its terms are not that exact


def _faster_then_smaller(fitting: list[Estimate]) -> list[Estimate]:
    """Faster first; among layouts within SAME_SPEED of the fastest left, the one that needs less
    memory, then fewer parallel dimensions. At 131,072 tokens on 8 H100s the all-gather of K/V came
    out 0.07% faster than the ring at 70.5 GiB a GPU against 53.1: no reason to take a device to its
    limit."""
    fitting = sorted(fitting, key=lambda e: -e.tokens_per_s_per_gpu)
    slower = [-e.tokens_per_s_per_gpu for e in fitting]  # ascending, for bisect
    ordered, start = [], 0
    while start < len(fitting):
        floor = fitting[start].tokens_per_s_per_gpu * (1 - SAME_SPEED)
        # the tied ones are a prefix of what is left (fastest first): found by bisection, as a
        # scan of the rest for each would be quadratic in the tens of thousands of layouts
        end = bisect.bisect_right(slower, -floor, lo=start)
        tied = fitting[start:end]
        start = end
        ordered += sorted(tied, key=lambda e: (e.memory.total, e.candidate.pp, e.candidate.tp))
    return ordered


def checked(cfg: TrainConfig, c: Candidate, world_size: int):
    """A copy of ``cfg`` with ``c`` applied, through composer3d's validation (what training would
    refuse)."""
    trial = copy.deepcopy(cfg)
    apply_to_config(trial, c)
    trial.parallel.auto = False
    validate(trial, world_size)
    return trial


def best(cfg: TrainConfig, cluster: Cluster) -> tuple[Estimate, list[Estimate], int]:
    """The fastest layout that fits and that composer3d's checks accept, the ranking, and the count
    tried."""
    fitting, tried = ranked(cfg, cluster)
    for e in fitting:
        try:
            checked(cfg, e.candidate, cluster.world_size)
        except ConfigError:
            # the arithmetic filter missed a rule: skip it rather than propose what training refuses
            continue
        return e, fitting, tried
    raise ConfigError(
        f"parallel.auto: none of the {len(fitting)} layouts that fit passes composer3d's checks. "
        "Give the layout by hand (parallel.* keys)"
    )


def why_slower(e: Estimate, first: Estimate) -> str:
    """The terms of ``e``'s step that cost the most more than the first's (what it loses on), in one
    phrase."""
    if e is first:
        return "fastest"
    terms = {
        "compute (recomputation, pipeline imbalance)": e.compute_s - first.compute_s,
        "pipeline bubble": e.bubble_s - first.bubble_s,
    }
    for dim in set(e.exposed_comm_s) | set(first.exposed_comm_s):
        terms[f"exposed {dim} communication"] = e.exposed_comm_s.get(
            dim, 0.0
        ) - first.exposed_comm_s.get(dim, 0.0)
    worse = sorted(((d, name) for name, d in terms.items() if d > 0), reverse=True)[:2]
    slower = e.step_time_s / first.step_time_s - 1
    if not worse or slower < 1e-4:
        return "as fast; more memory or more dimensions"
    return f"{slower:+.1%} step time: " + ", ".join(f"{name} +{_time(d)}" for d, name in worse)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
