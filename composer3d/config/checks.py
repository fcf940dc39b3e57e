"""What the config's types cannot express: layouts that do not multiply to the world size, batch sizes that do
not divide, keys that only make sense together. One check function per concern; ``validate`` runs them all.

Validation runs before any process group exists, on every rank alike (and once in the launcher before any worker
starts), so a bad config fails fast with one message naming the key instead of hanging in a collective.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from composer3d.config.schema import ParallelConfig, TrainConfig
from composer3d.dtypes import DTYPES
from composer3d.errors import ConfigError
from composer3d.models import MODEL_REGISTRY
from composer3d.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from composer3d.parallel.pipeline import default_stages_per_rank, schedule_problem

DTYPE_NAMES = tuple(DTYPES)
PARAM_DTYPES = ("auto", *DTYPE_NAMES)
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adamw_fp8")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
DATASETS = ("stdlib", "synthetic", "text_files")
DATA_FORMATS = ("text", "chat")
ASYNC_MODES = ("none", "async", "async_pinned")


def _require(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}. {fix}")


def validate(cfg: Any, world_size: int) -> dict[str, int]:
    """Check every combination types cannot express; returns the resolved degrees. Raises ConfigError."""
    _require(world_size >= 1, "launch.nproc_per_node", f"world size must be >= 1, got {world_size}", "Use 1 or more")
    _check_known_keys(cfg)
    degrees = resolve_degrees(cfg.parallel, world_size)
    _check_model(cfg.model)
    _check_layout(cfg, degrees)
    _check_pipeline(cfg, degrees["pp"], degrees["dp_replicate"] * degrees["dp_shard"])
    _check_batch(cfg, degrees)
    _check_loop(cfg.train, cfg.eval)
    _check_generate(cfg.generate)
    _check_optimizer(cfg.optim, cfg.parallel)
    _check_precision(cfg.precision, degrees["tp"])
    _check_memory(cfg, degrees["pp"])
    _check_data(cfg.data, cfg.model)
    _check_checkpoint(cfg.checkpoint)
    _check_launch_and_logging(cfg.launch, cfg.logging, cfg.checkpoint)
    return degrees


def validate_data(cfg: Any) -> None:
    """The checks of what ``composer3d-prepare`` reads (the data and model keys); the layout is not its concern."""
    _check_known_keys(cfg)
    _check_model(cfg.model)
    _check_data(cfg.data, cfg.model)


def _check_known_keys(cfg: Any) -> None:
    """Hydra's ``+key=value`` adds a key the schema lacks (plain ``key=value`` is refused by Hydra); nothing would
    read it, so a typo would silently change nothing."""
    if not isinstance(cfg, DictConfig):
        return
    schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False)
    unknown = _unknown_keys(OmegaConf.to_container(cfg, resolve=False), schema, "")
    _require(not unknown, unknown[0] if unknown else "", "is not a composer3d setting (added with Hydra's +), so "
             "nothing would read it", "Remove it, or check the spelling against the keys `--cfg job` prints")


def _unknown_keys(given: dict, schema: dict, prefix: str) -> list[str]:
    found = []
    for key, value in given.items():
        if key in schema and not (isinstance(value, dict) and isinstance(schema[key], dict)):
            continue
        if isinstance(value, dict):  # an unknown section is named by its keys, as the user typed them
            section = schema.get(key)
            found += _unknown_keys(value, section if isinstance(section, dict) else {}, f"{prefix}{key}.")
        else:
            found.append(f"{prefix}{key}")
    return found


def validate_for_device(cfg: Any, degrees: dict[str, int], device_type: str) -> None:
    """What only fails on some devices (checked on every rank once the device is known, before any collective)."""
    if device_type != "cpu":
        return
    _require(cfg.checkpoint.async_mode != "async_pinned", "checkpoint.async_mode", "async_pinned stages into pinned "
             "host memory, which needs an accelerator; this run is on the CPU", "Use checkpoint.async_mode=async")
    _require(not (cfg.compile.enabled and degrees["tp"] > 1), "compile.enabled", "torch.compile of tensor-parallel "
             "blocks gives wrong gradients on the CPU backend in torch 2.13 (the loss leaves the uncompiled curve "
             "from the second step)", "Use compile.enabled=false with parallel.tp>1 on CPU")


def pipeline_microbatches(cfg: Any, dp: int) -> int:
    t = cfg.train
    return cfg.parallel.pp_microbatches or t.global_batch_size // (t.micro_batch_size * dp)


# ---------------------------------------------------------------------------------------------- layout

def resolve_degrees(p: ParallelConfig, world_size: int) -> dict[str, int]:
    """Degrees with ``dp_shard=-1`` inferred; raises ConfigError naming the key when they cannot multiply to world."""
    fixed = {"pp": p.pp, "dp_replicate": p.dp_replicate, "cp": p.cp, "tp": p.tp}
    for key, value in {**fixed, "ep": p.ep}.items():
        _require(value >= 1, f"parallel.{key}", f"must be >= 1, got {value}", "Use 1 to disable this dimension")
    _require(p.dp_shard == -1 or p.dp_shard >= 1, "parallel.dp_shard", f"must be >= 1 or -1, got {p.dp_shard}",
             "Use -1 to take what the world size leaves after the other degrees")
    others = math.prod(fixed.values())
    if p.dp_shard == -1:
        _require(world_size % others == 0, _culprit(fixed, world_size, max(fixed, key=fixed.get)),
                 f"pp×dp_replicate×cp×tp = {others} does not divide the world size {world_size}",
                 f"Choose degrees whose product divides {world_size} ({_divisors(world_size)})")
        dp_shard = world_size // others
    else:
        dp_shard = p.dp_shard
        _require(others * dp_shard == world_size, _culprit({**fixed, "dp_shard": dp_shard}, world_size, "dp_shard"),
                 f"pp×dp_replicate×dp_shard×cp×tp = {others * dp_shard} but the world size is {world_size}",
                 "Make the product equal the world size, or set parallel.dp_shard=-1 to infer it")
    return {**fixed, "dp_shard": dp_shard, "ep": p.ep}


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _culprit(degrees: dict[str, int], world_size: int, default: str) -> str:
    """The key to blame in a product error: the first degree that alone does not divide the world size."""
    for key, value in degrees.items():
        if value > 1 and world_size % value != 0:
            return f"parallel.{key}"
    return f"parallel.{default}"


def _check_layout(cfg: Any, degrees: dict[str, int]) -> None:
    """Dimensions and sharding stages that exist, and tensor/sequence parallel that this model can split."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    tp = degrees["tp"]
    _require(degrees["cp"] == 1, "parallel.cp", f"context parallel (cp={degrees['cp']}) is not available yet",
             "Use parallel.cp=1")
    _check_expert_parallel(cfg, degrees)
    _require(p.zero_stage in (1, 2, 3), "parallel.zero_stage", f"must be 1, 2 or 3, got {p.zero_stage}",
             "3 shards params+grads+optimizer state, 2 keeps params gathered through backward, "
             "1 replicates params and shards only optimizer state")
    if p.zero_stage == 1:
        _require(degrees["dp_replicate"] == 1 or degrees["dp_shard"] == 1, "parallel.zero_stage",
                 "ZeRO-1 replicates parameters over all data-parallel ranks, so it has no HSDP form "
                 f"(dp_replicate={degrees['dp_replicate']}, dp_shard={degrees['dp_shard']})",
                 "Use zero_stage=2 or 3 for HSDP, or put all data-parallel ranks in one dimension")
    _require(p.offload in ("none", "cpu"), "parallel.offload", f"unknown offload {p.offload!r}", "Choose none or cpu")
    _require(p.offload == "none" or p.zero_stage != 1, "parallel.offload",
             "CPU offload is FSDP's (it offloads the shards it owns); ZeRO-1 keeps replicated params",
             "Use parallel.zero_stage=2 or 3 with parallel.offload=cpu")
    if tp > 1:
        problem = MODEL_REGISTRY[m.name].tensor_parallel_problem(m)
        _require(problem is None, "parallel.tp", str(problem), "Use parallel.tp=1 (FSDP and pipeline parallel work)")
    for key, value in MODEL_REGISTRY[m.name].tp_split_sizes(m):
        _require(value % tp == 0, "parallel.tp", f"tp={tp} does not divide {key}={value}, which tensor parallel splits",
                 f"Choose parallel.tp among the common divisors of the split sizes, or change {key}")
    if p.sequence_parallel:
        _require(tp > 1, "parallel.sequence_parallel", "needs tensor parallel (tp > 1) to shard the sequence over",
                 "Set parallel.tp>1 or parallel.sequence_parallel=false")
        _require(t.seq_len % tp == 0, "train.seq_len", f"seq_len={t.seq_len} is not divisible by tp={tp}, "
                 "which sequence parallel shards it over", f"Use a multiple of {tp}")


