"""The training step and loop: batch sizes that split over the data-parallel ranks, steps and
evaluation, the optimizer, precision and memory (activation checkpointing), and
composer3d-generate's decoding settings."""

from __future__ import annotations

from typing import Any

from composer3d.config.checks.common import DTYPE_NAMES, _divisors, _require
from composer3d.memory.activation_checkpointing import POLICIES as AC_POLICIES
from composer3d.memory.activation_checkpointing import blocks_all_gather
from composer3d.models import build_model
from composer3d.parallel.mesh import Layout

PARAM_DTYPES = ("auto", *DTYPE_NAMES)
PRECISION_CASTS = ("auto", "params", "autocast")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adamw_fp8", "muon")
MUON_SCALES = ("match_adamw", "shape")
MUON_NS_DTYPES = ("auto", "float32", "bfloat16")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop", "compiled")


def _check_batch(cfg: Any, layout: Layout) -> None:
    """Sequence length within the model's, and a global batch that splits evenly over dp ranks ×
    micro-batches."""
    m, t = cfg.model, cfg.train
    dp = layout.dp
    _require(
        t.seq_len >= 1 and t.seq_len <= m.max_seq_len,
        "train.seq_len",
        f"must be in [1, model.max_seq_len={m.max_seq_len}], got {t.seq_len}",
        "Lower train.seq_len",
    )
    _require(
        t.micro_batch_size >= 1,
        "train.micro_batch_size",
        f"must be >= 1, got {t.micro_batch_size}",
        "Use 1+",
    )
    per_step = t.micro_batch_size * dp
    _require(
        t.global_batch_size >= 1 and t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        f"{t.global_batch_size} is not divisible by micro_batch_size × dp = {t.micro_batch_size} × "
        f"{dp} = {per_step}",
        f"Use a multiple of {per_step}, e.g. {per_step * max(1, t.global_batch_size // per_step)}",
    )


def _check_loop(t: Any, eval_cfg: Any) -> None:
    """Steps, evaluation, non-finite handling and clipping."""
    _require(
        t.eval_every >= 0,
        "train.eval_every",
        f"must be >= 0, got {t.eval_every}",
        "Use 0 to never evaluate",
    )
    _require(
        t.eval_every == 0 or bool(eval_cfg.path),
        "eval.path",
        "train.eval_every is set but there is no evaluation file",
        "Set eval.path=<text file>, or train.eval_every=0",
    )
    _require(
        eval_cfg.max_windows >= 0,
        "eval.max_windows",
        f"must be >= 0, got {eval_cfg.max_windows}",
        "Use 0 for all windows",
    )
    _require(
        eval_cfg.num_fewshot >= -1,
        "eval.num_fewshot",
        f"must be >= -1, got {eval_cfg.num_fewshot}",
        "Use -1 for each task's own default, or 0, 5, ...",
    )
    _require(
        eval_cfg.limit >= 0,
        "eval.limit",
        f"must be >= 0, got {eval_cfg.limit}",
        "Use 0 for every document",
    )
    _require(
        eval_cfg.bootstrap_iters >= 0,
        "eval.bootstrap_iters",
        f"must be >= 0, got {eval_cfg.bootstrap_iters}",
        "Use 0 to skip bootstrapped standard errors",
    )
    _require(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}", "Use 1 or more")
    _require(
        t.on_nonfinite in ("stop", "skip"),
        "train.on_nonfinite",
        f"unknown policy {t.on_nonfinite!r}",
        "Choose stop (exit at the first non-finite step) or skip (drop that update)",
    )
    _require(
        t.max_skipped_steps >= 1,
        "train.max_skipped_steps",
        f"must be >= 1, got {t.max_skipped_steps}",
        "Use e.g. 10",
    )
    _require(
        t.gc_every >= 0,
        "train.gc_every",
        f"must be >= 0, got {t.gc_every}",
        "Use e.g. 50 (collect every 50 steps), or 0 for Python's automatic collection",
    )
    _require(
        t.grad_clip >= 0,
        "train.grad_clip",
        f"must be >= 0, got {t.grad_clip}",
        "Use 0 to disable clipping",
    )


GENERATE_CACHES = ("static", "dynamic", "none")


