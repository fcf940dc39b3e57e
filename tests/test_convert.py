"""composer3d-convert: export to / import from Hugging Face LlamaForCausalLM, checked against
transformers' forward."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter

from composer3d.checkpoint import META_FILE, SafeFileSystemReader, read_meta
from composer3d.config.schema import ModelConfig
from composer3d.convert.common import model_config
from composer3d.models import build_model, llama
from composer3d.models.init import materialize
from composer3d.parallel.pipeline.tied import to_checkpoint_names

transformers = pytest.importorskip("transformers")
from harness import FAST, convert, train_job
from transformers import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

# init_std 0.1 makes attention sharp enough that a wrong RoPE permutation moves logits by ~1, far
# above 1e-5.
TINY = {
    "name": "llama",
    "dim": 64,
    "n_layers": 2,
    "n_heads": 8,
    "n_kv_heads": 4,
    "vocab_size": 512,
    "ffn_hidden_dim": 96,
    "rope_theta": 10000.0,
    "max_seq_len": 128,
    "init_std": 0.1,
}
ATOL = 1e-5


def random_native(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A materialized model whose norm weights are random too (not ones), so a swapped norm mapping
    shows."""
    model = build_model(cfg)
    materialize(model, torch.device("cpu"), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def save_checkpoint(path: Path, model: torch.nn.Module, cfg: ModelConfig, model_only: bool) -> None:
    """A checkpoint in the on-disk contract: DCP files of {"model": ...} and composer3d.json,
    written last."""
    dcp.save({"model": model.state_dict()}, storage_writer=FileSystemWriter(path), no_dist=True)
    meta = {
        "format": 1,
        "step": 7,
        "model_only": model_only,
        "config": {"model": dataclasses.asdict(cfg)},
        "layout": {"dp_shard": 1, "tp": 1},
        "world_size": 1,
    }
    (path / META_FILE).write_text(json.dumps(meta))


def load_native(path: Path) -> tuple[torch.nn.Module, ModelConfig]:
    """The composer3d model of checkpoint ``path``, loaded in one process without a process
    group."""
    # nested groups (model.moe) as their dataclasses
    cfg = model_config(read_meta(path)["config"]["model"])
    model = build_model(cfg)
    materialize(model, torch.device("cpu"), seed=123)  # overwritten below
    # a tied head is stored once, as the embedding
    state = to_checkpoint_names(model, model.state_dict())
    dcp.load({"model": state}, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return model.eval(), cfg


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_logit_diff(native: torch.nn.Module, hf: LlamaForCausalLM, vocab: int) -> float:
    x = tokens(vocab)
    return (native(x) - hf(x).logits).abs().max().item()


def safetensors_dtypes(directory: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype name (\"BF16\", \"F32\", ...) over every file of
    ``directory``."""
    dtypes = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})  # noqa: SIM118 (not a dict)
    return dtypes


# ------------------------------------------------------------------------------- mapping unit tests


def test_rope_permutations_are_inverse_and_move_rows_per_head():
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)  # 4 heads of head_dim 8
    half = llama.rope_interleaved_to_half(w, n_heads=4)
    assert torch.equal(llama.rope_half_to_interleaved(half, n_heads=4), w)
    # Head 1's interleaved pairs (8,9), (10,11), ... become (8, 12), (9, 13), ...: rows stay within
    # their head.
    assert half[8:16, 0].tolist() == [w[i, 0].item() for i in (8, 10, 12, 14, 9, 11, 13, 15)]


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_mapping_round_trips(tied):
    cfg = ModelConfig(**{**TINY, "tie_embeddings": tied})
    state = random_native(cfg).state_dict()
    hf = llama.hf_state_dict_from_native(state, cfg)
    assert ("lm_head.weight" in hf) is not tied
    assert len(hf) == 2 + 9 * cfg.n_layers + (0 if tied else 1)
    back = llama.native_state_dict_from_hf(hf, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(KeyError, match="unexpected"):
        llama.native_state_dict_from_hf(
            {**hf, "model.layers.9.mlp.gate_proj.weight": torch.zeros(1)}, cfg
        )


def test_hf_config_with_rope_scaling_or_biases_is_refused():
    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "vocab_size": 512,
        "intermediate_size": 96,
    }
    llama3 = {
        **base,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0},
    }
    with pytest.raises(ValueError, match="llama3"):
        llama.native_config_from_hf(llama3)
    assert llama.native_config_from_hf(llama3, ignore_rope_scaling=True)["rope_theta"] == 500000.0
    with pytest.raises(ValueError, match="attention_bias"):
        llama.native_config_from_hf({**base, "attention_bias": True})
    # transformers 4 spelling of the RoPE base
    assert (
        llama.native_config_from_hf({**base, "rope_theta": 777.0, "rope_scaling": None})[
            "rope_theta"
        ]
        == 777.0
    )


# ------------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_matches_transformers_and_imports_back_identically(tmp_path, tied):
    cfg = ModelConfig(**{**TINY, "tie_embeddings": tied})
    model = random_native(cfg)
    save_checkpoint(tmp_path / "ckpt", model, cfg, model_only=tied)
    # Small shards: the export is sharded (with an index), which the import must follow.
    convert(
        "export",
        tmp_path / "ckpt",
        tmp_path / "hf",
        "--dtype",
        "float32",
        "--max-shard-size",
        "200KB",
    )
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1

    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.config.tie_word_embeddings is tied
    assert ("lm_head.weight" in safetensors_dtypes(tmp_path / "hf")) is not tied
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert max_logit_diff(model, hf, cfg.vocab_size) <= ATOL

    # The tolerance is meaningful: without the RoPE permutation the logits are far off.
    with torch.no_grad():
        for i in range(cfg.n_layers):
            hf.model.layers[i].self_attn.q_proj.weight.copy_(
                model.layers[str(i)].attention.wq.weight
            )
            hf.model.layers[i].self_attn.k_proj.weight.copy_(
                model.layers[str(i)].attention.wk.weight
            )
    assert max_logit_diff(model, hf, cfg.vocab_size) > 1e-2

    convert("import", tmp_path / "hf", tmp_path / "back")
    meta = read_meta(tmp_path / "back")
    assert (meta["step"], meta["model_only"], meta["world_size"], meta["layout"]) == (
        0,
        True,
        1,
        {},
    )
    assert meta["config"]["model"] == dataclasses.asdict(cfg)
    back, _ = load_native(tmp_path / "back")
    original = model.state_dict()
    for name, tensor in back.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, original[name]), name


def test_import_of_a_transformers_model_gives_its_logits_and_overrides_that_match(tmp_path):
    hf_cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        rms_norm_eps=1e-6,
        max_position_embeddings=96,
        rope_parameters={"rope_type": "default", "rope_theta": 123456.0},
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape))
    hf.save_pretrained(tmp_path / "hf")  # safetensors
    assert (tmp_path / "hf" / "model.safetensors").exists()

    proc = convert("import", tmp_path / "hf", tmp_path / "ckpt")
    native, cfg = load_native(tmp_path / "ckpt")
    assert (
        cfg.dim,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.ffn_hidden_dim,
        cfg.rope_theta,
        cfg.norm_eps,
    ) == (64, 4, 2, 80, 123456.0, 1e-6)
    assert max_logit_diff(native, hf, cfg.vocab_size) <= ATOL

    # The printed overrides give a run config whose model equals the checkpoint's, which resuming
    # requires.
    line = next(line for line in proc.stdout.splitlines() if "composer3d-train" in line)
    overrides = shlex.split(line)[1:]
    assert f"checkpoint.resume={(tmp_path / 'ckpt').resolve()}" in overrides
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from composer3d.config.registration import register_configs

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        run_cfg = compose("train", overrides=overrides)
    assert (
        OmegaConf.to_container(run_cfg.model, resolve=True)
        == read_meta(tmp_path / "ckpt")["config"]["model"]
    )


def test_bfloat16_export_writes_bfloat16_that_transformers_loads(tmp_path):
    cfg = ModelConfig(**TINY)
    model = random_native(cfg)
    save_checkpoint(tmp_path / "ckpt", model, cfg, model_only=False)
    # bfloat16 is the default; the files follow the umask (safetensors' own are 0600 whatever it is)
    proc = convert("export", tmp_path / "ckpt", tmp_path / "hf", umask=0o027)
    assert "bfloat16" in proc.stdout
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == oct(0o640) and set(modes.values()) == {oct(0o640)}, modes
    dtypes = safetensors_dtypes(tmp_path / "hf")
    assert len(dtypes) == len(llama.hf_names(cfg)) and set(dtypes.values()) == {"BF16"}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()  # dtype from config.json
    assert hf.dtype == torch.bfloat16
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        expected, got = model(x), hf(x).logits.float()
    # bf16 rounding only
    assert (expected - got).abs().max().item() < 0.1 * expected.abs().max().item()


def test_export_help_says_it_writes_bfloat16_unless_told(capsys):
    from composer3d.commands.convert import main

    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "written in bfloat16 unless --dtype says otherwise" in text and "(default: bfloat16" in text
    ), text
    assert "--dtype float32" in text


def test_export_reads_a_bfloat16_model_only_checkpoint(tmp_path):
    """checkpoint.model_only_final saves the weights in export_dtype (bfloat16 by default): export
    takes them as saved."""
    cfg = ModelConfig(**TINY)
    model = random_native(cfg)
    (tmp_path / "ckpt").mkdir()
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    dcp.save({"model": state}, storage_writer=FileSystemWriter(tmp_path / "ckpt"), no_dist=True)
    meta = {
        "format": 1,
        "step": 9,
        "model_only": True,
        "config": {"model": dataclasses.asdict(cfg)},
        "layout": {},
        "world_size": 4,
    }
    (tmp_path / "ckpt" / META_FILE).write_text(json.dumps(meta))
    convert("export", tmp_path / "ckpt", tmp_path / "hf", "--dtype", "float32")
    assert set(safetensors_dtypes(tmp_path / "hf").values()) == {"F32"}
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(
            f.get_tensor("model.layers.1.mlp.down_proj.weight"),
            state["layers.1.feed_forward.w2.weight"].float(),
        )


def test_export_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("hello")
    proc = convert("export", tmp_path / "run", tmp_path / "hf", check=False, cli=True)
    assert proc.returncode == 2, proc.stderr  # bad input, as every command's
    assert "is not a composer3d checkpoint" in proc.stderr and "composer3d.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "hf").exists()


def test_import_refuses_a_model_that_is_not_llama(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64})
    )
    proc = convert("import", tmp_path / "hf", tmp_path / "ckpt", check=False)
    assert proc.returncode == 2
    assert "'gpt2'" in proc.stderr and "only Llama" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt" / META_FILE).exists()


# --------------------------------------------------------------------------------------- end to end


def test_checkpoint_of_a_tensor_parallel_run_exports_to_transformers(tmp_path):
    """Train 2 steps on 2 processes (tp=2), export the checkpoint, and compare transformers with
    composer3d."""
    train_job(
        tmp_path / "run",
        *FAST,
        "train.steps=2",
        "checkpoint.interval=2",
        "parallel.tp=2",
        "parallel.dp_shard=1",
        nproc=2,
    )
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert read_meta(ckpt)["world_size"] == 2
    convert("export", ckpt, tmp_path / "hf", "--dtype", "float32")
    native, cfg = load_native(ckpt)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert max_logit_diff(native, hf, cfg.vocab_size) <= ATOL


def test_training_starts_from_an_imported_checkpoint(tmp_path):
    """The trainer takes the printed overrides and loads the imported weights (lr 1e-30 leaves them
    unchanged)."""
    hf_cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=320,
        max_position_embeddings=64,
    )  # byte tokenizer: 257
    torch.manual_seed(1)
    LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    proc = convert("import", tmp_path / "hf", tmp_path / "pretrained")
    overrides = shlex.split(
        next(line for line in proc.stdout.splitlines() if "composer3d-train" in line)
    )[1:]
    run = train_job(
        tmp_path / "run",
        *FAST,
        *overrides,
        "train.seq_len=32",
        "train.steps=1",
        "optim.lr=1e-30",
        "optim.warmup_steps=0",
    )
    assert "loaded model weights from" in " ".join(run.output.split()), run.output[-3000:]
    imported, _ = load_native(tmp_path / "pretrained")
    trained, _ = load_native(tmp_path / "run" / "checkpoints" / "step-00000001")
    for name, tensor in imported.state_dict().items():
        assert torch.equal(trained.state_dict()[name], tensor), name


# tiny_moe with the settings Mixtral has: every layer MoE, no shared experts (softmax router,
# renormalized top-k)
MIXTRAL_LIKE = [
    "model=tiny_moe",
    "model.moe.shared_experts=0",
    "model.moe.dense_layers=0",
    "model.moe.bias_update_rate=0",
]


def test_mixture_of_experts_checkpoint_of_an_expert_parallel_run_exports_as_mixtral(tmp_path):
    """A native MoE trained 2 steps under expert parallel × FSDP (ep 2 over dp_shard 2) exports as
    MixtralForCausalLM, whose logits are composer3d's (each expert a tensor of its own, as Mixtral's
    checkpoints hold them; routing differences would move the logits far above the tolerance);
    settings Mixtral cannot express, and a routing bias that is not zero, are refused naming
    them."""
    from transformers import MixtralForCausalLM

    fast = [o for o in FAST if not o.startswith("model=")]
    train_job(
        tmp_path / "run",
        *fast,
        *MIXTRAL_LIKE,
        "train.steps=2",
        "checkpoint.interval=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        nproc=2,
    )
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    convert("export", ckpt, tmp_path / "hf", "--dtype", "float32")
    native, cfg = load_native(ckpt)
    names = set(safetensors_dtypes(tmp_path / "hf"))
    assert "model.layers.3.block_sparse_moe.experts.7.w2.weight" in names
    assert not any("gate_up_proj" in name for name in names)
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert (hf.config.num_local_experts, hf.config.num_experts_per_tok) == (
        cfg.moe.experts,
        cfg.moe.top_k,
    )
    assert max_logit_diff(native, hf, cfg.vocab_size) <= ATOL
    with torch.no_grad():  # the tolerance is meaningful: other mixing weights move the logits
        hf.model.layers[0].mlp.gate.weight.mul_(2)
    assert max_logit_diff(native, hf, cfg.vocab_size) > 1e-3

    model_cfg = model_config(
        {
            **dataclasses.asdict(cfg),
            "moe": {
                **dataclasses.asdict(cfg.moe),
                "shared_experts": 1,
                "dense_layers": 1,
                "score_func": "sigmoid",
            },
        }
    )
    save_checkpoint(tmp_path / "shared", random_native(model_cfg), model_cfg, model_only=True)
    refused = convert("export", tmp_path / "shared", tmp_path / "out", check=False)
    assert refused.returncode == 2
    for key in (
        "model.moe.shared_experts=1",
        "model.moe.dense_layers=1",
        "model.moe.score_func=sigmoid",
    ):
        assert key in refused.stderr + refused.stdout, refused.stderr

    biased = random_native(cfg)
    with torch.no_grad():
        biased.layers["1"].moe.expert_bias[3] = 0.5
    save_checkpoint(tmp_path / "biased", biased, cfg, model_only=True)
    refused = convert("export", tmp_path / "biased", tmp_path / "out2", check=False)
    assert (
        refused.returncode == 2 and "layer 1's routing bias" in refused.stderr + refused.stdout
    ), refused.stderr