def _check_expert_parallel(cfg: Any, degrees: dict[str, int]) -> None:
    """ep borrows its ranks from dp_shard and shards each MoE layer's experts: both must divide."""
    ep, m, p = degrees["ep"], cfg.model, cfg.parallel
    if ep == 1:
        return
    experts, problem = MODEL_REGISTRY[m.name].expert_parallel(m)
    what = f"{m.path} is a dense model" if m.name == "hf" else "the model is dense (model.moe.experts=0)"
    _require(experts > 0, "parallel.ep", f"expert parallel (ep={ep}) needs a mixture-of-experts model, and {what}",
             "Use parallel.ep=1, or a mixture-of-experts model (model=tiny_moe, model.moe.experts>0, or model=hf with "
             "a Hugging Face MoE model)")
    _require(problem is None, "parallel.ep", f"expert parallel (ep={ep}) of {m.path}: {problem}",
             "Use parallel.ep=1 (FSDP and pipeline parallel work)")
    _require(experts % ep == 0, "parallel.ep", f"ep={ep} does not divide the {experts} routed experts of each MoE "
             "layer (each ep rank holds experts/ep of every MoE layer)", f"Choose parallel.ep among {_divisors(experts)}")
    _require(degrees["dp_shard"] % ep == 0, "parallel.ep", f"ep={ep} does not divide dp_shard={degrees['dp_shard']}: "
             "expert parallel takes its ranks from the data-parallel shard dimension",
             f"Choose parallel.ep among {_divisors(degrees['dp_shard'])}, or give dp_shard a multiple of {ep}")
    _require(p.zero_stage != 1, "parallel.zero_stage", "ZeRO-1 replicates every parameter over the data-parallel "
             f"ranks, but under ep={ep} each rank holds only its experts", "Use parallel.zero_stage=2 or 3 with ep>1")


