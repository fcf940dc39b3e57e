"""Recipes (``recipe=<name>``): each composes, holds what it documents, and validates at its
documented world size with the real architecture's sizes; a few run end to end, shrunk to 2 CPU
processes on tiny models of their kind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
from harness import train_job
from hf_models import _CORPUS, make_model
from hydra import compose, initialize_config_module
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from composer3d.config.checks import validate
from composer3d.config.registration import register_configs
from composer3d.errors import ConfigError
from composer3d.models import MODEL_REGISTRY

RECIPE_DIR = files("composer3d.recipes") / "recipe"

# The published config.json of each model (model_type, sizes) and transformers' parameter count for
# it.
PUBLISHED = {
    "llama3_1_8b": (
        "llama",
        8_030_261_248,
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
    ),
    "llama3_1_70b": (
        "llama",
        70_553_706_496,
        dict(
            hidden_size=8192,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_5_7b": (
        "qwen2",
        7_615_616_512,
        dict(
            hidden_size=3584,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            intermediate_size=18944,
            vocab_size=152064,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_8b": (
        "qwen3",
        8_190_735_360,
        dict(
            hidden_size=4096,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=12288,
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
    "mistral_7b": (
        "mistral",
        7_248_023_552,
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32768,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
    ),
    "gemma2_9b": (
        "gemma2",
        9_241_705_984,
        dict(
            hidden_size=3584,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            intermediate_size=14336,
            vocab_size=256000,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    ),
}
# recipe -> (model it is for, world size it is laid out for)
RECIPES = {
    **{name: (name, 8) for name in PUBLISHED},
    **{f"{name}_8x8": (name, 64) for name in PUBLISHED},
}
GPU_MEMORY = 80e9  # the recipes are sized for 80 GB GPUs (H100/A100 80GB)
# Native-model recipes laid out by composer3d-plan: recipe -> (world size, the planner's command
# line)
PLANNED = {
    "llama3_8b_131k": (
        8,
        [
            "model=llama3_8b",
            "train.seq_len=131072",
            "train.global_batch_size=8",
            "cluster.nodes=1",
            "cluster.device=h100",
        ],
    ),
    # its search ranks 62,912 layouts (a minute here): the test prices the choice beside the
    # alternatives its comments name
    "llama3_70b_131k": (
        64,
        [
            "model=llama3_70b",
            "train.seq_len=131072",
            "train.global_batch_size=16",
            "cluster.nodes=8",
            "cluster.device=h100",
        ],
    ),
}
# LoRA / QLoRA recipes on one GPU: recipe -> (model, the GPU memory it is sized for)
PEFT_RECIPES = {
    "llama3_1_8b_lora": ("llama3_1_8b", 80e9),
    "llama3_1_8b_qlora": ("llama3_1_8b", 24e9),
}
# DPO recipes: recipe -> (model, the GPUs of the node it is laid out for); their comments quote the
# planner's peak memory and step time for their layout
DPO_RECIPES = {"llama3_1_8b_dpo_lora": ("llama3_1_8b", 1), "llama3_1_8b_dpo": ("llama3_1_8b", 8)}
# 4 bits, an int8 scale per 64 values, an fp32 scale per 256 scales
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def compose_recipe(name: str, *overrides: str):
    """The config composition the CLI does for ``composer3d-train recipe=<name> ...`` (the same
    search path)."""
    register_configs()
    with initialize_config_module("composer3d.conf", version_base=None):
        return compose("train", overrides=[f"recipe={name}", *overrides])


def write_config_json(directory: Path, model: str) -> Path:
    """config.json of the published model (no weights): what model=hf reads its sizes from at
    launch."""
    from transformers import AutoConfig

    model_type, _, sizes = PUBLISHED[model]
    AutoConfig.for_model(model_type, **sizes).save_pretrained(directory)
    return directory


def fill_published_sizes(cfg, model: str, directory: Path) -> None:
    """What model=hf fills in from config.json at launch, written out from the published sizes."""
    _, _, c = PUBLISHED[model]
    m = cfg.model
    m.path = str(directory)
    m.dim, m.n_layers, m.n_heads = (
        c["hidden_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
    )
    m.n_kv_heads, m.vocab_size, m.ffn_hidden_dim = (
        c["num_key_value_heads"],
        c["vocab_size"],
        c["intermediate_size"],
    )
    m.max_seq_len, m.tie_embeddings = c["max_position_embeddings"], c["tie_word_embeddings"]


def needs_hf_model():
    if "hf" not in MODEL_REGISTRY:
        pytest.skip("model=hf is not registered (composer3d.models.hf)")


def test_every_recipe_is_tested():
    shipped = sorted(
        p.name.removesuffix(".yaml") for p in RECIPE_DIR.iterdir() if p.name.endswith(".yaml")
    )
    assert shipped == sorted([*RECIPES, *PLANNED, *PEFT_RECIPES, *DPO_RECIPES])


def test_every_recipe_has_a_row_in_the_recipes_readme():
    readme = (Path(__file__).parents[1] / "recipes" / "README.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", readme, re.M))
    assert rows == {*RECIPES, *PLANNED, *PEFT_RECIPES, *DPO_RECIPES}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_composes_with_its_documented_settings(name):
    model, world = RECIPES[name]
    cfg = compose_recipe(name, "model.path=/models/x")
    assert cfg.model.name == "hf" and cfg.model.path == "/models/x" and cfg.model.pretrained
    assert cfg.model.attn_implementation == ("eager" if model == "gemma2_9b" else None)
    assert cfg.data.name == "text_files" and cfg.data.tokenizer is None  # the model's own tokenizer
    assert cfg.run.name == name
    assert cfg.precision.param_dtype == "bfloat16" and cfg.precision.reduce_dtype == "float32"
    assert cfg.memory.activation_checkpointing == "full"
    assert cfg.train.seq_len == 4096 and cfg.train.global_batch_size == 128
    assert (
        cfg.optim.name == "adamw" and 1e-6 <= cfg.optim.lr <= 1e-5 and cfg.optim.weight_decay == 0.0
    )
    assert (
        cfg.checkpoint.enabled
        and 0 < cfg.checkpoint.interval < cfg.train.steps
        and cfg.checkpoint.model_only_final
    )
    # every value a recipe sets is a key of the schema (compose would have failed otherwise), and
    # its header shows how to run it
    text = (RECIPE_DIR / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n") and f"recipe={name} model.path=" in text


def test_recipe_beats_defaults_and_command_line_beats_recipe():
    cfg = compose_recipe("llama3_1_8b")
    assert cfg.optim.lr == 5e-6 and cfg.model.name == "hf"  # the defaults say 3e-4 and model=tiny
    cfg = compose_recipe(
        "llama3_1_8b", "optim.lr=1e-4", "parallel.dp_shard=4", "train.micro_batch_size=1"
    )
    assert cfg.optim.lr == 1e-4 and cfg.parallel.dp_shard == 4 and cfg.train.micro_batch_size == 1
    # an 8x8 recipe is its 1-node recipe with another layout
    one, eight = compose_recipe("qwen3_8b"), compose_recipe("qwen3_8b_8x8")
    assert (one.parallel.dp_replicate, eight.parallel.dp_replicate, eight.parallel.dp_shard) == (
        1,
        8,
        8,
    )
    assert OmegaConf.to_container(one.optim) == OmegaConf.to_container(eight.optim)


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(MissingConfigException) as error:
        compose_recipe("llama9_1t")
    assert "llama3_1_8b" in str(error.value) and "gemma2_9b_8x8" in str(error.value)


def test_cli_finds_recipes_from_any_directory(tmp_path):
    """The installed entry point, started elsewhere than the repository, knows the recipe group."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "composer3d.commands.train", "recipe=llama9_1t"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "recipe: no option 'llama9_1t'. Use recipe=<one of: " in line and "mistral_7b" in line


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_validates_at_its_world_size_with_the_real_sizes(name, tmp_path):
    needs_hf_model()
    model, world = RECIPES[name]
    cfg = compose_recipe(name, "data.paths=[/data/sft/*.jsonl]")
    fill_published_sizes(cfg, model, write_config_json(tmp_path, model))
    degrees = validate(cfg, world).as_dict()
    p = cfg.parallel
    assert degrees["pp"] * degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] == world
    # The memory arithmetic of the recipe's comments: 16 B per parameter (fp32 params and grads,
    # AdamW m and v) cut over the ranks that shard it. It fits an 80 GB GPU with room for
    # activations, or (70B on one node) it does not, and the recipe offloads it to the CPU.
    _, params, _ = PUBLISHED[model]
    state_per_gpu = 16 * params / (degrees["dp_shard"] * degrees["tp"] * degrees["pp"])
    if p.offload == "cpu":
        assert state_per_gpu > GPU_MEMORY
    else:
        assert state_per_gpu < 0.25 * GPU_MEMORY
    # an 8-node layout is refused on one node, naming a parallel.* key
    if world == 64:
        with pytest.raises(ConfigError, match=r"^parallel\."):
            validate(cfg, 8)


