"""Typed configuration schema: the public interface.

Every key a user may type on the command line is a field here (the ``peft`` section's in
``peft_schema``, the planner's ``cluster`` and ``plan`` in ``plan_schema``, kept apart for this
module's length). The dataclasses are registered in Hydra's ConfigStore so overrides are
type-checked by OmegaConf; ``checks.validate`` checks what types cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from composer3d.config.peft_schema import PeftConfig
from composer3d.config.plan_schema import ClusterConfig, PlanConfig


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward layers of the native llama (model=tiny_moe)."""

    # routed experts per MoE layer (stacked [experts, ...] tensors: expert parallel shards them); 0:
    # every layer dense
    experts: int = 0
    top_k: int = 2  # experts each token is routed to
    # experts every token goes through as well (one SwiGLU of shared_experts × the width)
    shared_experts: int = 0
    # each expert's SwiGLU width; None: the dense layers' width
    expert_hidden_dim: int | None = None
    # the first k layers keep a dense feed-forward (DeepSeek-V3 style); the rest are MoE
    dense_layers: int = 0
    score_func: str = "softmax"  # softmax | sigmoid: the router's per-expert scores
    # the chosen experts' scores are divided by their sum (the mixing weights)
    normalize_top_k: bool = True
    route_scale: float = 1.0  # multiplies the mixing weights
    # sequence-wise load-balancing loss (DeepSeek-V3's form, 1.0 when balanced) × this, added to the
    # training loss
    aux_loss_coef: float = 0.001
    # auxiliary-loss-free balancing (DeepSeek-V3): after each step a per-expert bias, used only to
    # choose the top-k, moves by this much towards balance (sign of mean load - load, over the
    # global batch); 0: off
    bias_update_rate: float = 0.0
    # 0: no token is ever dropped. c > 0: each expert takes at most ceil(c · seq_len · top_k /
    # experts) tokens of a sequence (first choices first, then by position); the rest of its tokens
    # skip that expert
    capacity_factor: float = 0.0


@dataclass
class ModelConfig:
    # registry key: "llama" is the native Llama-3 style decoder, "hf" any transformers causal LM
    # (model=hf)
    name: str = MISSING
    # hf: local directory (or hub id already in the local cache) holding config.json and safetensors
    # weights. The size fields below are then read from its config.json at launch (whatever the YAML
    # says).
    path: str | None = None
    # hf: load the weights from path; false: train from scratch (HF's own init, seeded)
    pretrained: bool = True
    # hf: sdpa | eager | ...; None: what transformers picks for the model
    attn_implementation: str | None = None
    dim: int = MISSING  # model width (hidden size)
    n_layers: int = MISSING  # decoder layers
    n_heads: int = MISSING  # attention (query) heads
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    # None: dim / n_heads (the native llama's only choice); model=hf reads its own
    head_dim: int | None = None
    vocab_size: int = MISSING  # embedding rows; at least the tokenizer's vocabulary
    # None: Llama-3 rule from dim, multiple_of and ffn_dim_multiplier
    ffn_hidden_dim: int | None = None
    multiple_of: int = 256  # the MLP width is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None  # scales the Llama-3 MLP width rule
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 500000.0  # rotary embedding base
    max_seq_len: int = 8192  # longest sequence the rotary tables cover
    tie_embeddings: bool = False  # the output head shares the embedding matrix
    init_std: float = 0.02  # std of the normal init of the native model's weights
    # native llama: mixture-of-experts layers (experts > 0)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class DataConfig:
    # stdlib | synthetic | text_files (the data=chat option: text_files with format=chat)
    name: str = "stdlib"
    # text_files: .txt (one document per file), .jsonl or .parquet (one document per row) files,
    # directories or globs; one kind per run
    paths: list[str] = field(default_factory=list)
    # text: documents | chat: conversations, trained on the assistant replies only (SFT) |
    # preference: .jsonl/.parquet rows of prompt, chosen and rejected text (TRL's standard format;
    # train.objective=dpo): each pair packed whole into one row, the completions' tokens the targets
    format: str = "text"
    text_field: str = "text"  # format=text, .jsonl/.parquet: the field holding the document text
    # format=chat: the field holding the list of {role, content} messages
    messages_field: str = "messages"
    # local directory of a Hugging Face tokenizer; None = model=hf's own (model.path), else
    # byte-level
    tokenizer: str | None = None
    # packed documents: position_ids restart at each document and the previous document's last token
    # (eos) takes no loss; the model (native llama or HF) also attends within documents only
    document_masking: bool = True
    # cap on tokens read from the corpus into memory (0 = no cap); a prepared corpus (data.prepared)
    # is never capped
    max_tokens: int = 4_000_000
    # a corpus prepared once by composer3d-prepare (same data.*/model overrides +
    # data.prepared=<dir>): token shards every rank maps read-only instead of tokenizing the corpus
    # at start-up; training needs it prepared (missing: refused, naming the command).
    # data.paths/data.tokenizer may then be left out; where given, they must be what it was prepared
    # from. None: the corpus is read and tokenized in memory
    prepared: str | None = None
    prepare_workers: int = 0  # composer3d-prepare: tokenizing processes (0 = os.cpu_count())
    # composer3d-prepare: replace a data.prepared directory prepared from other sources/tokenizer
    # (else refused)
    prepare_overwrite: bool = False
    synthetic_sequences: int = 4096  # synthetic: number of distinct random sequences


