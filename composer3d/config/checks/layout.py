"""The layout: parallel degrees that multiply to the world size, the sharding stage and offload,
tensor/sequence parallel that the model can split, expert parallel, and the pipeline (schedule,
stages, microbatches)."""

from __future__ import annotations

import math
from typing import Any

from composer3d.config.checks.common import _divisors, _require
from composer3d.config.schema import ModelConfig, ParallelConfig
from composer3d.models import MODEL_REGISTRY
from composer3d.parallel.context import STYLES as CP_STYLES
from composer3d.parallel.context.balance import BALANCES as CP_BALANCES
from composer3d.parallel.mesh import Layout
from composer3d.parallel.pipeline.schedules import SCHEDULES as PP_SCHEDULES
from composer3d.parallel.pipeline.schedules import (
    V_SHAPED,
    default_stages_per_rank,
    forward_only_problem,
    schedule_problem,
)


def resolve_degrees(p: ParallelConfig, world_size: int) -> Layout:
    """Degrees with ``dp_shard=-1`` inferred; raises ConfigError naming the key when they cannot
    multiply to world."""
    fixed = {"pp": p.pp, "dp_replicate": p.dp_replicate, "cp": p.cp, "tp": p.tp}
    for key, value in {**fixed, "ep": p.ep}.items():
        _require(
            value >= 1,
            f"parallel.{key}",
            f"must be >= 1, got {value}",
            "Use 1 to disable this dimension",
        )
    _require(
        p.dp_shard == -1 or p.dp_shard >= 1,
        "parallel.dp_shard",
        f"must be >= 1 or -1, got {p.dp_shard}",
        "Use -1 to take what the world size leaves after the other degrees",
    )
    others = math.prod(fixed.values())
    if p.dp_shard == -1:
        _require(
            world_size % others == 0,
            _culprit(fixed, world_size, max(fixed, key=fixed.get)),
            f"pp×dp_replicate×cp×tp = {others} does not divide the world size {world_size}",
            f"Choose degrees whose product divides {world_size} ({_divisors(world_size)})",
        )
        dp_shard = world_size // others
    else:
        dp_shard = p.dp_shard
        _require(
            others * dp_shard == world_size,
            _culprit({**fixed, "dp_shard": dp_shard}, world_size, "dp_shard"),
            f"pp×dp_replicate×dp_shard×cp×tp = {others * dp_shard} but the world size is "
            f"{world_size}",
            "Make the product equal the world size, or set parallel.dp_shard=-1 to infer it",
        )
    return Layout(
        pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, ep=p.ep
    )


def _culprit(given: dict[str, int], world_size: int, default: str) -> str:
    """The key to blame in a product error: the first degree that alone does not divide the world
    size."""
    for key, value in given.items():
        if value > 1 and world_size % value != 0:
            return f"parallel.{key}"
    return f"parallel.{default}"