def _check_pipeline(cfg: Any, pp: int, dp: int) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    _require(p.reshard_after_forward in ("default", "always", "never"), "parallel.reshard_after_forward",
             f"unknown policy {p.reshard_after_forward!r}", "Choose default, always or never")
    _require(p.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", f"unknown schedule {p.pp_schedule!r}",
             f"Choose one of {list(PP_SCHEDULES)}")
    if pp == 1:
        return
    stages_per_rank = p.pp_stages_per_rank or default_stages_per_rank(p.pp_schedule)
    stages = pp * stages_per_rank
    _require(stages <= m.n_layers, "parallel.pp", f"pp={pp} × pp_stages_per_rank={stages_per_rank} = {stages} stages "
             f"but the model has {m.n_layers} layers (each stage needs at least one)",
             "Lower parallel.pp or parallel.pp_stages_per_rank")
    if m.name == "hf":
        from composer3d.models.hf import load_hf_config
        from composer3d.models.hf_router_loss import wants_router_loss

        _require(not m.tie_embeddings, "parallel.pp", f"{m.path}/config.json ties the head to the embedding "
                 "(tie_word_embeddings), and a tied head cannot be split from its embedding across pipeline stages",
                 "Use parallel.pp=1 (FSDP and TP/SP) for this model")
        _require(not wants_router_loss(load_hf_config(m.path)), "parallel.pp", f"{m.path}/config.json sets "
                 "output_router_logits: true, and transformers' router load-balancing loss pools every MoE layer of "
                 "a forward, of which a pipeline stage holds only some", "Use parallel.pp=1 (FSDP, TP/SP and EP) "
                 "for this model, or set output_router_logits to false in config.json to train without that loss")
    _require(not m.tie_embeddings, "model.tie_embeddings", "a tied head cannot be split from its embedding across "
             "pipeline stages", "Use model.tie_embeddings=false with parallel.pp>1")
    local_batch = t.global_batch_size // dp
    microbatches = pipeline_microbatches(cfg, dp)
    _require(microbatches >= 1 and local_batch % microbatches == 0, "parallel.pp_microbatches",
             f"{microbatches} microbatches do not divide the {local_batch} sequences each data-parallel rank gets "
             f"(global_batch_size {t.global_batch_size} / dp {dp})", f"Use a divisor of {local_batch}")
    problem = schedule_problem(p.pp_schedule, pp, stages_per_rank, microbatches)
    _require(problem is None, "parallel.pp_microbatches" if "microbatches" in (problem or "") else "parallel.pp_schedule",
             str(problem), "Raise train.global_batch_size or parallel.pp_microbatches, or pick another schedule")