def _check_generate(g: Any, model_name: str) -> None:
    """composer3d-generate's decoding settings (the prompt's length is checked once it is
    tokenized)."""
    _require(
        g.max_new_tokens >= 1,
        "generate.max_new_tokens",
        f"must be >= 1, got {g.max_new_tokens}",
        "Use e.g. 128",
    )
    _require(
        g.temperature >= 0,
        "generate.temperature",
        f"must be >= 0, got {g.temperature}",
        "Use 0 for greedy decoding, or e.g. 0.8 to sample",
    )
    _require(
        0 < g.top_p <= 1,
        "generate.top_p",
        f"must be in (0, 1], got {g.top_p}",
        "Use 1 for no nucleus cut, or e.g. 0.9",
    )
    _require(
        g.top_k >= 0,
        "generate.top_k",
        f"must be >= 0, got {g.top_k}",
        "Use 0 for no top-k cut, or e.g. 50",
    )
    _require(
        all(isinstance(s, str) and s for s in g.stop),
        "generate.stop",
        f"every stop string must be non-empty text, got {list(g.stop)}",
        "Drop the empty one, e.g. generate.stop=[END,Question:]",
    )
    _require(
        g.cache in GENERATE_CACHES,
        "generate.cache",
        f"unknown cache {g.cache!r}",
        f"Choose one of {GENERATE_CACHES}",
    )
    _require(
        g.cache != "dynamic" or model_name == "hf",
        "generate.cache",
        f"the native model ({model_name}) has a static KV cache only",
        "Use generate.cache=static (or none)",
    )
    _require(
        not g.compile or (g.cache == "static" and model_name != "hf"),
        "generate.compile",
        f"compiles the native model's static-cache decode steps, not model={model_name} with "
        f"generate.cache={g.cache}",
        "Use generate.compile=false (or the native model with generate.cache=static)",
    )
    _require(
        g.output in ("text", "json"),
        "generate.output",
        f"unknown output {g.output!r}",
        "Choose text or json",
    )


def _check_optimizer(o: Any, p: Any) -> None:
    _require(
        o.name in OPTIMIZERS,
        "optim.name",
        f"unknown optimizer {o.name!r}",
        f"Choose one of {OPTIMIZERS}",
    )
    _require(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}", "Use e.g. 3e-4")
    _require(
        o.schedule in SCHEDULES,
        "optim.schedule",
        f"unknown schedule {o.schedule!r}",
        f"Choose one of {SCHEDULES}",
    )
    _require(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        "optim.betas",
        f"must be two numbers in [0, 1), got {list(o.betas)}",
        "Use e.g. [0.9,0.95]",
    )
    _require(
        o.implementation in OPTIMIZER_IMPLEMENTATIONS,
        "optim.implementation",
        f"unknown implementation {o.implementation!r}",
        f"Choose one of {OPTIMIZER_IMPLEMENTATIONS}",
    )
    _require(
        o.name in ("adamw", "muon") or o.implementation == "auto",
        "optim.implementation",
        f"{o.name} is torchao's compiled low-bit AdamW, which has no "
        "fused/foreach/for_loop/compiled variants",
        "Use optim.implementation=auto",
    )
    _require(
        o.name != "muon" or o.implementation == "auto",
        "optim.implementation",
        "muon steps its AdamW parameters with the fused kernel where the device has one, else "
        "foreach; it has no other variants",
        "Use optim.implementation=auto",
    )
    if o.name == "muon":
        _check_muon(o, p)
    _require(
        o.implementation != "compiled" or p.offload != "optimizer",
        "optim.implementation",
        "compiled steps on the device, and parallel.offload=optimizer steps on the host (its fused "
        "AdamW)",
        "Use optim.implementation=auto with parallel.offload=optimizer",
    )
    _require(
        0 <= o.warmup_steps,
        "optim.warmup_steps",
        f"must be >= 0, got {o.warmup_steps}",
        "Use 0 for none",
    )
    _require(
        o.name in ("adamw", "muon") or p.zero_stage != 1,
        "optim.name",
        f"{o.name} keeps quantized state that ZeRO-1's slicing cannot cut",
        "Use optim.name=adamw with zero_stage=1, or zero_stage 2/3 (state sharded by FSDP)",
    )