@pytest.mark.parametrize("name", sorted(PEFT_RECIPES))
def test_peft_recipe_validates_on_one_gpu_and_its_state_fits_by_its_arithmetic(name, tmp_path):
    """The recipe's memory arithmetic (the planner does not model frozen or NF4 weights): the
    adapters the model gets (counted on it, built on meta with the published sizes), the frozen base
    at 4 B (fp32) or NF4's bytes, the adapters at 16 B, within half the GPU (the rest: activations);
    a full fine-tune would not fit."""
    needs_hf_model()
    from composer3d.models import build_model
    from composer3d.peft.apply import check_targets, targets, trainable_params

    model_name, gpu = PEFT_RECIPES[name]
    cfg = compose_recipe(name, "data.paths=[/data/sft/*.jsonl]")
    fill_published_sizes(cfg, model_name, write_config_json(tmp_path, model_name))
    assert cfg.run.name == name and cfg.peft.method == name.rpartition("_")[2]
    assert (cfg.peft.rank, cfg.peft.alpha) == (16, 32.0) and 1e-4 <= cfg.optim.lr <= 3e-4
    assert (
        cfg.model.pretrained
        and cfg.checkpoint.model_only_final
        and cfg.precision.param_dtype == "bfloat16"
    )
    assert validate(cfg, 1).dp_shard == 1
    model = build_model(cfg.model)  # on meta
    check_targets(model, cfg.peft, 1)  # QLoRA: every adapted weight holds whole NF4 blocks
    adapters = trainable_params(model, cfg.peft)
    # r 16 × (in + out) of 7 projections × 32 layers, as the recipe says
    assert adapters == 41_943_040
    _, params, _ = PUBLISHED[model_name]
    adapted = sum(linear.weight.numel() for _, linear in targets(model, cfg.peft.target_modules))
    base = (
        (adapted * NF4_BYTES + (params - adapted) * 4) if cfg.peft.method == "qlora" else params * 4
    )
    state = base + 16 * adapters
    assert state < 0.5 * gpu and 16 * params > gpu, (state / 2**30, gpu)
    if cfg.peft.method == "lora":  # the recipe's comment: on 24 GB its fp32 base alone does not fit
        assert base > 24e9


