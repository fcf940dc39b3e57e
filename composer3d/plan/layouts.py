"""A candidate layout (every knob the planner weighs) and the enumeration of all valid ones for a
world size.

The knobs: degrees (pp, dp_replicate, dp_shard, cp and its style, tp; ep for mixture-of-experts
models), ZeRO stage, sequence parallel, pipeline schedule and stages per rank, micro-batch size
(hence micro-batches per step), activation checkpointing. The global batch and sequence length are
the run's (training hyperparameters, not layout). Validity follows config/checks/ (layout.py,
training.py for batches and activation checkpointing, preference.py for the schedules
train.objective=dpo runs under); the chosen layouts are run through ``validate`` itself before they
are used (``apply_to_config``). The optimizer's own check (config/checks/training.py) is asked of
each ZeRO stage and tp: a low-bit AdamW refuses ZeRO-1, optim.name=muon ZeRO-1 under TP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from itertools import product
from typing import Any

from composer3d.config.checks import _check_optimizer, pipeline_microbatches, resolve_degrees
from composer3d.config.checks.layout import check_context_parallel
from composer3d.config.checks.preference import runs_reference
from composer3d.config.schema import TrainConfig
from composer3d.errors import ConfigError
from composer3d.memory.activation_checkpointing import blocks_all_gather
from composer3d.models import MODEL_REGISTRY
from composer3d.parallel.context import STYLES as CP_STYLES
from composer3d.parallel.mesh import Layout
from composer3d.parallel.pipeline.schedules import (
    SCHEDULES,
    V_SHAPED,
    default_stages_per_rank,
    schedule_problem,
)

ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv", "dualpipev")
# the interleaved schedules' chunks a rank beyond their default two: each doubling halves the ramps
# and what the first rank holds in flight beyond P micro-batches, for v× the sends; the largest
# published runs interleave so (Megatron-Bridge's 405B at 8 chunks a rank, Llama 3's at 8). Looped
# BFS stays at two: it holds every micro-batch in flight, so it ranks under interleaved 1F1B anyway.
MORE_CHUNKS = {"interleaved_1f1b": (4, 8), "interleaved_zero_bubble": (4, 8)}


@dataclass(frozen=True)
class Candidate:
    layout: Layout  # the degrees; the properties below read them for the estimators' arithmetic
    zero_stage: int
    sequence_parallel: bool
    pp_schedule: str
    stages_per_rank: int
    micro_batch_size: int
    # per optimizer step on one data-parallel rank (gradient accumulation / pipeline)
    microbatches: int
    activation_checkpointing: str
    ac_every: int = 0
    ac_policy: str = "all_matmuls"  # memory.ac_policy: what op-level selective checkpointing saves
    # memory.ac_save_gathers: op-level selective keeps the all-gathers' outputs
    ac_save_gathers: bool = False
    offload: str = "none"
    # offload=optimizer's masters and moments in files (parallel.offload_dir)
    offload_dir: bool = False
    activation_offload: bool = False
    reshard_after_forward: str = "default"
    cp_style: str = "ring"  # parallel.cp_style, under cp > 1
    cp_ulysses: int = 0  # parallel.cp_ulysses: hierarchical's Ulysses degree
    # memory.tile_mlp / memory.tile_loss: the config's, carried into every candidate
    tile_mlp: int = 0
    tile_loss: int = 0

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.layout.dp_shard

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def keeps_gathers(self) -> bool:
        """memory.ac_save_gathers where it has an effect: op-level selective over blocks that
        all-gather (sequence parallel's inputs, cp_style=allgather's K/V)."""
        gathers = blocks_all_gather(self.tp, self.sequence_parallel, self.cp, self.cp_style)
        return (
            self.ac_save_gathers
            and self.activation_checkpointing == "selective"
            and self.ac_every == 0
            and gathers
        )

    def overrides(self) -> list[str]:
        """The command-line overrides that give this layout."""
        sp = str(self.sequence_parallel).lower()
        out = [
            f"parallel.pp={self.pp}",
            f"parallel.dp_replicate={self.dp_replicate}",
            f"parallel.dp_shard={self.dp_shard}",
            f"parallel.cp={self.cp}",
            f"parallel.tp={self.tp}",
            f"parallel.ep={self.ep}",
            f"parallel.zero_stage={self.zero_stage}",
            f"parallel.sequence_parallel={sp}",
            f"train.micro_batch_size={self.micro_batch_size}",
            f"memory.activation_checkpointing={self.activation_checkpointing}",
        ]
        if self.activation_checkpointing == "selective" and self.ac_policy != "all_matmuls":
            out.append(f"memory.ac_policy={self.ac_policy}")
        if self.keeps_gathers:
            out.append("memory.ac_save_gathers=true")
        if self.cp > 1:
            out.append(f"parallel.cp_style={self.cp_style}")
        if self.cp_ulysses:
            out.append(f"parallel.cp_ulysses={self.cp_ulysses}")
        out += [
            f"memory.{key}={tiles}"
            for key, tiles in (("tile_mlp", self.tile_mlp), ("tile_loss", self.tile_loss))
            if tiles > 1
        ]
        if self.activation_offload:
            out.append("memory.activation_offload=true")
        if self.offload != "none":
            out.append(f"parallel.offload={self.offload}")
        if self.pp > 1:
            out += [
                f"parallel.pp_schedule={self.pp_schedule}",
                f"parallel.pp_stages_per_rank={self.stages_per_rank}",
                f"parallel.pp_microbatches={self.microbatches}",
            ]
        return out

    def short(self) -> str:
        parts = [f"pp{self.pp}"] if self.pp > 1 else []
        parts.append(
            f"dp{self.dp_replicate}x{self.dp_shard}"
            if self.dp_replicate > 1 and self.dp_shard > 1
            else f"dp{self.dp}"
        )
        if self.cp > 1:
            inner = f"/{self.cp_ulysses}" if self.cp_ulysses else ""
            parts.append(f"cp{self.cp}:{self.cp_style}{inner}")
        parts.append(f"tp{self.tp}{'+sp' if self.sequence_parallel else ''}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(
            f"z{self.zero_stage}"
            if self.dp_shard * self.cp > 1 or self.zero_stage == 1 and self.dp > 1
            else ("ddp" if self.dp > 1 else "-")
        )
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}/v{self.stages_per_rank}/M{self.microbatches}")
        parts.append(f"mb{self.micro_batch_size}")
        parts.append(
            f"ac:{self.activation_checkpointing}"
            + (
                "/alternate"
                if self.activation_checkpointing == "selective"
                and not self.ac_every
                and self.ac_policy == "alternate_matmuls"
                else ""
            )
        )
        if self.offload != "none":
            parts.append("offload")
        if self.tile_mlp > 1 or self.tile_loss > 1:
            parts.append(f"tiles:{max(self.tile_mlp, 1)}/{max(self.tile_loss, 1)}")
        if self.activation_offload:
            parts.append("act-offload")
        return " ".join(parts)


def candidate_from_config(cfg: TrainConfig, world_size: int) -> Candidate:
    """The layout a config asks for (``dp_shard=-1`` resolved)."""
    p = cfg.parallel
    layout = resolve_degrees(p, world_size)
    return Candidate(
        layout=layout,
        cp_style=p.cp_style,
        cp_ulysses=p.cp_ulysses,
        zero_stage=p.zero_stage,
        sequence_parallel=p.sequence_parallel,
        pp_schedule=p.pp_schedule,
        stages_per_rank=(p.pp_stages_per_rank or default_stages_per_rank(p.pp_schedule))
        if layout.pp > 1
        else 1,
        micro_batch_size=cfg.train.micro_batch_size,
        microbatches=pipeline_microbatches(cfg, layout.dp),
        activation_checkpointing=cfg.memory.activation_checkpointing,
        ac_every=cfg.memory.ac_every,
        ac_policy=cfg.memory.ac_policy,
        ac_save_gathers=cfg.memory.ac_save_gathers,
        offload=p.offload,
        offload_dir=bool(p.offload_dir),
        reshard_after_forward=p.reshard_after_forward,
        tile_mlp=cfg.memory.tile_mlp,
        tile_loss=cfg.memory.tile_loss,
        activation_offload=cfg.memory.activation_offload,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_sizes(global_batch_size: int, dp: int) -> list[int]:
    """The micro-batch sizes a layout of ``dp`` data-parallel ranks can run the global batch at: the
    divisors of each rank's share; none where dp does not divide it. The global batch is the run's,
    the micro-batch the layout's (the search weighs each)."""
    return _divisors(global_batch_size // dp) if global_batch_size % dp == 0 else []


def _tp_degrees(cfg: TrainConfig, world_size: int, gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees this model can split, within one node (TP's traffic needs its fastest
    links)."""
    m = cfg.model
    if MODEL_REGISTRY[m.name].tensor_parallel_problem(m) is not None:
        return [1]
    sizes = [v for _, v in MODEL_REGISTRY[m.name].tp_split_sizes(m)]
    return [
        t for t in _divisors(world_size) if t <= gpus_per_node and all(v % t == 0 for v in sizes)
    ]


def enumerate_candidates(cfg: TrainConfig, world_size: int, gpus_per_node: int) -> list[Candidate]:
    """Every layout of ``world_size`` ranks this config could run (composer3d's checks, in
    arithmetic form)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    experts = m.moe.experts if m.name == "llama" else 0
    n_layers, global_batch, seq_len = m.n_layers, t.global_batch_size, t.seq_len
    # the config's keys every candidate carries, read once: a config's attribute costs about as
    # much as the rest of a candidate's enumeration, and a search enumerates tens of thousands
    carried = dict(
        ac_policy=cfg.memory.ac_policy,
        ac_save_gathers=cfg.memory.ac_save_gathers,
        tile_mlp=cfg.memory.tile_mlp,
        tile_loss=cfg.memory.tile_loss,
        offload=p.offload,
        offload_dir=bool(p.offload_dir),
        activation_offload=cfg.memory.activation_offload,
    )
    compiled = cfg.compile.enabled
    # refused by checks: a V-shaped schedule runs its embedding and its head twin on one rank (a
    # tied model), and runs nothing forward only (evaluation, the DPO reference)
    no_v_shaped = m.tie_embeddings or t.eval_every > 0 or runs_reference(cfg)
    optimizer_runs = cache(lambda zero, tp: _optimizer_runs(cfg, zero, tp))
    found = []
    for tp in _tp_degrees(cfg, world_size, gpus_per_node):
        for pp, cp in (
            (pp, cp)
            for pp in _divisors(world_size // tp)
            for cp in _divisors(world_size // tp // pp)
        ):
            if pp > n_layers:
                continue
            dp = world_size // (tp * pp * cp)
            sizes = micro_batch_sizes(global_batch, dp)
            if not sizes:
                continue
            local_batch = global_batch // dp
            for dp_shard in _divisors(dp):
                dp_replicate = dp // dp_shard
                for zero, ep in _zero_stages_and_ep(dp_replicate, dp_shard * cp, experts):
                    if zero == 1 and carried["offload"] != "none":
                        continue  # refused by checks: offload takes the shards FSDP owns
                    if not optimizer_runs(zero, tp):
                        continue
                    if not _ep_fits(ep, cp, dp_shard):
                        continue
                    layout = Layout(
                        pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep
                    )
                    styles = _cp_styles(cfg, layout, zero)
                    for sp, (style, ulysses) in product(
                        (False, True) if tp > 1 and seq_len % tp == 0 else (False,), styles
                    ):
                        if not _tiles_fit(cfg, seq_len // cp // (tp if sp else 1), pp):
                            continue
                        for mbs in sizes:
                            base = Candidate(
                                layout,
                                zero,
                                sp,
                                "1f1b",
                                1,
                                mbs,
                                local_batch // mbs,
                                "none",
                                cp_style=style,
                                cp_ulysses=ulysses,
                                **carried,
                            )
                            found += _with_schedules_and_ac(base, n_layers, compiled, no_v_shaped)
    return found


class WithKeys:
    """A config section with some keys replaced: what a check reads of a candidate."""

    def __init__(self, section: Any, **keys: Any):
        self._section, self._keys = section, keys

    def __getattr__(self, name: str) -> Any:
        keys = self.__dict__["_keys"]
        return keys[name] if name in keys else getattr(self.__dict__["_section"], name)


def _optimizer_runs(cfg: TrainConfig, zero_stage: int, tp: int) -> bool:
    """Whether training's optimizer check accepts this ZeRO stage and tp (a low-bit AdamW keeps
    quantized state ZeRO-1 cannot slice; optim.name=muon gathers its matrices from ZeRO-1's slices
    only without TP)."""
    try:
        _check_optimizer(cfg.optim, WithKeys(cfg.parallel, zero_stage=zero_stage, tp=tp))
    except ConfigError:
        return False
    return True


def _cp_styles(cfg: TrainConfig, layout: Layout, zero_stage: int) -> list[tuple[str, int]]:
    """The context-parallel styles training would accept for this layout (none where it refuses cp),
    with hierarchical's Ulysses degree (each divisor of cp between 1 and cp; 0 for the others): the
    config's own check, asked of each with the candidate's ZeRO stage."""
    if layout.cp == 1:
        return [("ring", 0)]
    cp = layout.cp
    options = [
        (style, ulysses)
        for style in CP_STYLES
        for ulysses in (
            [d for d in range(2, cp) if cp % d == 0] if style == "hierarchical" else [0]
        )
    ]
    styles = []
    for style, ulysses in options:
        try:
            check_context_parallel(
                cfg.model,
                layout,
                cfg.train.seq_len,
                style,
                cfg.parallel.cp_balance,
                zero_stage,
                cfg.compile.enabled,
                ulysses,
            )
        except ConfigError:
            continue
        styles.append((style, ulysses))
    return styles


def _tiles_fit(cfg: TrainConfig, held: int, pp: int) -> bool:
    """The config's sequence tiles divide the tokens a rank holds; the loss's only without a
    pipeline (checks)."""
    mlp, loss = cfg.memory.tile_mlp, cfg.memory.tile_loss
    return (mlp <= 1 or held % mlp == 0) and (loss <= 1 or (held % loss == 0 and pp == 1))


def _ep_fits(ep: int, cp: int, dp_shard: int) -> bool:
    """Whether ep can borrow its ranks as checks require: every cp rank first, then ep/cp from
    dp_shard."""
    if ep == 1:
        return True
    if cp > 1:
        return ep % cp == 0 and dp_shard % (ep // cp) == 0
    return dp_shard % ep == 0


def _zero_stages_and_ep(dp_replicate: int, dp_shard: int, experts: int) -> list[tuple[int, int]]:
    """ZeRO stages and expert-parallel degrees of a data-parallel split: ep divides dp_shard and the
    experts; ZeRO-1 has no HSDP form."""
    zeros = (3, 2, 1) if dp_shard > 1 else (3, 1) if dp_replicate > 1 else (3,)
    out = [(z, 1) for z in zeros if not (z == 1 and dp_replicate > 1 and dp_shard > 1)]
    for ep in _divisors(dp_shard)[1:] if experts else []:
        if experts % ep == 0:
            out += [(z, ep) for z in (3, 2, 1) if not (z == 1 and dp_replicate > 1)]
    return out


def _with_schedules_and_ac(
    base: Candidate, n_layers: int, compiled: bool, no_v_shaped: bool
) -> list[Candidate]:
    out = []
    schedules = (
        [s for s in SCHEDULES if not (no_v_shaped and s in V_SHAPED)] if base.pp > 1 else ("1f1b",)
    )
    for schedule, v in (
        (schedule, v)
        for schedule in schedules
        for v in (
            (default_stages_per_rank(schedule), *MORE_CHUNKS.get(schedule, ()))
            if base.pp > 1
            else (1,)
        )
    ):
        if base.pp > 1 and (
            base.pp * v > n_layers or schedule_problem(schedule, base.pp, v, base.microbatches)
        ):
            continue
        for ac in ("none", "selective", "full"):
            if ac != "none" and base.pp > 1 and schedule in ZERO_BUBBLE:
                # refused by checks: the split backward re-enters the checkpointed region twice
                continue
            if ac == "selective" and base.activation_offload and not compiled:
                # refused by checks: eager op-level selective hides its saved tensors from the
                # offload
                continue
            out.append(
                replace(base, pp_schedule=schedule, stages_per_rank=v, activation_checkpointing=ac)
            )
    return out


def apply_to_config(cfg: TrainConfig, candidate: Candidate) -> None:
    """Write ``candidate`` into ``cfg`` (the keys ``Candidate.overrides`` names)."""
    p = cfg.parallel
    p.pp, p.dp_replicate, p.dp_shard, p.tp = (
        candidate.pp,
        candidate.dp_replicate,
        candidate.dp_shard,
        candidate.tp,
    )
    p.ep, p.cp, p.cp_style = candidate.ep, candidate.cp, candidate.cp_style
    p.cp_ulysses = candidate.cp_ulysses
    p.zero_stage, p.sequence_parallel = candidate.zero_stage, candidate.sequence_parallel
    p.pp_schedule, p.pp_stages_per_rank = candidate.pp_schedule, candidate.stages_per_rank
    p.pp_microbatches = candidate.microbatches if candidate.pp > 1 else None
    cfg.train.micro_batch_size = candidate.micro_batch_size
    cfg.memory.activation_checkpointing = candidate.activation_checkpointing
    cfg.memory.ac_policy = candidate.ac_policy
    cfg.memory.ac_save_gathers = candidate.keeps_gathers
    cfg.memory.activation_offload = candidate.activation_offload