def check_context_parallel(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    cp_style: str,
    cp_balance: str,
    zero_stage: int,
    compiled: bool,
    cp_ulysses: int = 0,
) -> None:
    """Context parallel cuts every sequence into 2·cp chunks (head-tail balancing). The native model
    runs it with FSDP/HSDP (ZeRO-1/2/3), TP/SP and compile, and with pipeline and expert parallel,
    each with the others (ZeRO-1 never with EP, compile with TP on no CPU); the Hugging Face models
    whose attention it can reach (the family's ``context_parallel_problem``) with FSDP/HSDP. What is
    not yet tested is refused rather than guessed. Public: the planner asks it of each candidate
    layout, with each style."""
    cp = layout.cp
    if cp == 1:
        return
    _require(
        seq_len % (2 * cp) == 0,
        "parallel.cp",
        f"cp={cp} cuts train.seq_len={seq_len} into 2·cp = {2 * cp} equal chunks, which does not "
        "divide it",
        f"Use a cp with 2·cp dividing {seq_len} ({_divisors(seq_len // 2)}), or a train.seq_len "
        f"divisible by {2 * cp}",
    )
    balance = cp_balance
    _require(
        balance in CP_BALANCES,
        "parallel.cp_balance",
        f"got {balance!r}",
        "Use documents (the default: balanced by each batch's packed documents) or head_tail (rank "
        "r holds chunks r and 2·cp−1−r)",
    )
    style = cp_style
    _require(
        style in CP_STYLES,
        "parallel.cp_style",
        f"got {style!r}",
        "Use ring (the default: keys and values passed round the cp ranks), allgather, ulysses or "
        "hierarchical (with parallel.cp_ulysses)",
    )
    if style == "hierarchical":
        inner = [d for d in range(2, cp) if cp % d == 0]
        _require(
            cp_ulysses in inner,
            "parallel.cp_ulysses",
            f"cp_style=hierarchical runs Ulysses over cp_ulysses consecutive cp ranks and the ring "
            f"across those groups; cp_ulysses={cp_ulysses} is not a divisor of cp={cp} between 1 "
            "and cp",
            f"Use parallel.cp_ulysses in {inner} (the cp ranks of a node), or "
            "parallel.cp_style=ring"
            if inner
            else f"Use parallel.cp_style=ring or ulysses: cp={cp} has no divisor between 1 and cp",
        )
    else:
        _require(
            cp_ulysses == 0,
            "parallel.cp_ulysses",
            f"is the Ulysses degree of cp_style=hierarchical, got {cp_ulysses} with "
            f"cp_style={style}",
            "Use parallel.cp_style=hierarchical, or leave parallel.cp_ulysses at 0",
        )
    if style in ("ulysses", "hierarchical"):
        _check_ulysses_heads(model, layout.tp, cp if style == "ulysses" else cp_ulysses, style)
    problem = MODEL_REGISTRY[model.name].context_parallel_problem(model)
    _require(
        problem is None,
        "parallel.cp",
        f"context parallel (cp={cp}) of this model: {problem}",
        "Use parallel.cp=1 with this model (FSDP and pipeline parallel work)",
    )
    # Expert capacity keeps the earliest positions of a whole sequence, which no cp rank holds
    # alone.
    _require(
        model.moe.experts == 0 or model.moe.capacity_factor <= 0,
        "model.moe.capacity_factor",
        f"expert capacity drops a sequence's choices by position, and under parallel.cp={cp} each "
        "rank holds only its chunks of the sequence",
        "Use model.moe.capacity_factor=0 with parallel.cp>1, or parallel.cp=1",
    )
    # the native model composes cp with each of these and their combinations (tests/test_cp_*.py);
    # model=hf with FSDP, HSDP and tensor (+ sequence) parallel (tests/test_cp_hf.py)
    others = {
        "parallel.zero_stage": zero_stage == 1,
        "compile.enabled": compiled,
        "parallel.pp": layout.pp > 1,
        "parallel.ep": layout.ep > 1,
    }
    # tested with FSDP, HSDP and TP + SP only: (whether it applies, what, what would work instead)
    limited = [
        (style == "hierarchical", "cp_style=hierarchical", "parallel.cp_style=ring (which does)"),
        (
            model.name != "llama",
            f"context parallel (parallel.cp={cp}) of model=hf",
            "parallel.cp=1",
        ),
    ]
    for applies, whose, instead in limited:
        for key, given in others.items():
            _require(
                not (applies and given),
                key,
                f"{whose} does not compose with {key} yet",
                f"Use {instead}, or leave {key} at its default (it runs with FSDP, HSDP and TP)",
            )