@pytest.mark.parametrize("name", sorted(DPO_RECIPES))
def test_dpo_recipe_validates_and_quotes_the_planner(name, tmp_path):
    """A DPO recipe validates on its GPUs with the published sizes, and the peak memory and step
    time its comment (and recipes/README.md) give are composer3d-plan's for its layout on H100s,
    which fits."""
    needs_hf_model()
    from composer3d.plan import Workload, candidate_from_config, estimate
    from composer3d.plan.hardware import cluster_from_config

    model, gpus = DPO_RECIPES[name]
    cfg = compose_recipe(
        name,
        "data.paths=[/data/pairs/*.jsonl]",
        "cluster.device=h100",
        f"cluster.gpus_per_node={gpus}",
    )
    fill_published_sizes(cfg, model, write_config_json(tmp_path, model))
    assert cfg.train.objective == "dpo" and cfg.data.format == "preference"
    assert cfg.preference.reference == ("adapters_off" if cfg.peft.method == "lora" else "copy")
    validate(cfg, gpus)
    cluster = cluster_from_config(cfg.cluster, cfg.precision.param_dtype)
    planned = estimate(
        Workload.from_config(cfg), candidate_from_config(cfg, cluster.world_size), cluster
    )
    assert planned.fits
    comment = (RECIPE_DIR / f"{name}.yaml").read_text()
    quoted = re.search(r"([\d.]+) GiB of 80 at its peak, ([\d.]+) s a step", comment)
    assert quoted.groups() == (
        f"{planned.memory.total / 2**30:.1f}",
        f"{planned.step_time_s:.1f}",
    ), (name, planned.memory.total / 2**30, planned.step_time_s)
    readme = (Path(__file__).parents[1] / "recipes" / "README.md").read_text()
    row = re.search(rf"^\| `{name}` \|.*$", readme, re.M).group(0)
    assert f"| {planned.memory.total / 2**30:.1f} GiB |" in row, row
    assert f"| {planned.step_time_s:.1f} s (" in row, row


def test_70b_pipeline_alternative_in_its_comments_validates(tmp_path):
    needs_hf_model()
    text = (RECIPE_DIR / "llama3_1_70b_8x8.yaml").read_text()
    line = re.search(r"^#\s+(parallel\.pp=.*)$", text, re.M).group(1)
    cfg = compose_recipe("llama3_1_70b_8x8", "data.paths=[/data/sft/*.jsonl]", *line.split())
    fill_published_sizes(cfg, "llama3_1_70b", write_config_json(tmp_path, "llama3_1_70b"))
    degrees = validate(cfg, 64).as_dict()
    assert (degrees["pp"], degrees["tp"], degrees["dp_shard"]) == (2, 8, 4)