def _check_qk_clip(cfg: Any) -> None:
    o = cfg.optim
    if o.muon_clip_threshold == 0:
        return
    _require(
        o.muon_clip_threshold > 0,
        "optim.muon_clip_threshold",
        f"must be >= 0, got {o.muon_clip_threshold}",
        "Use 0 (off) or e.g. 100",
    )
    _require(
        o.name == "muon",
        "optim.muon_clip_threshold",
        f"QK-Clip is MuonClip's, for Muon's updates; optim.name={o.name}",
        "Use optim.name=muon, or optim.muon_clip_threshold=0",
    )
    _require(
        cfg.model.name != "hf",
        "optim.muon_clip_threshold",
        "transformers' attention modules do not report their logits",
        "Use the native model (model=llama and its sizes), or optim.muon_clip_threshold=0",
    )
    _require(
        cfg.parallel.cp == 1,
        "optim.muon_clip_threshold",
        "context parallel's ring and all-to-all attention do not record the heads' largest logit "
        "(not built)",
        "Use parallel.cp=1 with optim.muon_clip_threshold, or optim.muon_clip_threshold=0",
    )
    _require(
        cfg.peft.method == "none",
        "optim.muon_clip_threshold",
        f"peft={cfg.peft.method} freezes the query and key projections QK-Clip would scale",
        "Use optim.muon_clip_threshold=0 with peft",
    )
    _require(
        cfg.parallel.zero_stage != 1 or cfg.precision.param_dtype == "float32",
        "optim.muon_clip_threshold",
        "ZeRO-1 with a narrower precision.param_dtype steps fp32 masters of its slices, which "
        "QK-Clip does not scale (not built)",
        "Use parallel.zero_stage=2 or 3, or precision.param_dtype=float32, with QK-Clip",
    )
    _require(
        not cfg.compile.enabled,
        "optim.muon_clip_threshold",
        "the heads' largest logits are recorded beside the attention kernels, eagerly (under "
        "torch.compile not built)",
        "Use compile.enabled=false with optim.muon_clip_threshold, or optim.muon_clip_threshold=0",
    )


def _check_muon(o: Any, p: Any) -> None:
    _require(
        0 <= o.muon_momentum < 1,
        "optim.muon_momentum",
        f"must be in [0, 1), got {o.muon_momentum}",
        "Use e.g. 0.95",
    )
    _require(
        o.muon_ns_steps >= 1,
        "optim.muon_ns_steps",
        f"must be >= 1, got {o.muon_ns_steps}",
        "Use 5 (the quintic coefficients are tuned for it)",
    )
    _require(
        o.muon_ns_dtype in MUON_NS_DTYPES,
        "optim.muon_ns_dtype",
        f"unknown dtype {o.muon_ns_dtype!r}",
        f"Choose one of {MUON_NS_DTYPES}",
    )
    _require(
        o.muon_scale in MUON_SCALES,
        "optim.muon_scale",
        f"unknown scale {o.muon_scale!r}",
        f"Choose one of {MUON_SCALES}",
    )
    _require(
        o.muon_bucket_mb > 0,
        "optim.muon_bucket_mb",
        f"must be > 0, got {o.muon_bucket_mb}",
        "Use e.g. 64",
    )
    _require(
        p.offload != "cpu",
        "parallel.offload",
        "offload=cpu keeps the parameters and gradients on the host, and Muon's all-to-alls of "
        "them run on the device's collectives (not built)",
        "Use parallel.offload=none with optim.name=muon",
    )
    _require(
        p.zero_stage != 1 or p.tp == 1,
        "parallel.zero_stage",
        "optim.name=muon under ZeRO-1 gathers each matrix from the ranks' slices of it, and under "
        "parallel.tp a rank's slice is of its tensor-parallel shard (not built yet)",
        "Use parallel.zero_stage=2 or 3 with parallel.tp > 1 (FSDP: each matrix gathered from "
        "its shards)",
    )