@dataclass
class ParallelConfig:
    # data-parallel replicas (HSDP's outer dimension: parameters replicated across them)
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves after the other degrees
    tp: int = 1  # tensor parallel degree (Megatron column/row splits of each layer)
    pp: int = 1  # pipeline parallel degree (stages of consecutive layers)
    # context parallel: each of cp ranks holds 1/cp of every sequence (native model; with FSDP/HSDP)
    cp: int = 1
    # how attention spans the cp ranks' shares: ring (keys/values passed round, memory 1/cp) |
    # allgather (keys/values all-gathered: short sequences, few KV heads) | ulysses (all-to-all to a
    # head split; heads divisible by cp) | hierarchical (Ulysses over cp_ulysses consecutive cp
    # ranks, inside a node, × ring over the cp / cp_ulysses groups, across nodes)
    cp_style: str = "ring"
    # cp_style=hierarchical: the ranks of each Ulysses group (divides cp, 1 < cp_ulysses < cp; the
    # heads a rank holds divisible by it); 0 under the other styles
    cp_ulysses: int = 0
    # which tokens of a sequence each cp rank holds: documents (each batch's packed documents
    # balanced: up to 2·cp·4 chunks dealt by their attention work; head-tail where that is no
    # worse) | head_tail (chunks r and 2·cp−1−r of 2·cp: balances one causal sequence)
    cp_balance: str = "documents"
    # expert parallel degree (model.moe.experts > 0): each group of ep data-parallel ranks (taken
    # from dp_shard; under cp, all cp ranks and ep/cp of dp_shard) holds experts/ep experts per MoE
    # layer and exchanges tokens with all-to-all; experts are FSDP-sharded over the dp_shard ranks
    # that remain
    ep: int = 1
    # with tp>1: norms and residuals on 1/tp of the sequence (less activation memory)
    sequence_parallel: bool = False
    # 3: FSDP shards params, grads, optimizer state | 2: params stay gathered | 1: only optimizer
    # state
    zero_stage: int = 3
    # ZeRO-1: gradients are reduce-scattered (in precision.reduce_dtype) in buckets of about this
    # many MiB, each sent as soon as its gradients are complete in the backward, overlapping it
    # (Megatron's distributed optimizer: 40M)
    zero1_bucket_mb: float = 40.0
    # FSDP: free gathered params after forward? default: yes for zero_stage 3 without PP; with PP
    # no, because each microbatch would gather them again in forward and once more in backward.
    # always | never override.
    reshard_after_forward: str = "default"
    # ZeRO-Offload. none | cpu: FSDP keeps params, grads and the optimizer step in host memory |
    # optimizer: only the optimizer state and step on the host (fp32 masters and moments; a fused
    # CPU AdamW), params and grads on device
    offload: str = "none"
    # with offload=optimizer: keep the host masters and moments in memory-mapped files here (NVMe),
    # not in host memory
    offload_dir: str | None = None
    # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv | dualpipev
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None  # None: global_batch_size / (micro_batch_size × dp)
    # None: 1, or 2 for interleaved / looped / V-shaped schedules
    pp_stages_per_rank: int | None = None
    # parallel=auto: composer3d-plan's model picks the layout (degrees, ZeRO stage, SP, schedule,
    # micro-batch size, activation checkpointing) for this world size and cluster.*; the choice and
    # why go to the log and run.json
    auto: bool = False