def test_model_hf_reads_the_published_sizes(tmp_path):
    """What the recipes rely on: model=hf takes its sizes from config.json (here each published
    one)."""
    from composer3d.config.checks import resolve_model_config

    needs_hf_model()
    for model in PUBLISHED:
        directory = write_config_json(tmp_path / model, model)
        cfg = compose_recipe(model, f"model.path={directory}")
        resolve_model_config(cfg.model)
        expected = compose_recipe(model)
        fill_published_sizes(expected, model, directory)
        keys = (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "vocab_size",
            "ffn_hidden_dim",
            "max_seq_len",
            "tie_embeddings",
        )
        assert {k: cfg.model[k] for k in keys} == {k: expected.model[k] for k in keys}, model


# One run per kind of layout the recipes use, shrunk to 2 CPU processes: FSDP (with CPU offload),
# TP+SP, HSDP (with chat data). The other 1-node recipes have llama3_1_70b's layout without the
# offload; their architectures train in tests/test_hf_*.py.
TINY_RUNS = {
    "llama3_1_70b": ("llama", []),
    "llama3_1_70b_8x8": ("llama", ["parallel.tp=2", "parallel.dp_shard=1"]),
    "gemma2_9b_8x8": (
        "gemma2",
        ["parallel.dp_replicate=2", "parallel.dp_shard=1", "data.format=chat"],
    ),
}