# ---------------------------------------------------------------------------------------------- model and batch

def resolve_model_config(m: Any) -> None:
    """Fill what a model config leaves to its source: model=hf reads its sizes from <model.path>/config.json."""
    if m.name == "hf":
        from composer3d.models.hf import fill_model_config

        fill_model_config(m)


def _check_model(m: Any) -> None:
    _require(m.name in MODEL_REGISTRY, "model.name", f"unknown model {m.name!r}",
             f"Choose one of {sorted(MODEL_REGISTRY)} (or a config in the model= group)")
    if m.name == "hf":  # sizes come from its config.json (resolve_model_config); transformers checks them
        _require(bool(m.path), "model.path", "model=hf needs the model directory", "Set model.path=<dir>")
        return
    for key in ("dim", "n_layers", "n_heads", "vocab_size"):
        value = getattr(m, key)
        _require(value >= 1, f"model.{key}", f"must be >= 1, got {value}", "Use a positive size")
    _require(m.head_dim in (None, m.dim // m.n_heads), "model.head_dim", f"the native llama's heads are "
             f"dim / n_heads = {m.dim // m.n_heads} wide, got {m.head_dim}", "Use model.head_dim=null")
    _require(m.n_kv_heads is None or m.n_kv_heads >= 1, "model.n_kv_heads", f"must be >= 1, got {m.n_kv_heads}",
             "Use null for as many kv heads as query heads")
    n_kv = m.n_kv_heads or m.n_heads
    _require(m.dim % m.n_heads == 0, "model.n_heads", f"does not divide model.dim={m.dim}",
             f"Choose n_heads among {_divisors(m.dim)}")
    _require(m.n_heads % n_kv == 0, "model.n_kv_heads", f"{n_kv} does not divide model.n_heads={m.n_heads} "
             "(grouped-query attention shares each kv head among a whole number of query heads)",
             f"Choose n_kv_heads among {_divisors(m.n_heads)}")
    _require((m.dim // m.n_heads) % 2 == 0, "model.n_heads", f"head dim {m.dim // m.n_heads} is odd; RoPE rotates pairs",
             "Choose n_heads so that dim / n_heads is even")
    _check_moe(m)


def _check_moe(m: Any) -> None:
    moe = m.moe
    _require(moe.experts >= 0, "model.moe.experts", f"must be >= 0, got {moe.experts}", "Use 0 for a dense model")
    if moe.experts == 0:
        return
    _require(1 <= moe.top_k <= moe.experts, "model.moe.top_k", f"must be between 1 and experts={moe.experts}, got "
             f"{moe.top_k}", "Route each token to a few experts, e.g. 2")
    _require(moe.shared_experts >= 0, "model.moe.shared_experts", f"must be >= 0, got {moe.shared_experts}", "Use 0 or 1")
    _require(moe.expert_hidden_dim is None or moe.expert_hidden_dim >= 1, "model.moe.expert_hidden_dim",
             f"must be >= 1, got {moe.expert_hidden_dim}", "Use null for the dense layers' width")
    _require(0 <= moe.dense_layers < m.n_layers, "model.moe.dense_layers", f"must be between 0 and n_layers-1="
             f"{m.n_layers - 1} (at least one MoE layer), got {moe.dense_layers}", "Use 0 or 1")
    _require(moe.score_func in ("softmax", "sigmoid"), "model.moe.score_func", f"unknown {moe.score_func!r}",
             "Choose softmax or sigmoid")
    _require(moe.score_func == "softmax" or moe.normalize_top_k or moe.top_k == 1, "model.moe.normalize_top_k",
             "sigmoid scores do not sum to one: unnormalized, the mixing weights of top_k > 1 experts would add up "
             "to as much as top_k", "Use model.moe.normalize_top_k=true with score_func=sigmoid")
    for key in ("aux_loss_coef", "bias_update_rate", "capacity_factor"):
        value = getattr(moe, key)
        _require(value >= 0, f"model.moe.{key}", f"must be >= 0, got {value}", "Use 0 to turn it off")
    _require(moe.route_scale > 0, "model.moe.route_scale", f"must be > 0, got {moe.route_scale}", "Use 1.0")


def _check_batch(cfg: Any, degrees: dict[str, int]) -> None:
    """Sequence length within the model's, and a global batch that splits evenly over dp ranks × micro-batches."""
    m, t = cfg.model, cfg.train
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    _require(t.seq_len >= 1 and t.seq_len <= m.max_seq_len, "train.seq_len",
             f"must be in [1, model.max_seq_len={m.max_seq_len}], got {t.seq_len}", "Lower train.seq_len")
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}", "Use 1+")
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size >= 1 and t.global_batch_size % per_step == 0, "train.global_batch_size",
             f"{t.global_batch_size} is not divisible by micro_batch_size × dp = {t.micro_batch_size} × {dp} "
             f"= {per_step}", f"Use a multiple of {per_step}, e.g. {per_step * max(1, t.global_batch_size // per_step)}")