@dataclass
class Float8Config:
    # float8 matmuls in the linear layers (torchao; accelerators with float8 support)
    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise (torchao)


@dataclass
class PrecisionConfig:
    # compute dtype of params: auto = bfloat16 on an accelerator, float32 on the CPU. FSDP and
    # ZeRO-1 all-gather parameters in it (ZeRO-1 then keeps fp32 masters of its slices in the
    # optimizer; checkpoints hold fp32)
    param_dtype: str = "auto"
    # gradient reduction dtype (master weights and optimizer stay float32)
    reduce_dtype: str = "float32"
    # how compute reaches param_dtype where no data-parallel dim shards or replicates the parameters
    # (a world of one device; elsewhere FSDP casts and this key does nothing). params: a param_dtype
    # copy of every parameter made once a forward and kept through its backward, where its gradient
    # is cast back to fp32 (parallel.cast_once; FSDP's rounding, the residual stream in param_dtype,
    # as on every FSDP run) | autocast: each op casts its inputs, weights again in each
    # recomputation (fp32 residual stream and norms; torchtitan's one-device way) | auto: params for
    # an eager run on one accelerator, else autocast (the faster of the two by measurement). Under
    # float32 nothing is cast
    cast: str = "auto"
    loss_scale_init: float = 65536.0  # float16 only: dynamic loss scaling
    # float16: steps without overflow before the loss scale doubles
    loss_scale_growth_interval: int = 2000
    float8: Float8Config = field(default_factory=Float8Config)


@dataclass
class MemoryConfig:
    activation_checkpointing: str = "none"  # none | full | selective
    # selective: 0 = op-level policy in every block; k >= 1 = every k-th block fully
    ac_every: int = 0
    # op-level selective (ac_every=0): what each block keeps. all_matmuls: every matmul's and
    # attention's output (recomputes norms, activations, RoPE) | alternate_matmuls: every other
    # matmul's and attention's (torchtitan's policy: less memory, one matmul in two recomputed)
    ac_policy: str = "all_matmuls"
    # op-level selective: also keep the all-gathers' outputs (sequence parallel's gathered inputs of
    # attention and the feed-forward, cp_style=allgather's K/V): tp× (cp×) the memory of the shards
    # they gather, for no all-gather redone in backward. false: each is gathered again in backward
    # (Megatron-LM's and torchtitan's way)
    ac_save_gathers: bool = False
    # N >= 2: each dense feed-forward runs over N tiles of the sequence, each recomputed in
    # backward, so only one tile's hidden (seq/N x ffn) exists at a time; 0 or 1: off. N must divide
    # the tokens a rank holds (seq_len / cp)
    tile_mlp: int = 0
    # N >= 2: the final norm, head and cross-entropy run over N sequence tiles, each recomputed in
    # backward: the full-length logits never exist (seq/N x vocab at a time); 0 or 1: off. Not with
    # pipeline parallel
    tile_loss: int = 0
    # the tensors autograd saves in each block's forward (under checkpointing: what it keeps) go to
    # pinned host memory and come back ahead of their backward, the next block's prefetched (side
    # stream on an accelerator)
    activation_offload: bool = False
    # CUDA's caching allocator grows its segments in place (expandable_segments:True, as
    # torchtitan's launcher sets): what it reserves stays near what is allocated. A
    # PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF in the environment wins. No effect on other
    # devices
    expandable_segments: bool = True