@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_recipe_runs_shrunk_to_two_cpu_processes(name, tmp_path):
    """The recipe's run, its ranks forked (``train_job``); finding the recipes from any directory
    through the command line is test_cli_finds_recipes_from_any_directory's."""
    needs_hf_model()
    arch, layout = TINY_RUNS[name]
    model_dir = make_model(tmp_path / "model", arch)
    corpus = tmp_path / "corpus.jsonl"
    if "data.format=chat" in layout:
        rows = [
            {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
            for a, b in zip(_CORPUS * 8, _CORPUS[1:] * 8)
        ]
    else:
        rows = [{"text": text} for text in _CORPUS * 10]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = train_job(
        tmp_path / "run",
        f"recipe={name}",
        f"model.path={model_dir}",
        f"data.paths=[{corpus}]",
        "precision.param_dtype=float32",
        "train.steps=2",
        "train.seq_len=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "checkpoint.interval=1",
        "logging.progress_bar=false",
        *layout,
        nproc=2,
    )
    assert len(result.losses) == 2 and all(0 < loss < 100 for loss in result.losses)
    # the recipe's values, under the test's overrides
    saved = OmegaConf.load(result.run_dir / "config.yaml")
    assert (
        saved.model.name == "hf"
        and saved.run.name == name
        and saved.memory.activation_checkpointing == "full"
    )
    assert (
        saved.optim.lr == compose_recipe(name).optim.lr
        and saved.precision.reduce_dtype == "float32"
    )
    final = result.run_dir / "checkpoints" / "step-00000002"
    assert final.is_dir()  # the final, model-only checkpoint (model_only_final)


def test_long_context_recipe_is_the_planners_choice_and_its_readme_row_the_prediction():
    """llama3_8b_131k: what composer3d-plan (and parallel=auto) chooses for 8 H100s at 131,072
    tokens, which composer3d's checks accept at 8 ranks; its README row gives the planner's memory
    and step time."""
    from composer3d.plan import Workload, candidate_from_config, estimate
    from composer3d.plan.hardware import cluster_from_config
    from composer3d.plan.search import best

    world, plan = PLANNED["llama3_8b_131k"]
    cfg = compose_recipe("llama3_8b_131k", "data.paths=[/data/long/*.jsonl]")
    assert cfg.model.name == "llama" and cfg.train.seq_len == 131072 and cfg.data.document_masking
    degrees = validate(cfg, world).as_dict()
    assert (degrees["dp_shard"], degrees["cp"], degrees["tp"], degrees["pp"]) == (4, 2, 1, 1)
    register_configs()
    with initialize_config_module("composer3d.conf", version_base=None):
        planned = compose("train", overrides=plan)
    cluster = cluster_from_config(planned.cluster, planned.precision.param_dtype)
    chosen, _, _ = best(planned, cluster)
    c = chosen.candidate
    p = cfg.parallel
    assert (c.dp_replicate, c.dp_shard, c.cp, c.cp_style, c.tp, c.pp, c.zero_stage) == (
        p.dp_replicate,
        p.dp_shard,
        p.cp,
        p.cp_style,
        p.tp,
        p.pp,
        p.zero_stage,
    )
    assert (c.micro_batch_size, c.activation_checkpointing) == (
        cfg.train.micro_batch_size,
        cfg.memory.activation_checkpointing,
    )
    e = estimate(Workload.from_config(planned), candidate_from_config(cfg, world), cluster)
    assert e.fits and e.step_time_s == chosen.step_time_s
    readme = (Path(__file__).parents[1] / "recipes" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `llama3_8b_131k` |"))
    assert f"{e.memory.total / 2**30:.1f} GiB" in row and f"{e.step_time_s:.1f} s" in row, row
    assert f"{e.tokens_per_s_per_gpu:,.0f} tok/s/GPU" in row and f"MFU {e.mfu:.1%}" in row, row


def test_70b_long_context_recipe_prices_as_its_comments_and_readme_say():
    """llama3_70b_131k: hierarchical cp 64 (Ulysses over a node's 8 GPUs × a ring of 8 nodes),
    FSDP over cp, validated at 64 ranks (refused at 8); the planner's memory and step time in its
    README row, and faster than the alternatives its comments name: TP 2 + SP × hierarchical cp 32,
    the plain ring over cp 64 (its passes through the NICs), TP 8 + SP × cp 8 (selective
    checkpointing does not fit, full does, slower)."""
    from composer3d.plan import Workload, candidate_from_config, estimate
    from composer3d.plan.hardware import cluster_from_config

    world, plan = PLANNED["llama3_70b_131k"]
    cfg = compose_recipe("llama3_70b_131k", "data.paths=[/data/long/*.jsonl]")
    assert cfg.model.n_layers == 80 and cfg.train.seq_len == 131072 and cfg.data.document_masking
    degrees = validate(cfg, world).as_dict()
    assert (degrees["dp_shard"], degrees["cp"], degrees["tp"], degrees["pp"]) == (1, 64, 1, 1)
    assert (cfg.parallel.cp_style, cfg.parallel.cp_ulysses) == ("hierarchical", 8)
    with pytest.raises(ConfigError, match=r"^parallel\."):
        validate(cfg, 8)
    register_configs()

    def priced(*overrides):
        with initialize_config_module("composer3d.conf", version_base=None):
            planned = compose("train", overrides=[*plan, *overrides])
        cluster = cluster_from_config(planned.cluster, planned.precision.param_dtype)
        return estimate(
            Workload.from_config(planned), candidate_from_config(planned, world), cluster
        )

    layout = [f"parallel.{k}={v}" for k, v in (("dp_shard", 1), ("cp", 64), ("tp", 1))]
    chosen = priced(
        *layout,
        "parallel.cp_style=hierarchical",
        "parallel.cp_ulysses=8",
        "train.micro_batch_size=1",
        "memory.activation_checkpointing=selective",
    )
    assert chosen.fits
    readme = (Path(__file__).parents[1] / "recipes" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `llama3_70b_131k` |"))
    assert f"{chosen.memory.total / 2**30:.1f} GiB" in row and f"{chosen.step_time_s:.1f} s" in row
    assert f"{chosen.tokens_per_s_per_gpu:,.0f} tok/s/GPU" in row and f"MFU {chosen.mfu:.1%}" in row
    mb1 = ["train.micro_batch_size=1", "memory.activation_checkpointing=selective"]
    tp2 = priced(
        "parallel.dp_shard=1", "parallel.cp=32", "parallel.tp=2",
        "parallel.sequence_parallel=true", "parallel.cp_style=hierarchical",
        "parallel.cp_ulysses=4", *mb1,
    )  # fmt: skip
    ring = priced(*layout, "parallel.cp_style=ring", *mb1)
    tp8 = [
        "parallel.dp_shard=1",
        "parallel.cp=8",
        "parallel.tp=8",
        "parallel.sequence_parallel=true",
    ]
    tp8_selective = priced(*tp8, *mb1)
    tp8_full = priced(*tp8, "train.micro_batch_size=1", "memory.activation_checkpointing=full")
    assert not tp8_selective.fits and tp8_full.fits
    for other in (tp2, ring, tp8_full):
        assert other.fits and other.step_time_s > chosen.step_time_s
    assert ring.memory.total == pytest.approx(chosen.memory.total)
    comments = (RECIPE_DIR / "llama3_70b_131k.yaml").read_text()
    for e, what in ((tp2, "82.8 s"), (ring, "113.7 s"), (tp8_full, "116.0 s")):
        assert f"{e.step_time_s:.1f} s" == what and what in comments