def _check_precision(
    precision: Any, tp: int, world_size: int, zero_stage: int, peft_method: str
) -> None:
    for key, allowed in (("param_dtype", PARAM_DTYPES), ("reduce_dtype", DTYPE_NAMES)):
        value = getattr(precision, key)
        _require(
            value in allowed,
            f"precision.{key}",
            f"unknown dtype {value!r}",
            f"Choose one of {allowed}",
        )
    _require(
        precision.cast in PRECISION_CASTS,
        "precision.cast",
        f"unknown cast {precision.cast!r}",
        f"Choose one of {PRECISION_CASTS}",
    )
    _require(
        precision.cast != "params" or world_size == 1,
        "precision.cast",
        f"params casts each parameter once on one device, and this run has {world_size} ranks "
        "(FSDP casts the parameters wherever a data-parallel dim shards them)",
        "Use precision.cast=auto",
    )
    _require(
        precision.cast != "params" or zero_stage != 1,
        "precision.cast",
        "params computes from bf16 copies of fp32 parameters, and ZeRO-1 (parallel.zero_stage=1) "
        "keeps its own: rounded parameters and fp32 masters",
        "Use precision.cast=auto, or parallel.zero_stage=3",
    )
    _require(
        precision.cast != "params" or peft_method != "qlora",
        "precision.cast",
        "params would keep a bf16 copy of every NF4 base weight from forward through backward, the "
        "memory QLoRA saves",
        "Use precision.cast=auto (autocast with peft=qlora on one rank)",
    )
    _require(
        precision.cast != "params" or precision.param_dtype != "float32",
        "precision.cast",
        "params makes a param_dtype copy of the parameters, and param_dtype=float32 computes in "
        "them as they are",
        "Use precision.param_dtype=bfloat16 with precision.cast=params, or precision.cast=auto",
    )
    _require(
        precision.float8.recipe in ("tensorwise", "rowwise"),
        "precision.float8.recipe",
        f"unknown recipe {precision.float8.recipe!r}",
        "Choose tensorwise or rowwise",
    )
    _require(
        precision.loss_scale_init > 0 and precision.loss_scale_growth_interval >= 1,
        "precision.loss_scale_init",
        "the loss scale must be > 0 and its growth interval >= 1",
        "Use e.g. loss_scale_init=65536 loss_scale_growth_interval=2000",
    )
    _require(
        not (precision.float8.enabled and precision.float8.recipe == "rowwise" and tp > 1),
        "precision.float8.recipe",
        "rowwise float8 has no tensor-parallel styles in torchao",
        "Use precision.float8.recipe=tensorwise with parallel.tp>1",
    )


def _check_memory(cfg: Any, layout: Layout) -> None:
    """Activation checkpointing and offload and the memory tracker, against the pipeline schedule
    and compile; sequence tiling."""
    mem, p, pp = cfg.memory, cfg.parallel, layout.pp
    _require(
        mem.activation_checkpointing in ("none", "full", "selective"),
        "memory.activation_checkpointing",
        f"unknown mode {mem.activation_checkpointing!r}",
        "Choose none, full or selective",
    )
    _require(
        mem.ac_every >= 0,
        "memory.ac_every",
        f"must be >= 0, got {mem.ac_every}",
        "0 = op-level selective; k = checkpoint every k-th block",
    )
    _require(
        mem.ac_policy in AC_POLICIES,
        "memory.ac_policy",
        f"unknown policy {mem.ac_policy!r}",
        f"Choose one of {tuple(AC_POLICIES)}",
    )
    _require(
        mem.ac_policy == "all_matmuls"
        or (mem.activation_checkpointing == "selective" and mem.ac_every == 0),
        "memory.ac_policy",
        f"{mem.ac_policy} chooses what op-level selective checkpointing keeps, and this run has "
        f"activation_checkpointing={mem.activation_checkpointing}, ac_every={mem.ac_every}",
        "Add memory.activation_checkpointing=selective memory.ac_every=0",
    )
    gathers = blocks_all_gather(layout.tp, p.sequence_parallel, layout.cp, p.cp_style)
    _require(
        not mem.ac_save_gathers
        or (mem.activation_checkpointing == "selective" and mem.ac_every == 0 and gathers),
        "memory.ac_save_gathers",
        "it keeps the all-gathers' outputs of op-level selective checkpointing, and this run has "
        f"activation_checkpointing={mem.activation_checkpointing}, ac_every={mem.ac_every}, "
        f"tp={layout.tp}, sequence_parallel={p.sequence_parallel}, cp={layout.cp}, "
        f"cp_style={p.cp_style}",
        "Use it with memory.activation_checkpointing=selective memory.ac_every=0 and parallel.tp>1 "
        "parallel.sequence_parallel=true (or parallel.cp>1 parallel.cp_style=allgather), or leave "
        "it false",
    )
    _require(
        not (cfg.logging.memory_breakdown and pp > 1),
        "logging.memory_breakdown",
        "the memory tracker follows one FSDP root, and a pipeline rank has one per stage",
        "Use it with parallel.pp=1",
    )
    zero_bubble = ("interleaved_zero_bubble", "zbv", "dualpipev")
    _require(
        not (mem.activation_checkpointing != "none" and pp > 1 and p.pp_schedule in zero_bubble),
        "memory.activation_checkpointing",
        f"cannot be combined with {p.pp_schedule}, whose split backward (input and weight "
        "gradients at different times) re-enters the checkpointed region twice",
        "Use parallel.pp_schedule=1f1b or interleaved_1f1b with activation checkpointing",
    )
    _require(
        not (
            mem.activation_offload
            and mem.activation_checkpointing == "selective"
            and mem.ac_every == 0
            and not cfg.compile.enabled
        ),
        "memory.activation_offload",
        "eager op-level selective checkpointing keeps the tensors its policy saves in checkpoint's "
        "own cache, which the offload's saved-tensor hooks never see (compiled, the graph saves "
        "them through autograd)",
        "Add compile.enabled=true, or use memory.activation_checkpointing=full or "
        "memory.ac_every>=1",
    )
    _check_tiling(cfg, layout)
    _check_loss_impl(cfg, layout)