def _check_ulysses_heads(model: ModelConfig, tp: int, degree: int, style: str) -> None:
    """Ulysses splits the heads a rank holds (under tensor parallel, 1/tp of them) over ``degree``
    ranks."""
    heads = {"model.n_heads": model.n_heads, "model.n_kv_heads": model.n_kv_heads or model.n_heads}
    over = "cp" if style == "ulysses" else "cp_ulysses"
    ranks = "the cp ranks" if style == "ulysses" else "the ranks of each Ulysses group"
    for key, count in heads.items():
        # tp not dividing is its own error (_check_layout)
        local = count // tp if count % tp == 0 else count
        held = (
            f"{key}={count} over tp={tp} leaves {local} a rank, which"
            if tp > 1
            else f"{key}={count}"
        )
        _require(
            local % degree == 0,
            f"parallel.{'cp_style' if style == 'ulysses' else 'cp_ulysses'}",
            f"{style} splits the heads a rank holds over {ranks}, and {held} is not divisible by "
            f"{over}={degree}",
            (
                f"Use parallel.cp_style=ring (or allgather), or a cp dividing {local}"
                if style == "ulysses"
                else f"Use a parallel.cp_ulysses dividing {local}, or parallel.cp_style=ring"
            )
            + (", or a smaller parallel.tp" if tp > 1 else ""),
        )