@dataclass
class CompileConfig:
    enabled: bool = False  # torch.compile each block (after activation checkpointing, before FSDP)


@dataclass
class TrainLoopConfig:
    steps: int = 100  # optimizer steps to train (a resumed run continues to this step)
    global_batch_size: int = 16  # sequences per optimizer step, across all data-parallel ranks
    micro_batch_size: int = 4  # sequences per forward/backward on one data-parallel rank
    seq_len: int = 128  # tokens per training sequence
    seed: int = 0  # seeds initialization and the data order (both independent of the layout)
    # torch's deterministic algorithms (bit-exact reruns; slower on accelerators)
    deterministic: bool = False
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    eval_every: int = 0  # evaluate on eval.path every N steps (and after the last); 0: never
    # a loss or gradient norm that is NaN/inf: stop (exit 3 naming the step, detected at the next
    # metrics read-back, which every checkpoint waits for, so no checkpoint holds that state) | skip
    # (check every step — one host sync — and drop that update)
    on_nonfinite: str = "stop"
    # updates dropped in a row (non-finite, or fp16 overflow) before the run stops
    max_skipped_steps: int = 10
    # Python's garbage collector: off while training, one collection on every rank at every N-th
    # step boundary (an automatic one strikes mid-step on one rank, and the others wait on it at the
    # next collective); 0: Python's own
    gc_every: int = 50
    # the head and cross-entropy (each compiled on an accelerator): chunked (the head's logits, then
    # the loss chunk by chunk; any layout) | fused (matmul, loss, gradients per chunk of rows, the
    # weight's per chunk of the vocab: no full logits; needs a bias-free head without logit scaling,
    # parallel.tp=1, parallel.pp=1, memory.tile_loss=0)
    loss_impl: str = "chunked"
    # sft: next-token cross-entropy on the targets | dpo: preference tuning on chosen/rejected pairs
    # (data.format=preference; the loss and its reference: the preference section)
    objective: str = "sft"


@dataclass
class PreferenceConfig:
    """Preference tuning (train.objective=dpo): the loss, as TRL names it, and its reference."""

    # sigmoid: DPO, -log σ(β·Δ) (Δ: chosen's log-ratio to the reference minus rejected's) | ipo:
    # (Δ per completion token - 1/(2β))² | hinge: relu(1 - β·Δ) | simpo: SimPO, the policy's
    # log-probabilities averaged per completion token, margin simpo_gamma, no reference model
    loss_type: str = "sigmoid"
    beta: float = 0.1  # β: the scale of the implicit reward β·log(π/π_ref) (IPO's τ)
    # sigmoid, simpo: the probability that a pair's labels are flipped (conservative DPO:
    # (1-ε)·(-log σ(β·Δ)) + ε·(-log σ(-β·Δ))); in [0, 0.5)
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5  # simpo: the target reward margin γ (the loss uses Δ - γ/β)
    # copy: a frozen copy of the initial policy, parallelized like it (no gradients, no optimizer
    # state) | adapters_off: under peft=lora|qlora the policy itself with its adapters switched off
    # (the base: no second copy) | precomputed: the initial policy's log-probabilities of every
    # pair, taken in one pass over the data before the first step (TRL's precompute_ref_log_probs;
    # nothing held while training). simpo builds none
    reference: str = "copy"


