"""Typed configuration schema (the public interface) and its validation.

Every key a user may type on the command line is a field here. The dataclasses are registered in Hydra's
ConfigStore so overrides are type-checked by OmegaConf, and ``validate`` checks the combinations that types
cannot express. Validation runs before any process group exists, on every rank alike, so a bad layout fails
fast with one message instead of hanging in a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from composer3d.errors import ConfigError
from composer3d.models import MODEL_REGISTRY
from composer3d.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from composer3d.parallel.pipeline import default_stages_per_rank, schedule_problem


@dataclass
class ModelConfig:
    # registry key: "llama" is the native Llama-3 style decoder, "hf" any transformers causal LM (model=hf)
    name: str = MISSING
    # hf: local directory (or hub id already in the local cache) holding config.json and safetensors weights.
    # The size fields below are then read from its config.json at launch (whatever the YAML says).
    path: str | None = None
    pretrained: bool = True  # hf: load the weights from path; false: train from scratch (HF's own init, seeded)
    attn_implementation: str | None = None  # hf: sdpa | eager | ...; None: what transformers picks for the model
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    head_dim: int | None = None  # None: dim / n_heads (the native llama's only choice); model=hf reads its own
    vocab_size: int = MISSING
    ffn_hidden_dim: int | None = None  # None: Llama-3 rule from dim, multiple_of and ffn_dim_multiplier
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    init_std: float = 0.02


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | synthetic | text_files
    # text_files: .txt (one document per file), .jsonl or .parquet (one document per row) files, directories
    # or globs; one kind per run
    paths: list[str] = field(default_factory=list)
    format: str = "text"  # text: documents | chat: conversations, trained on the assistant replies only (SFT)
    text_field: str = "text"  # format=text, .jsonl/.parquet: the field holding the document text
    messages_field: str = "messages"  # format=chat: the field holding the list of {role, content} messages
    # local directory of a Hugging Face tokenizer; None = model=hf's own (model.path), else byte-level
    tokenizer: str | None = None
    # packed documents: position_ids restart at each document and the previous document's last token (eos)
    # takes no loss; HF models also attend within documents only (the native llama: loss masking only)
    document_masking: bool = True
    max_tokens: int = 4_000_000  # cap on tokens read from the corpus (0 = no cap)
    synthetic_sequences: int = 4096  # synthetic: number of distinct random sequences


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves after the other degrees
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 3
    # FSDP: free gathered params after forward? default: yes for zero_stage 3 without PP; with PP no, because
    # each microbatch would gather them again in forward and once more in backward. always | never override.
    reshard_after_forward: str = "default"
    offload: str = "none"  # none | cpu: FSDP keeps params, grads and the optimizer step on the CPU (ZeRO-Offload)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv | dualpipev
    pp_microbatches: int | None = None  # None: global_batch_size / (micro_batch_size × dp)
    pp_stages_per_rank: int | None = None  # None: 1, or 2 for interleaved / looped / V-shaped schedules


@dataclass
class Float8Config:
    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise (torchao)


@dataclass
class PrecisionConfig:
    param_dtype: str = "auto"  # compute dtype of params: auto = bfloat16 on an accelerator, float32 on the CPU
    reduce_dtype: str = "float32"  # gradient reduction dtype (master weights and optimizer stay float32)
    loss_scale_init: float = 65536.0  # float16 only: dynamic loss scaling
    loss_scale_growth_interval: int = 2000
    float8: Float8Config = field(default_factory=Float8Config)


@dataclass
class MemoryConfig:
    activation_checkpointing: str = "none"  # none | full | selective
    ac_every: int = 0  # selective: 0 = op-level policy in every block; k >= 1 = every k-th block fully


@dataclass
class CompileConfig:
    enabled: bool = False  # torch.compile each block (after activation checkpointing, before FSDP)


@dataclass
class TrainLoopConfig:
    steps: int = 100
    global_batch_size: int = 16  # sequences per optimizer step, across all data-parallel ranks
    micro_batch_size: int = 4  # sequences per forward/backward on one data-parallel rank
    seq_len: int = 128
    seed: int = 0
    deterministic: bool = False
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    eval_every: int = 0  # evaluate on eval.path every N steps (and after the last); 0: never
    # a loss or gradient norm that is NaN/inf: stop (exit 3 naming the step, detected at the next metrics read-back,
    # which every checkpoint waits for, so no checkpoint holds that state) | skip (check every step — one host
    # sync — and drop that update)
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 10  # updates dropped in a row (non-finite, or fp16 overflow) before the run stops


@dataclass
class EvalConfig:
    path: str | None = None  # UTF-8 text file: loss/perplexity over its train.seq_len-token windows (composer3d-eval)
    max_windows: int = 0  # evaluate at most this many windows (0: all)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    # adamw's kernels: auto (fused where the device has them, else foreach, else a loop) | fused | foreach | for_loop
    implementation: str = "auto"


@dataclass
class RunConfig:
    dir: str = MISSING
    name: str = "composer3d"


@dataclass
class LoggingConfig:
    log_every: int = 1
    wandb: bool = False
    wandb_project: str = "composer3d"
    tensorboard: bool = False
    progress_bar: bool = True
    memory_breakdown: bool = False  # measure step 2's peak memory by category (activations, params, …) into run.json
    # peak FLOP/s of one device in TFLOP/s, for MFU; None: from composer3d.flops' table by device name (the CPU
    # and unlisted devices get TFLOP/s only)
    peak_tflops: float | None = None


@dataclass
class CheckpointConfig:
    enabled: bool = True
    dir: str | None = None  # None: <run.dir>/checkpoints
    interval: int = 0  # save every N steps (0: only at the end of training)
    keep_last: int = 3  # committed checkpoints kept (0: all)
    async_mode: str = "none"  # none | async (write in a background thread) | async_pinned (stage to pinned memory)
    resume: str = "auto"  # auto (newest complete checkpoint in dir, if any) | none | <path to a step-N directory>
    model_only_final: bool = False  # the last checkpoint holds only the weights, in export_dtype
    export_dtype: str = "bfloat16"


@dataclass
class LaunchConfig:
    nproc_per_node: int = 1
    device: str = "auto"  # auto | cpu | cuda | any torch accelerator type


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)


# ---------------------------------------------------------------------------------------------- validation

DTYPES = ("float32", "bfloat16", "float16")
PARAM_DTYPES = ("auto", *DTYPES)
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adamw_fp8")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
DATASETS = ("stdlib", "synthetic", "text_files")
DATA_FORMATS = ("text", "chat")
ASYNC_MODES = ("none", "async", "async_pinned")


def _require(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}. {fix}")


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


def validate(cfg: Any, world_size: int) -> dict[str, int]:
    """Check every combination types cannot express; returns the resolved degrees. Raises ConfigError."""
    _require(world_size >= 1, "launch.nproc_per_node", f"world size must be >= 1, got {world_size}", "Use 1 or more")
    p, m, t, o = cfg.parallel, cfg.model, cfg.train, cfg.optim
    degrees = resolve_degrees(p, world_size)
    tp, pp, dp = degrees["tp"], degrees["pp"], degrees["dp_replicate"] * degrees["dp_shard"]

    _check_model(m)
    _check_pipeline(cfg, pp, dp)
    _require(degrees["cp"] == 1, "parallel.cp", f"context parallel (cp={degrees['cp']}) is not available yet",
             "Use parallel.cp=1")
    _require(degrees["ep"] == 1, "parallel.ep", f"expert parallel (ep={degrees['ep']}) needs a mixture-of-experts "
             "model, and the available models are dense", "Use parallel.ep=1")
    _require(p.zero_stage in (1, 2, 3), "parallel.zero_stage", f"must be 1, 2 or 3, got {p.zero_stage}",
             "3 shards params+grads+optimizer state, 2 keeps params gathered through backward, "
             "1 replicates params and shards only optimizer state")
    if p.zero_stage == 1:
        _require(degrees["dp_replicate"] == 1 or degrees["dp_shard"] == 1, "parallel.zero_stage",
                 "ZeRO-1 replicates parameters over all data-parallel ranks, so it has no HSDP form "
                 f"(dp_replicate={degrees['dp_replicate']}, dp_shard={degrees['dp_shard']})",
                 "Use zero_stage=2 or 3 for HSDP, or put all data-parallel ranks in one dimension")
    if tp > 1:
        problem = MODEL_REGISTRY[m.name].tensor_parallel_problem(m)
        _require(problem is None, "parallel.tp", str(problem), "Use parallel.tp=1 (FSDP and pipeline parallel work)")
    for key, value in MODEL_REGISTRY[m.name].tp_split_sizes(m):
        _require(value % tp == 0, "parallel.tp", f"tp={tp} does not divide {key}={value}, which tensor parallel splits",
                 f"Choose parallel.tp among the common divisors of the split sizes, or change {key}")
    _require(t.seq_len >= 1 and t.seq_len <= m.max_seq_len, "train.seq_len",
             f"must be in [1, model.max_seq_len={m.max_seq_len}], got {t.seq_len}", "Lower train.seq_len")
    if p.sequence_parallel:
        _require(tp > 1, "parallel.sequence_parallel", "needs tensor parallel (tp > 1) to shard the sequence over",
                 "Set parallel.tp>1 or parallel.sequence_parallel=false")
        _require(t.seq_len % tp == 0, "train.seq_len", f"seq_len={t.seq_len} is not divisible by tp={tp}, "
                 "which sequence parallel shards it over", f"Use a multiple of {tp}")
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}", "Use 1+")
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size >= 1 and t.global_batch_size % per_step == 0, "train.global_batch_size",
             f"{t.global_batch_size} is not divisible by micro_batch_size × dp = {t.micro_batch_size} × {dp} "
             f"= {per_step}", f"Use a multiple of {per_step}, e.g. {per_step * max(1, t.global_batch_size // per_step)}")
    _require(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}", "Use 0 to never evaluate")
    _require(t.eval_every == 0 or bool(cfg.eval.path), "eval.path", "train.eval_every is set but there is no "
             "evaluation file", "Set eval.path=<text file>, or train.eval_every=0")
    _require(cfg.eval.max_windows >= 0, "eval.max_windows", f"must be >= 0, got {cfg.eval.max_windows}",
             "Use 0 for all windows")
    _require(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}", "Use 1 or more")
    _require(t.on_nonfinite in ("stop", "skip"), "train.on_nonfinite", f"unknown policy {t.on_nonfinite!r}",
             "Choose stop (exit at the first non-finite step) or skip (drop that update)")
    _require(t.max_skipped_steps >= 1, "train.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}",
             "Use e.g. 10")
    _require(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {t.grad_clip}", "Use 0 to disable clipping")

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

    for key, allowed in (("param_dtype", PARAM_DTYPES), ("reduce_dtype", DTYPES)):
        value = getattr(cfg.precision, key)
        _require(value in allowed, f"precision.{key}", f"unknown dtype {value!r}", f"Choose one of {allowed}")
    _require(cfg.precision.float8.recipe in ("tensorwise", "rowwise"), "precision.float8.recipe",
             f"unknown recipe {cfg.precision.float8.recipe!r}", "Choose tensorwise or rowwise")
    _require(cfg.precision.loss_scale_init > 0 and cfg.precision.loss_scale_growth_interval >= 1,
             "precision.loss_scale_init", "the loss scale must be > 0 and its growth interval >= 1",
             "Use e.g. loss_scale_init=65536 loss_scale_growth_interval=2000")
    _require(not (cfg.precision.float8.enabled and cfg.precision.float8.recipe == "rowwise" and tp > 1),
             "precision.float8.recipe", "rowwise float8 has no tensor-parallel styles in torchao",
             "Use precision.float8.recipe=tensorwise with parallel.tp>1")
    _require(o.name == "adamw" or p.zero_stage != 1, "optim.name", f"{o.name} keeps quantized state that ZeRO-1's "
             "slicing cannot cut", "Use optim.name=adamw with zero_stage=1, or zero_stage 2/3 (state sharded by FSDP)")
    mem = cfg.memory
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
    _require(p.offload in ("none", "cpu"), "parallel.offload", f"unknown offload {p.offload!r}", "Choose none or cpu")
    _require(p.offload == "none" or p.zero_stage != 1, "parallel.offload",
             "CPU offload is FSDP's (it offloads the shards it owns); ZeRO-1 keeps replicated params",
             "Use parallel.zero_stage=2 or 3 with parallel.offload=cpu")
    _require(cfg.data.name in DATASETS, "data.name", f"unknown dataset {cfg.data.name!r}", f"Choose one of {DATASETS}")
    if cfg.data.name == "text_files":
        _require(len(cfg.data.paths) > 0, "data.paths", "text_files needs at least one file, directory or glob",
                 "Set data.paths=[/path/to/corpus/*.jsonl]")
    _require(cfg.data.format in DATA_FORMATS, "data.format", f"unknown format {cfg.data.format!r}",
             f"Choose one of {DATA_FORMATS}")
    if cfg.data.format == "chat":
        _require(cfg.data.name == "text_files", "data.format", f"chat reads conversations from .jsonl/.parquet "
                 f"files, and data.name={cfg.data.name} has none", "Use data=text_files data.paths=[chats.jsonl]")
        _require(bool(cfg.data.tokenizer) or m.name == "hf", "data.tokenizer", "data.format=chat needs a Hugging "
                 "Face tokenizer with a chat template, and the byte-level one (data.tokenizer=null) has none",
                 "Set data.tokenizer=<tokenizer directory>, or use model=hf (its own tokenizer)")
        _require(bool(cfg.data.messages_field), "data.messages_field", "is empty", "Use e.g. messages")
    else:
        _require(bool(cfg.data.text_field), "data.text_field", "is empty", "Use e.g. text")
    _require(cfg.data.max_tokens >= 0, "data.max_tokens", f"must be >= 0, got {cfg.data.max_tokens}",
             "Use 0 for no cap")
    if cfg.data.name == "synthetic":
        _require(cfg.data.synthetic_sequences >= 1, "data.synthetic_sequences",
                 f"must be >= 1, got {cfg.data.synthetic_sequences}", "Use e.g. 4096")
    c = cfg.checkpoint
    _require(c.interval >= 0, "checkpoint.interval", f"must be >= 0, got {c.interval}", "Use 0 to save only at the end")
    _require(c.keep_last >= 0, "checkpoint.keep_last", f"must be >= 0, got {c.keep_last}", "Use 0 to keep all")
    _require(c.async_mode in ASYNC_MODES, "checkpoint.async_mode", f"unknown mode {c.async_mode!r}",
             f"Choose one of {ASYNC_MODES}")
    _require(c.export_dtype in DTYPES, "checkpoint.export_dtype", f"unknown dtype {c.export_dtype!r}",
             f"Choose one of {DTYPES}")
    _require(cfg.launch.nproc_per_node >= 1, "launch.nproc_per_node", f"must be >= 1, got {cfg.launch.nproc_per_node}",
             "Use 1 or more")
    _require(cfg.logging.peak_tflops is None or cfg.logging.peak_tflops > 0, "logging.peak_tflops",
             f"must be > 0, got {cfg.logging.peak_tflops}", "Use null for the table's value")
    _require(cfg.logging.log_every >= 1, "logging.log_every", f"must be >= 1, got {cfg.logging.log_every}", "Use 1+")
    return degrees


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
        _require(not m.tie_embeddings, "parallel.pp", f"{m.path}/config.json ties the head to the embedding "
                 "(tie_word_embeddings), and a tied head cannot be split from its embedding across pipeline stages",
                 "Use parallel.pp=1 (FSDP and TP/SP) for this model")
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