# ---------------------------------------------------------------------------------------------- the loop

def _check_loop(t: Any, eval_cfg: Any) -> None:
    """Steps, evaluation, non-finite handling and clipping."""
    _require(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}", "Use 0 to never evaluate")
    _require(t.eval_every == 0 or bool(eval_cfg.path), "eval.path", "train.eval_every is set but there is no "
             "evaluation file", "Set eval.path=<text file>, or train.eval_every=0")
    _require(eval_cfg.max_windows >= 0, "eval.max_windows", f"must be >= 0, got {eval_cfg.max_windows}",
             "Use 0 for all windows")
    _require(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}", "Use 1 or more")
    _require(t.on_nonfinite in ("stop", "skip"), "train.on_nonfinite", f"unknown policy {t.on_nonfinite!r}",
             "Choose stop (exit at the first non-finite step) or skip (drop that update)")
    _require(t.max_skipped_steps >= 1, "train.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}",
             "Use e.g. 10")
    _require(t.gc_every >= 0, "train.gc_every", f"must be >= 0, got {t.gc_every}",
             "Use e.g. 50 (collect every 50 steps), or 0 for Python's automatic collection")
    _require(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {t.grad_clip}", "Use 0 to disable clipping")


def _check_generate(g: Any) -> None:
    """composer3d-generate's decoding settings (the prompt's length is checked once it is tokenized)."""
    _require(g.max_new_tokens >= 1, "generate.max_new_tokens", f"must be >= 1, got {g.max_new_tokens}", "Use e.g. 128")
    _require(g.temperature >= 0, "generate.temperature", f"must be >= 0, got {g.temperature}",
             "Use 0 for greedy decoding, or e.g. 0.8 to sample")
    _require(0 < g.top_p <= 1, "generate.top_p", f"must be in (0, 1], got {g.top_p}", "Use 1 for no nucleus cut, or e.g. 0.9")
    _require(g.output in ("text", "json"), "generate.output", f"unknown output {g.output!r}", "Choose text or json")


def _check_optimizer(o: Any, p: Any) -> None:
    _require(o.name in OPTIMIZERS, "optim.name", f"unknown optimizer {o.name!r}", f"Choose one of {OPTIMIZERS}")
    _require(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}", "Use e.g. 3e-4")
    _require(o.schedule in SCHEDULES, "optim.schedule", f"unknown schedule {o.schedule!r}", f"Choose one of {SCHEDULES}")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas",
             f"must be two numbers in [0, 1), got {list(o.betas)}", "Use e.g. [0.9,0.95]")
    _require(o.implementation in OPTIMIZER_IMPLEMENTATIONS, "optim.implementation",
             f"unknown implementation {o.implementation!r}", f"Choose one of {OPTIMIZER_IMPLEMENTATIONS}")
    _require(o.name == "adamw" or o.implementation == "auto", "optim.implementation", f"{o.name} is torchao's "
             "compiled low-bit AdamW, which has no fused/foreach/for_loop variants", "Use optim.implementation=auto")
    _require(0 <= o.warmup_steps, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}", "Use 0 for none")
    _require(o.name == "adamw" or p.zero_stage != 1, "optim.name", f"{o.name} keeps quantized state that ZeRO-1's "
             "slicing cannot cut", "Use optim.name=adamw with zero_stage=1, or zero_stage 2/3 (state sharded by FSDP)")


