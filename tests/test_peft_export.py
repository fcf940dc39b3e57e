"""PEFT interchange: a LoRA run's checkpoint exported as PEFT's adapter directory (and merged),
loaded by PEFT and transformers to composer3d's own logits; an adapter directory loaded back with
``peft.init_from``.

fp32 throughout. The runs train on 2 gloo ranks in one group (a Hugging Face Llama under FSDP, a
Qwen3 and the native model under TP + SP); composer3d's logits come from each checkpoint loaded in
this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import FAST, train_in_one_group
from hf_models import make_model
from safetensors import safe_open

from composer3d.checkpoint import SafeFileSystemReader, read_meta
from composer3d.commands.convert import main as convert
from composer3d.config.schema import PeftConfig
from composer3d.convert.common import model_config
from composer3d.models import MODEL_REGISTRY, build_model
from composer3d.parallel.pipeline.tied import to_checkpoint_names
from composer3d.peft.apply import apply_peft
from composer3d.peft.base import fill_base

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

ATOL = 1e-5
# the final checkpoint holds the weights only, in fp32: resuming it starts a run from them as
# init_from does
LORA = [
    "peft=lora",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "train.steps=3",
    "checkpoint.interval=3",
    "checkpoint.model_only_final=true",
    "checkpoint.export_dtype=float32",
]
HF = [o for o in FAST if not o.startswith("model=")] + [
    "model=hf",
    "train.seq_len=32",
    "data.max_tokens=30000",
    "train.micro_batch_size=1",
]
FSDP2 = ["parallel.dp_shard=2"]
TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"]
CONTINUE = ["train.steps=2", "checkpoint.interval=100"]
QLORA_MODEL = [
    "model.dim=512",
    "model.ffn_hidden_dim=1024",
    "model.n_heads=8",
    "model.n_kv_heads=4",
]  # NF4 blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_export_models")
    return {arch: make_model(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, models):
    """Three LoRA runs, each exported as an adapter directory and merged; then each continued from
    its adapter directory (``peft.init_from``) beside the same weights resumed from its
    checkpoint."""
    root = tmp_path_factory.mktemp("peft_export")
    model = {
        "llama_fsdp2": [*HF, f"model.path={models['llama']}"],
        "qwen3_tp2_sp": [*HF, f"model.path={models['qwen3']}"],
        "native_fsdp2": [*FAST, "peft.modules_to_save=[output]"],
        "native_qlora_fsdp2": [*FAST, *QLORA_MODEL],
    }
    layout = {
        "llama_fsdp2": FSDP2,
        "qwen3_tp2_sp": TP2_SP,
        "native_fsdp2": FSDP2,
        "native_qlora_fsdp2": FSDP2,
    }
    jobs = [(root / name, [*model[name], *LORA, *layout[name]]) for name in model]
    jobs[-1][1].append("peft=qlora")
    runs = dict(zip(model, train_in_one_group(jobs, nproc=2)))
    out = {}
    for name, run in runs.items():
        ckpt = run.run_dir / "checkpoints" / "step-00000003"
        for kind, extra in (("adapter", []), ("merged", ["--merge"])):
            assert (
                convert(
                    [
                        "export",
                        str(ckpt),
                        str(root / f"{name}_{kind}"),
                        "--dtype",
                        "float32",
                        *extra,
                    ]
                )
                == 0
            )
        out[name] = {
            "run": run,
            "ckpt": ckpt,
            "adapter": root / f"{name}_adapter",
            "merged": root / f"{name}_merged",
        }
    layouts = {
        "llama_fsdp2": FSDP2,
        "native_fsdp2": TP2_SP,
    }  # the native adapter loads into TP's DTensors
    jobs = []
    for name, other in layouts.items():
        base = [*model[name], *LORA, *other, *CONTINUE]
        jobs.append((root / f"{name}_init_from", [*base, f"peft.init_from={out[name]['adapter']}"]))
        jobs.append((root / f"{name}_resumed", [*base, f"checkpoint.resume={out[name]['ckpt']}"]))
    continued = train_in_one_group(jobs, nproc=2)
    for i, name in enumerate(layouts):
        out[name]["init_from"], out[name]["resumed"] = continued[2 * i], continued[2 * i + 1]
    return out


def composer3d_model(ckpt: Path) -> tuple[torch.nn.Module, int]:
    """The LoRA model of checkpoint ``ckpt``, loaded in this process (no process group), and its
    vocabulary size: the base rebuilt from the source the checkpoint records, the adapters (and
    saved modules) the checkpoint's."""
    meta = read_meta(ckpt)
    cfg = model_config(meta["config"]["model"])
    model = build_model(cfg)
    apply_peft(model, PeftConfig(**meta["config"]["peft"]))
    fill_base(model, MODEL_REGISTRY[cfg.name], cfg, meta["peft_base"], 123, torch.device("cpu"))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {
        k: v for k, v in to_checkpoint_names(model, model.state_dict()).items() if k in trained
    }
    dcp.load({"model": state}, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    return model.eval(), cfg.vocab_size


@torch.no_grad()
def logit_diffs(entry: dict) -> dict[str, float]:
    model, vocab = composer3d_model(entry["ckpt"])
    x = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = model(x)
    config = json.loads((entry["adapter"] / "adapter_config.json").read_text())

    def base():
        return AutoModelForCausalLM.from_pretrained(
            config["base_model_name_or_path"], dtype=torch.float32
        ).eval()

    adapted = peft.PeftModel.from_pretrained(base(), entry["adapter"]).eval()
    merged = AutoModelForCausalLM.from_pretrained(entry["merged"], dtype=torch.float32).eval()
    return {
        "peft": (adapted(x).logits - ours).abs().max().item(),
        "merged": (merged(x).logits - ours).abs().max().item(),
        "base_alone": (base()(x).logits - ours).abs().max().item(),
    }


@pytest.mark.parametrize("name", ["llama_fsdp2", "qwen3_tp2_sp", "native_fsdp2"])
def test_peft_loads_the_exported_adapter_to_composer3ds_logits(trained, name):
    diffs = logit_diffs(trained[name])
    assert diffs["peft"] <= ATOL and diffs["merged"] <= ATOL, diffs
    # the adapters moved the logits: the equality above is theirs
    assert diffs["base_alone"] > 1e-3, diffs


def test_the_adapter_directory_holds_peft_keys_and_config(trained):
    adapter = trained["native_fsdp2"]["adapter"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16.0, 0.0)
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["modules_to_save"] == ["lm_head"]
    # the native base, written there
    assert config["base_model_name_or_path"] == str((adapter / "base").resolve())
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.lm_head.weight" in keys and len(keys) == 2 * 7 * 2 + 1
    hf = trained["llama_fsdp2"]["adapter"]
    hf_config = json.loads((hf / "adapter_config.json").read_text())
    assert Path(hf_config["base_model_name_or_path"]) == Path(
        read_meta(trained["llama_fsdp2"]["ckpt"])["config"]["model"]["path"]
    )
    assert not (hf / "model.safetensors").exists()  # the pretrained base is model.path's, untouched


@pytest.mark.parametrize("name", ["llama_fsdp2", "native_fsdp2"])
def test_init_from_an_adapter_continues_as_resuming_its_checkpoint(trained, name):
    """The adapter directory's tensors, loaded into FSDP's (HF Llama) or TP's (native) shards, train
    on exactly as the checkpoint's weights do; the first loss is the trained model's, not the
    base's."""
    entry = trained[name]
    init_from, resumed = entry["init_from"].losses, entry["resumed"].losses
    assert len(init_from) == len(resumed) == 2
    assert max(abs(a - b) for a, b in zip(init_from, resumed)) <= ATOL, (init_from, resumed)
    assert abs(init_from[0] - entry["run"].losses[0]) > 1e-3, (init_from, entry["run"].losses)


@torch.no_grad()
def test_qlora_exports_adapters_and_a_merge_of_the_dequantized_nf4_base(trained):
    """QLoRA's base (not in the checkpoint) is rebuilt from its recorded source, quantized to NF4
    and dequantized: the native base written beside the adapter holds at most 16 values in each
    block of 64 (NF4's levels × the block's scale), the merge is that base plus scaling·B·A, and
    PEFT's adapter on that base computes the merged model's logits."""
    from safetensors.torch import load_file

    entry = trained["native_qlora_fsdp2"]
    adapter, merged_dir = entry["adapter"], entry["merged"]
    base = load_file(str(adapter / "base" / "model.safetensors"))
    merged = load_file(str(merged_dir / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    w = base[f"{name}.weight"]
    # NF4's rounding, dequantized
    assert max(len(torch.unique(block)) for block in w.reshape(-1, 64)) <= 16
    a, b = (
        lora[f"base_model.model.{name}.lora_A.weight"],
        lora[f"base_model.model.{name}.lora_B.weight"],
    )
    assert b.abs().max() > 0  # trained
    torch.testing.assert_close(merged[f"{name}.weight"], w + 2.0 * (b @ a), rtol=0, atol=1e-6)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    config = json.loads((adapter / "adapter_config.json").read_text())
    base_model = AutoModelForCausalLM.from_pretrained(
        config["base_model_name_or_path"], dtype=torch.float32
    )
    adapted = peft.PeftModel.from_pretrained(base_model, adapter).eval()
    full = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert (adapted(x).logits - full(x).logits).abs().max().item() <= ATOL
    assert "NF4" in (adapter / "README.md").read_text()