@dataclass
class EvalConfig:
    # UTF-8 text file: loss/perplexity over its train.seq_len-token windows (composer3d-eval)
    path: str | None = None
    max_windows: int = 0  # evaluate at most this many windows (0: all)
    # lm-evaluation-harness tasks/groups to score instead (lm-eval)
    tasks: list[str] = field(default_factory=list)
    # directories of lm-eval task YAMLs of your own, for eval.tasks
    task_paths: list[str] = field(default_factory=list)
    num_fewshot: int = -1  # eval.tasks: few-shot examples per prompt (-1: each task's own default)
    limit: int = 0  # eval.tasks: score at most this many documents per task (0: all)
    # eval.tasks: resamples for the standard errors lm-eval bootstraps (0: none)
    bootstrap_iters: int = 100000
    # eval.tasks: write each document's requests and responses here (JSON lines)
    samples_path: str | None = None


@dataclass
class GenerateConfig:
    prompt: str = ""  # composer3d-generate: the text to continue
    # more texts to continue, in one batch with prompt (each as alone)
    prompts: list[str] = field(default_factory=list)
    chat: bool = False  # send the prompt as a user message through the tokenizer's chat template
    # tokens generated at most (prompt + these must fit model.max_seq_len)
    max_new_tokens: int = 128
    # 0: greedy (the most likely token); > 0: sample from softmax(logits / temperature)
    temperature: float = 0.0
    top_k: int = 0  # sampling: only from the top_k most likely tokens (0: no cut; 1: greedy)
    # sampling: only from the most likely tokens whose probabilities add up to top_p (nucleus)
    top_p: float = 1.0
    seed: int = 0  # seeds the sampling (the same seed and weights give the same text)
    stop_at_eos: bool = True  # stop at the tokenizer's end-of-sequence token
    # stop strings: a completion ends before the first one it holds
    stop: list[str] = field(default_factory=list)
    # KV cache: static (preallocated, written in place) | dynamic (Hugging Face models:
    # transformers' DynamicCache)
    # | none (recompute the whole sequence every token: slow, exact for any attention)
    cache: str = "static"
    # compile the native model's one-token decode steps (torch.compile, CUDA graphs on a GPU): about
    # a minute to compile, then several times the tokens/s of the eager steps (with cache=static;
    # not model=hf, MoE or tp>1)
    compile: bool = False
    # text: each prompt and its continuation | json: one line per prompt, with its token ids
    output: str = "text"


@dataclass
class OptimConfig:
    # adamw | adamw_8bit | adamw_4bit | adamw_fp8 (torchao: low-bit optimizer state) | muon (Muon
    # for the hidden matrices, AdamW with betas/eps for the rest: embeddings, head, norms, biases,
    # router; lr and weight_decay apply to both)
    name: str = "adamw"
    lr: float = 3e-4  # peak learning rate, reached after warmup_steps
    weight_decay: float = 0.1  # decoupled weight decay on matrices (not on norms or biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's moment decay rates
    eps: float = 1e-8  # Adam's denominator epsilon
    warmup_steps: int = 10  # linear warmup from 0 to lr
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    # adamw's kernels: auto (compiled on the accelerator; elsewhere fused where the device has them,
    # else foreach) | fused | foreach | for_loop | compiled (torch.compile'd update, a call a block
    # and a graph per shape of block: no gradient stored back)
    implementation: str = "auto"
    muon_momentum: float = 0.95  # muon: the momentum's decay rate μ (m ← μ·m + g)
    # muon: orthogonalize Nesterov's form g + μ·m (true) or the momentum m itself (false)
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # muon: Newton–Schulz iterations (the quintic coefficients)
    # muon: what Newton–Schulz computes in: auto (bfloat16 on accelerators, as Muon's authors run
    # it; float32 on the CPU) | float32 | bfloat16
    muon_ns_dtype: str = "auto"
    # muon: the orthogonalized update's scale: match_adamw (0.2·√max(rows, cols), Moonlight's: the
    # RMS of AdamW's update, so AdamW's lr and weight_decay carry over) | shape (√max(1, out/in),
    # Keller Jordan's: wants a larger lr)
    muon_scale: str = "match_adamw"
    # muon: parameters AdamW steps though Muon's rule (≥ 2-D, inside a numbered block) takes them,
    # as name patterns (fnmatch); the default: the MoE router (native and Hugging Face)
    muon_adamw_params: list[str] = field(default_factory=lambda: ["*.gate.weight", "*router*"])
    # muon: the matrices orthogonalized per all-to-all, in MiB of the Newton–Schulz dtype (each
    # bucket's gather to the owners runs while the bucket before it is orthogonalized)
    muon_bucket_mb: float = 64.0
    # muon: QK-Clip (Kimi K2's MuonClip) threshold τ: after each update, a head whose largest
    # attention logit of the step exceeded τ has its query and key projections scaled so it would
    # have been τ (0: off; K2 used 100). The native model (model=llama), without cp or compile
    muon_clip_threshold: float = 0.0