def _check_loss_impl(cfg: Any, layout: Layout) -> None:
    """train.loss_impl=fused runs the head itself, from its whole weight, inside the model's forward
    (the model, built on meta, says whether its head is only that: ``linear_head``)."""
    impl = cfg.train.loss_impl
    _require(
        impl in ("chunked", "fused"),
        "train.loss_impl",
        f"unknown implementation {impl!r}",
        "Choose chunked or fused",
    )
    if impl != "fused":
        return
    _require(
        layout.tp == 1,
        "train.loss_impl",
        "fused takes the head's whole weight, and tensor parallel shards it on the vocabulary (the "
        "chunked loss completes each row over the tp ranks)",
        "Use train.loss_impl=chunked with parallel.tp>1",
    )
    _require(
        layout.pp == 1,
        "train.loss_impl",
        "fused runs inside the model's forward, and the pipeline schedule computes the loss from "
        "the last stage's logits outside it",
        "Use train.loss_impl=chunked with parallel.pp>1",
    )
    _require(
        cfg.memory.tile_loss <= 1,
        "train.loss_impl",
        "fused already holds one chunk of logits at a time; memory.tile_loss would recompute the "
        "head for nothing",
        "Use memory.tile_loss=0 with it",
    )
    _require(
        build_model(cfg.model).linear_head() is not None,
        "train.loss_impl",
        "fused runs the head as the final norm and one bias-free linear layer, and this model adds "
        "to it (logit scaling, soft-capping or a bias)",
        "Use train.loss_impl=chunked",
    )


def _check_tiling(cfg: Any, layout: Layout) -> None:
    """memory.tile_mlp and memory.tile_loss: tiles of the sequence a rank holds (seq_len / cp, and /
    tp where sequence parallel slices it); the loss's tiles only where the model computes the loss
    (no pipeline)."""
    seq_len = cfg.train.seq_len
    held = seq_len // layout.cp // (layout.tp if cfg.parallel.sequence_parallel else 1)
    where = f"train.seq_len={seq_len} over cp={layout.cp}" + (
        f" and sequence parallel's tp={layout.tp}" if cfg.parallel.sequence_parallel else ""
    )
    for key in ("tile_mlp", "tile_loss"):
        tiles = getattr(cfg.memory, key)
        _require(
            tiles >= 0,
            f"memory.{key}",
            f"must be >= 0, got {tiles}",
            "Use 0 or 1 (off) or a number of tiles",
        )
        _require(
            tiles <= 1 or held % tiles == 0,
            f"memory.{key}",
            f"{tiles} tiles do not divide the {held} tokens of a sequence each rank holds "
            f"({where})",
            f"Use one of {_divisors(held)}",
        )
    moe = cfg.model.moe
    _require(
        cfg.memory.tile_mlp <= 1
        or cfg.model.name != "llama"
        or moe.experts == 0
        or moe.dense_layers > 0,
        "memory.tile_mlp",
        "every layer of this model is a mixture of experts (model.moe.dense_layers=0), and tiling "
        "runs only dense feed-forwards",
        "Use memory.tile_mlp=0, or dense layers (model.moe.dense_layers)",
    )
    _require(
        cfg.memory.tile_loss <= 1 or layout.pp == 1,
        "memory.tile_loss",
        "the pipeline schedule computes the loss from the last stage's logits, outside the model, "
        "so the head cannot run in tiles there",
        "Use memory.tile_loss=0 with parallel.pp>1",
    )