def _check_layout(cfg: Any, layout: Layout) -> None:
    """Dimensions and sharding stages that exist, and tensor/sequence parallel that this model can
    split."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    tp = layout.tp
    check_context_parallel(
        m,
        layout,
        t.seq_len,
        p.cp_style,
        p.cp_balance,
        p.zero_stage,
        cfg.compile.enabled,
        p.cp_ulysses,
    )
    _check_expert_parallel(cfg, layout)
    _require(
        p.zero_stage in (1, 2, 3),
        "parallel.zero_stage",
        f"must be 1, 2 or 3, got {p.zero_stage}",
        "3 shards params+grads+optimizer state, 2 keeps params gathered through backward, 1 "
        "replicates params and shards only optimizer state",
    )
    _require(
        p.zero1_bucket_mb > 0,
        "parallel.zero1_bucket_mb",
        f"must be > 0 MiB, got {p.zero1_bucket_mb}",
        "Use a bucket of some MiB (40 by default; smaller buckets overlap sooner, larger ones send "
        "fewer messages)",
    )
    if p.zero_stage == 1:
        _require(
            layout.dp_replicate == 1 or layout.dp_shard == 1,
            "parallel.zero_stage",
            "ZeRO-1 replicates parameters over all data-parallel ranks, so it has no HSDP form "
            f"(dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard})",
            "Use zero_stage=2 or 3 for HSDP, or put all data-parallel ranks in one dimension",
        )
    _check_offload(cfg)
    if tp > 1:
        problem = MODEL_REGISTRY[m.name].tensor_parallel_problem(m)
        _require(
            problem is None,
            "parallel.tp",
            str(problem),
            "Use parallel.tp=1 (FSDP and pipeline parallel work)",
        )
    for key, value in MODEL_REGISTRY[m.name].tp_split_sizes(m):
        _require(
            value % tp == 0,
            "parallel.tp",
            f"tp={tp} does not divide {key}={value}, which tensor parallel splits",
            f"Choose parallel.tp among the common divisors of the split sizes, or change {key}",
        )
    if p.sequence_parallel:
        _require(
            tp > 1,
            "parallel.sequence_parallel",
            "needs tensor parallel (tp > 1) to shard the sequence over",
            "Set parallel.tp>1 or parallel.sequence_parallel=false",
        )
        # under context parallel, sequence parallel splits each cp rank's seq_len/cp tokens
        cp = layout.cp
        held = (
            f"the {t.seq_len // cp} tokens each of the cp={cp} ranks holds"
            if cp > 1
            else f"seq_len={t.seq_len}"
        )
        _require(
            t.seq_len % (cp * tp) == 0,
            "train.seq_len",
            f"{held} is not divisible by tp={tp}, which sequence parallel shards it over",
            f"Use a multiple of {cp * tp}",
        )


def _check_expert_parallel(cfg: Any, layout: Layout) -> None:
    """ep borrows its ranks from dp_shard (and every cp rank, under context parallel) and shards
    each MoE layer's experts: both must divide."""
    ep, m = layout.ep, cfg.model
    if ep == 1:
        return
    experts, problem = MODEL_REGISTRY[m.name].expert_parallel(m)
    what = (
        f"{m.path} is a dense model"
        if m.name == "hf"
        else "the model is dense (model.moe.experts=0)"
    )
    _require(
        experts > 0,
        "parallel.ep",
        f"expert parallel (ep={ep}) needs a mixture-of-experts model, and {what}",
        "Use parallel.ep=1, or a mixture-of-experts model (model=tiny_moe, model.moe.experts>0, or "
        "model=hf with a Hugging Face MoE model)",
    )
    _require(
        problem is None,
        "parallel.ep",
        f"expert parallel (ep={ep}) of {m.path}: {problem}",
        "Use parallel.ep=1 (FSDP and pipeline parallel work)",
    )
    _require(
        experts % ep == 0,
        "parallel.ep",
        f"ep={ep} does not divide the {experts} routed experts of each MoE layer (each ep rank "
        "holds experts/ep of every MoE layer)",
        f"Choose parallel.ep among {_divisors(experts)}",
    )
    cp, dp_shard = layout.cp, layout.dp_shard
    # the tokens of a sequence meet at the same experts: ep takes every cp rank, and more from
    # dp_shard
    if cp > 1:
        choices = ", ".join(str(cp * d) for d in range(1, dp_shard + 1) if dp_shard % d == 0)
        _require(
            ep % cp == 0 and dp_shard % (ep // cp) == 0,
            "parallel.ep",
            f"under context parallel (cp={cp}) expert parallel takes all cp ranks and ep/cp more "
            f"from dp_shard={dp_shard}, and ep={ep} is not so made",
            f"Choose parallel.ep among {choices}",
        )
    _require(
        cp > 1 or dp_shard % ep == 0,
        "parallel.ep",
        f"ep={ep} does not divide dp_shard={dp_shard}: expert parallel takes its ranks from the "
        "data-parallel shard dimension",
        f"Choose parallel.ep among {_divisors(dp_shard)}, or give dp_shard a multiple of {ep}",
    )


def pipeline_microbatches(cfg: Any, dp: int) -> int:
    t = cfg.train
    return cfg.parallel.pp_microbatches or t.global_batch_size // (t.micro_batch_size * dp)


def _check_pipeline(cfg: Any, pp: int, dp: int) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    _require(
        p.reshard_after_forward in ("default", "always", "never"),
        "parallel.reshard_after_forward",
        f"unknown policy {p.reshard_after_forward!r}",
        "Choose default, always or never",
    )
    _require(
        p.pp_schedule in PP_SCHEDULES,
        "parallel.pp_schedule",
        f"unknown schedule {p.pp_schedule!r}",
        f"Choose one of {list(PP_SCHEDULES)}",
    )
    if pp == 1:
        return
    stages_per_rank = p.pp_stages_per_rank or default_stages_per_rank(p.pp_schedule)
    stages = pp * stages_per_rank
    _require(
        stages <= m.n_layers,
        "parallel.pp",
        f"pp={pp} × pp_stages_per_rank={stages_per_rank} = {stages} stages but the model has "
        f"{m.n_layers} layers (each stage needs at least one)",
        "Lower parallel.pp or parallel.pp_stages_per_rank",
    )
    if m.name == "hf":
        from composer3d.models.hf import load_hf_config, wants_router_loss

        _require(
            not wants_router_loss(load_hf_config(m.path)),
            "parallel.pp",
            f"{m.path}/config.json sets output_router_logits: true, and transformers' router "
            "load-balancing loss pools every MoE layer of a forward, of which a pipeline stage "
            "holds only some",
            "Use parallel.pp=1 (FSDP, TP/SP and EP) for this model, or set output_router_logits to "
            "false in config.json to train without that loss",
        )
    # A tied head becomes the embedding's twin on the last stage, its gradient summed with the first
    # stage's (parallel.tied): that needs the two stages on two ranks.
    tied_by = (
        f"tie_word_embeddings in {m.path}/config.json" if m.name == "hf" else "model.tie_embeddings"
    )
    _require(
        not (m.tie_embeddings and p.pp_schedule in V_SHAPED),
        "parallel.pp_schedule",
        f"{p.pp_schedule} runs the first and the last stage on one rank, where the head tied to "
        f"the embedding ({tied_by}) would be one parameter in two stages",
        "Use another schedule (1f1b, interleaved_1f1b, interleaved_zero_bubble, …) for a tied "
        "model",
    )
    problem = forward_only_problem(p.pp_schedule, "evaluation (train.eval_every)")
    _require(
        t.eval_every == 0 or problem is None,
        "train.eval_every",
        problem,
        "Use another schedule (1f1b, interleaved_1f1b, interleaved_zero_bubble, …), or "
        "train.eval_every=0",
    )
    # ZeRO-1 moves each gradient into its bucket during the backward (parallel.zero_buckets), before
    # the twins' gradients could be summed, and steps slices the twins do not share.
    _require(
        not (m.tie_embeddings and p.zero_stage == 1),
        "parallel.zero_stage",
        "ZeRO-1 reduces each gradient into its buckets during the backward, before a tied head's "
        f"twin ({tied_by}) could add its gradient to the embedding's on the first stage",
        "Use parallel.zero_stage=2 or 3 for a tied model under parallel.pp",
    )
    local_batch = t.global_batch_size // dp
    microbatches = pipeline_microbatches(cfg, dp)
    _require(
        microbatches >= 1 and local_batch % microbatches == 0,
        "parallel.pp_microbatches",
        f"{microbatches} microbatches do not divide the {local_batch} sequences each data-parallel "
        f"rank gets (global_batch_size {t.global_batch_size} / dp {dp})",
        f"Use a divisor of {local_batch}",
    )
    problem = schedule_problem(p.pp_schedule, pp, stages_per_rank, microbatches)
    _require(
        problem is None,
        "parallel.pp_microbatches" if "microbatches" in (problem or "") else "parallel.pp_schedule",
        str(problem),
        "Raise train.global_batch_size or parallel.pp_microbatches, or pick another schedule",
    )


def _check_offload(cfg: Any) -> None:
    """ZeRO-Offload: FSDP's (cpu) or the optimizer's alone (optimizer, in host memory or files under
    offload_dir)."""
    p = cfg.parallel
    _require(
        p.offload in ("none", "cpu", "optimizer"),
        "parallel.offload",
        f"unknown offload {p.offload!r}",
        "Choose none, cpu (parameters, gradients and optimizer in host memory) or optimizer (its "
        "state only)",
    )
    _require(
        p.offload == "none" or p.zero_stage != 1,
        "parallel.offload",
        f"offload={p.offload} offloads the shards FSDP owns; ZeRO-1 keeps replicated params and "
        "shards the optimizer state itself",
        f"Use parallel.zero_stage=2 or 3 with parallel.offload={p.offload}",
    )
    _require(
        p.offload != "optimizer" or cfg.optim.name == "adamw",
        "parallel.offload",
        f"the host optimizer step is torch's AdamW; optim.name={cfg.optim.name} "
        + ("steps on the device" if cfg.optim.name == "muon" else "keeps its low-bit state there"),
        "Use optim.name=adamw with parallel.offload=optimizer, or parallel.offload=none",
    )
    _require(
        not p.offload_dir or p.offload == "optimizer",
        "parallel.offload_dir",
        "keeps the optimizer's host state in files, which needs parallel.offload=optimizer (got "
        f"{p.offload})",
        "Add parallel.offload=optimizer, or drop parallel.offload_dir",
    )