def _check_precision(precision: Any, tp: int) -> None:
    for key, allowed in (("param_dtype", PARAM_DTYPES), ("reduce_dtype", DTYPE_NAMES)):
        value = getattr(precision, key)
        _require(value in allowed, f"precision.{key}", f"unknown dtype {value!r}", f"Choose one of {allowed}")
    _require(precision.float8.recipe in ("tensorwise", "rowwise"), "precision.float8.recipe",
             f"unknown recipe {precision.float8.recipe!r}", "Choose tensorwise or rowwise")
    _require(precision.loss_scale_init > 0 and precision.loss_scale_growth_interval >= 1,
             "precision.loss_scale_init", "the loss scale must be > 0 and its growth interval >= 1",
             "Use e.g. loss_scale_init=65536 loss_scale_growth_interval=2000")
    _require(not (precision.float8.enabled and precision.float8.recipe == "rowwise" and tp > 1),
             "precision.float8.recipe", "rowwise float8 has no tensor-parallel styles in torchao",
             "Use precision.float8.recipe=tensorwise with parallel.tp>1")


def _check_memory(cfg: Any, pp: int) -> None:
    """Activation checkpointing and the memory tracker, against the pipeline schedule."""
    mem, p = cfg.memory, cfg.parallel
    _require(mem.activation_checkpointing in ("none", "full", "selective"), "memory.activation_checkpointing",
             f"unknown mode {mem.activation_checkpointing!r}", "Choose none, full or selective")
    _require(mem.ac_every >= 0, "memory.ac_every", f"must be >= 0, got {mem.ac_every}",
             "0 = op-level selective; k = checkpoint every k-th block")
    _require(not (cfg.logging.memory_breakdown and pp > 1), "logging.memory_breakdown", "the memory tracker follows "
             "one FSDP root, and a pipeline rank has one per stage", "Use it with parallel.pp=1")
    zero_bubble = ("interleaved_zero_bubble", "zbv", "dualpipev")
    _require(not (mem.activation_checkpointing != "none" and pp > 1 and p.pp_schedule in zero_bubble),
             "memory.activation_checkpointing", f"cannot be combined with {p.pp_schedule}, whose split backward "
             "(input and weight gradients at different times) re-enters the checkpointed region twice",
             "Use parallel.pp_schedule=1f1b or interleaved_1f1b with activation checkpointing")


# ---------------------------------------------------------------------------------------------- data and outputs