@dataclass
class RunConfig:
    # conf/train.yaml: outputs/<run.name>, or outputs/<date>/<time> for an unnamed run; in a sweep
    # (-m) the sweep's directory, job N training in <run.dir>/N
    dir: str = MISSING
    # a stable run directory: re-running the command resumes it (an unnamed run starts afresh each
    # time); also the wandb run's name
    name: str | None = None


@dataclass
class LoggingConfig:
    # read metrics back from the device and log them every N steps (fewer host syncs)
    log_every: int = 1
    # log to Weights & Biases (run.name names the run; resumed runs continue it)
    wandb: bool = False
    wandb_project: str = "composer3d"  # the Weights & Biases project
    tensorboard: bool = False  # write TensorBoard events to <run.dir>/tensorboard
    # on a terminal; off one (SLURM logs, pipes) each logged step is one plain line
    progress_bar: bool = True
    # measure step 2's peak memory by category (activations, params, …) into run.json
    memory_breakdown: bool = False
    # peak FLOP/s of one device in TFLOP/s, for MFU; None: from composer3d.training.flops' table by
    # device name (the CPU and unlisted devices get TFLOP/s only)
    peak_tflops: float | None = None


@dataclass
class CheckpointConfig:
    enabled: bool = True  # save distributed checkpoints (DCP) and resume from them
    dir: str | None = None  # None: <run.dir>/checkpoints
    interval: int = 0  # save every N steps (0: only at the end of training)
    # committed checkpoints kept, after each save (0: all); one that fails verification never counts
    keep_last: int = 3
    # none | async (write in a background thread) | async_pinned (stage to pinned memory)
    async_mode: str = "none"
    # auto (newest checkpoint in dir that passes verification, if any) | none (a fresh start;
    # refused in a run.dir that holds an earlier run: use a new run.name) | <path to a step-N
    # directory>
    resume: str = "auto"
    model_only_final: bool = False  # the last checkpoint holds only the weights, in export_dtype
    # dtype of exported Hugging Face weights (composer3d-convert export)
    export_dtype: str = "bfloat16"


@dataclass
class LaunchConfig:
    # local worker processes to start (one per device); under torchrun/SLURM theirs;
    # hydra/launcher=slurm: the SLURM tasks per node (each task one rank)
    nproc_per_node: int = 1
    device: str = "auto"  # auto | cpu | cuda | any torch accelerator type
    # a collective that has not completed after this long fails the run (a stalled or dead rank)
    # instead of hanging; fractions allowed. Generous: a first step that compiles, or a large
    # checkpoint, holds ranks up for minutes
    timeout_minutes: float = 30.0
    # local launcher: restart the whole worker group up to N times after a worker dies (not for exit
    # 2 or 3), resuming from the last checkpoint. Under torchrun use its --max-restarts instead
    max_restarts: int = 0


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