def _check_data(d: Any, m: Any) -> None:
    _require(d.name in DATASETS, "data.name", f"unknown dataset {d.name!r}", f"Choose one of {DATASETS}")
    if d.prepared:
        _require(d.name == "text_files", "data.prepared", f"holds a corpus of files, and data.name={d.name} reads "
                 "none", "Use data=text_files (or data=chat) with data.prepared")
    _require(d.prepare_workers >= 0, "data.prepare_workers", f"must be >= 0, got {d.prepare_workers}",
             "Use 0 for one per CPU core")
    if d.name == "text_files":
        _require(len(d.paths) > 0 or bool(d.prepared), "data.paths", "text_files needs at least one file, "
                 "directory or glob", "Set data.paths=[/path/to/corpus/*.jsonl], or data.prepared=<prepared dir>")
    else:
        _require(not d.paths, "data.paths", f"is set, but data.name={d.name} reads no files: the run would train on "
                 f"the {d.name} corpus instead", "Add data=text_files to train on these files")
    _require(d.format in DATA_FORMATS, "data.format", f"unknown format {d.format!r}", f"Choose one of {DATA_FORMATS}")
    if d.format == "chat":
        _require(d.name == "text_files", "data.format", f"chat reads conversations from .jsonl/.parquet "
                 f"files, and data.name={d.name} has none", "Use data=text_files data.paths=[chats.jsonl]")
        _require(bool(d.tokenizer) or m.name == "hf", "data.tokenizer", "data.format=chat needs a Hugging "
                 "Face tokenizer with a chat template, and the byte-level one (data.tokenizer=null) has none",
                 "Set data.tokenizer=<tokenizer directory>, or use model=hf (its own tokenizer)")
        _require(bool(d.messages_field), "data.messages_field", "is empty", "Use e.g. messages")
    else:
        _require(bool(d.text_field), "data.text_field", "is empty", "Use e.g. text")
    _require(d.max_tokens >= 0, "data.max_tokens", f"must be >= 0, got {d.max_tokens}", "Use 0 for no cap")
    if d.name == "synthetic":
        _require(d.synthetic_sequences >= 1, "data.synthetic_sequences",
                 f"must be >= 1, got {d.synthetic_sequences}", "Use e.g. 4096")


def _check_checkpoint(c: Any) -> None:
    _require(c.interval >= 0, "checkpoint.interval", f"must be >= 0, got {c.interval}", "Use 0 to save only at the end")
    _require(c.keep_last >= 0, "checkpoint.keep_last", f"must be >= 0, got {c.keep_last}", "Use 0 to keep all")
    _require(c.async_mode in ASYNC_MODES, "checkpoint.async_mode", f"unknown mode {c.async_mode!r}",
             f"Choose one of {ASYNC_MODES}")
    _require(c.export_dtype in DTYPE_NAMES, "checkpoint.export_dtype", f"unknown dtype {c.export_dtype!r}",
             f"Choose one of {DTYPE_NAMES}")


def _check_launch_and_logging(launch: Any, logging: Any, checkpoint: Any) -> None:
    _require(launch.nproc_per_node >= 1, "launch.nproc_per_node", f"must be >= 1, got {launch.nproc_per_node}",
             "Use 1 or more")
    _require(launch.timeout_minutes > 0, "launch.timeout_minutes", f"must be > 0, got {launch.timeout_minutes}",
             "Use e.g. 30 (minutes; fractions allowed)")
    _require(launch.max_restarts >= 0, "launch.max_restarts", f"must be >= 0, got {launch.max_restarts}",
             "Use 0 for no restarts")
    # A restarted group continues from the newest checkpoint in its checkpoint.dir: without one (or with a fixed
    # resume point) it would start over and train the same steps again.
    _require(launch.max_restarts == 0 or (checkpoint.enabled and checkpoint.resume == "auto"), "launch.max_restarts",
             f"restarts resume from the last checkpoint, but checkpoint.enabled={checkpoint.enabled} and "
             f"checkpoint.resume={checkpoint.resume}", "Use checkpoint.enabled=true checkpoint.resume=auto (the "
             "defaults) with a checkpoint.interval, or launch.max_restarts=0")
    _require(logging.peak_tflops is None or logging.peak_tflops > 0, "logging.peak_tflops",
             f"must be > 0, got {logging.peak_tflops}", "Use null for the table's value")
    _require(logging.log_every >= 1, "logging.log_every", f"must be >= 1, got {logging.log_every}", "Use 1+")
