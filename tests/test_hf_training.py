"""model=hf through the CLI: training parity across layouts, export round trips, clear errors.

Each architecture trains 10 steps from its pretrained (random, saved) weights under FSDP×TP+SP,
PP×FSDP, and (``pytest -m slow``) FSDP alone and PP×FSDP×TP+SP on 8 processes, and must follow the
single-process curve within 1e-4 (fp32, deterministic). The parity runs of a layout share one
process group (``train_in_one_group``); the tests after them use the command. Under PP×FSDP the
default run trains the architectures whose pipeline stages differ, under FSDP×TP+SP those whose
tensor-parallel step differs (``DEFAULT_ARCHITECTURES``), the slow one the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from harness import FAST, convert, train_command, train_in_one_group, train_job
from hf_models import ARCHITECTURES, make_model
from safetensors import safe_open

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HF_FAST = [o for o in FAST if not o.startswith("model=")] + [
    "model=hf",
    "train.steps=10",
    "train.seq_len=32",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "data.max_tokens=30000",
    "checkpoint.enabled=false",
]
LAYOUTS = {  # name: (processes, overrides)
    # FSDP alone: slow, as each architecture trains under FSDP in the two layouts below
    "fsdp2": (2, ["parallel.dp_shard=2"]),
    # a rank's 4 sequences as one micro-batch: a tensor-parallel step costs DTensor's dispatch per
    # micro-batch (accumulation under FSDP × TP is test_parity's)
    "fsdp2_tp2_sp": (
        4,
        [
            "parallel.dp_shard=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "train.micro_batch_size=4",
        ],
    ),
    "pp2_fsdp2": (4, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_schedule=1f1b"]),
    # 8 processes on CI's 2 cores take ~6 s a step (DTensor dispatch in every process): marked slow.
    # The default run covers it in parts: this 3-D layout's forward against transformers' logits
    # (test_hf_models, 8 processes), and training under each pair of its dimensions above.
    "pp2_fsdp2_tp2_sp": (
        8,
        [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.pp_schedule=1f1b",
        ],
    ),
}
# What the default run trains under each of its layouts: under FSDP × TP + SP, beside Llama, the
# architectures whose tensor-parallel step differs from its (Gemma 2's capped logits and scaled
# embeddings, Phi-3's fused qkv and gate-up projections split per part, Gemma 3's per-head q/k
# norms); under PP × FSDP, beside Llama, those whose stages differ from its (Gemma 2's first and
# last stage, Gemma 3's rotary embeddings per layer type in every stage). Every architecture's
# forward under both layouts is checked against transformers' logits in the default run
# (test_hf_models); the others train under them in the slow run.
DEFAULT_ARCHITECTURES = {
    "fsdp2_tp2_sp": ["llama", "gemma2", "phi3", "gemma3_text"],
    "pp2_fsdp2": ["llama", "gemma2", "gemma3_text"],
}
# what activation checkpointing and compile train (its per-head q/k norms inside the recomputed and
# the compiled blocks)
CHECKPOINTED = "qwen3"
# layout -> the architectures the slow run trains under it
SLOW_CASES = {
    name: [arch for arch in ARCHITECTURES if arch not in DEFAULT_ARCHITECTURES.get(name, [])]
    for name in LAYOUTS
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_train")
    return {arch: make_model(root / arch, arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}


@pytest.fixture(scope="module")
def single_process(model_dirs, tmp_path_factory) -> dict[str, list[float]]:
    """architecture -> its curve in one process."""
    return _single_process_curves(
        tmp_path_factory.mktemp("hf_single"),
        model_dirs,
        sorted({CHECKPOINTED, *(a for archs in DEFAULT_ARCHITECTURES.values() for a in archs)}),
    )


def _single_process_curves(
    root: Path, model_dirs: dict[str, Path], archs: list[str]
) -> dict[str, list[float]]:
    runs = train_in_one_group(
        [(root / arch, [*HF_FAST, f"model.path={model_dirs[arch]}"]) for arch in archs], nproc=1
    )
    curves = {arch: run.losses for arch, run in zip(archs, runs)}
    for arch, losses in curves.items():
        assert len(losses) == 10 and losses[-1] < losses[0], (arch, losses)
    return curves


def _jobs(
    root: Path, layout: str, model_dirs: dict[str, Path], archs: list[str]
) -> list[tuple[Path, list[str]]]:
    return [
        (root / layout / arch, [*HF_FAST, f"model.path={model_dirs[arch]}", *LAYOUTS[layout][1]])
        for arch in archs
    ]


@pytest.fixture(scope="module")
def layout_runs(model_dirs, tmp_path_factory) -> dict[str, dict]:
    """layout -> architecture -> its run: the default run's layouts and architectures, those of one
    world size in one process group (its start-up paid once)."""
    root = tmp_path_factory.mktemp("hf_layouts")
    runs = {}
    for nproc in sorted({LAYOUTS[name][0] for name in DEFAULT_ARCHITECTURES}):
        cases = [
            (name, arch)
            for name, archs in DEFAULT_ARCHITECTURES.items()
            if LAYOUTS[name][0] == nproc
            for arch in archs
        ]
        results = train_in_one_group(
            [job for name, arch in cases for job in _jobs(root, name, model_dirs, [arch])],
            nproc,
        )
        for (name, arch), run in zip(cases, results):
            runs.setdefault(name, {})[arch] = run
    return runs


def _assert_parity(arch: str, layout: str, losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    assert worst < 1e-4, f"{arch} under {layout}: max |Δloss| {worst:.3g}\n{losses}\n{reference}"


# its first case's setup trains the module's shared runs (5 architectures in one process, then 7
# layout runs on 4 ranks): about 150 s alone on 2 cores, more beside another xdist worker
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", list(DEFAULT_ARCHITECTURES))
def test_training_parity(layout, model_dirs, single_process, layout_runs):
    """The default run's architectures under the layout, on the one-process curve."""
    assert sorted(layout_runs[layout]) == sorted(DEFAULT_ARCHITECTURES[layout])
    for arch, run in layout_runs[layout].items():
        _assert_parity(arch, layout, run.losses, single_process[arch])


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(name for name, archs in SLOW_CASES.items() if archs))
def test_training_parity_of_the_slow_layouts(layout, model_dirs, single_process, tmp_path):
    archs = SLOW_CASES[layout]
    # the curves of the architectures the default run does not train
    reference = {
        **single_process,
        **_single_process_curves(
            tmp_path / "single", model_dirs, [a for a in archs if a not in single_process]
        ),
    }
    runs = train_in_one_group(_jobs(tmp_path, layout, model_dirs, archs), nproc=LAYOUTS[layout][0])
    for arch, run in zip(archs, runs):
        _assert_parity(arch, layout, run.losses, reference[arch])


# Adam's update lr·m/(√v+eps) with these underflows to exactly 0 in fp32 (even for weights that are
# 0).
NO_UPDATE = ["optim.lr=1e-30", "optim.eps=1e30", "optim.weight_decay=0"]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_load_then_export_is_identity_and_trained_export_loads(tmp_path):
    """Load HF → save after a step that changes nothing → export: the same tensors, bit for bit.
    Then train under FSDP×TP → export → transformers loads exactly the exported tensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = make_model(tmp_path / "src", "qwen3", tie_word_embeddings=True)
    frozen = train_job(
        tmp_path / "frozen",
        *HF_FAST,
        f"model.path={source}",
        "train.steps=1",
        *NO_UPDATE,
        "checkpoint.enabled=true",
        "parallel.dp_shard=2",
        nproc=2,
    )
    ckpt = frozen.run_dir / "checkpoints" / "step-00000001"
    proc = convert("export", ckpt, tmp_path / "same", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    before, after = _tensors(source), _tensors(tmp_path / "same")
    assert set(before) == set(after)  # a tied head stays out, as transformers saves it
    for name in before:
        assert torch.equal(before[name], after[name]), name

    trained = train_job(
        tmp_path / "trained",
        *HF_FAST,
        f"model.path={source}",
        "train.steps=3",
        "checkpoint.enabled=true",
        "parallel.dp_shard=2",
        "parallel.tp=2",
        nproc=4,
    )
    proc = convert(
        "export",
        trained.run_dir / "checkpoints" / "step-00000003",
        tmp_path / "out",
        "--dtype",
        "float32",
    )
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    exported = _tensors(tmp_path / "out")
    assert any(not torch.equal(before[k], exported[k]) for k in before), "training changed nothing"
    for name, param in model.state_dict().items():
        if name in exported:
            assert torch.equal(param, exported[name]), name
    assert AutoTokenizer.from_pretrained(tmp_path / "out").eos_token == "</s>"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"


def test_mixture_of_experts_load_then_export_is_identity_and_trained_export_loads(tmp_path):
    """Mixtral, whose checkpoint holds every expert's weights one by one under ``block_sparse_moe``
    (transformers fuses and renames them while loading): loaded under FSDP and saved after a step
    that changes nothing, it exports the same tensors under the same names; trained under PP, it
    exports what transformers loads with no missing or unexpected key, into exactly the trained
    (fused) weights."""
    from transformers import AutoModelForCausalLM

    from composer3d.convert.export import export, load_hf_model_state

    source = make_model(tmp_path / "src", "mixtral")
    frozen, trained = train_in_one_group(
        [
            (
                tmp_path / "frozen",
                [
                    *HF_FAST,
                    f"model.path={source}",
                    "train.steps=1",
                    *NO_UPDATE,
                    "checkpoint.enabled=true",
                    "parallel.dp_shard=2",
                ],
            ),
            (
                tmp_path / "trained",
                [
                    *HF_FAST,
                    f"model.path={source}",
                    "train.steps=2",
                    "checkpoint.enabled=true",
                    "parallel.pp=2",
                ],
            ),
        ],
        nproc=2,
    )
    export(frozen.run_dir / "checkpoints" / "step-00000001", tmp_path / "same", dtype="float32")
    before, after = _tensors(source), _tensors(tmp_path / "same")
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in after and set(before) == set(
        after
    )
    for name in before:
        assert torch.equal(before[name], after[name]), name

    checkpoint = trained.run_dir / "checkpoints" / "step-00000002"
    export(checkpoint, tmp_path / "out", dtype="float32")
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    trained_state = load_hf_model_state(checkpoint, {"tie_embeddings": False})
    assert set(trained_state) == set(model.state_dict())
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(
        trained_state[fused], AutoModelForCausalLM.from_pretrained(source).state_dict()[fused]
    )
    for name, param in model.state_dict().items():
        assert torch.equal(param, trained_state[name]), name


def test_bad_hf_inputs_fail_before_launch(monkeypatch, capfd, tmp_path):
    good = make_model(tmp_path / "good", "llama")
    cases = []
    # No such directory
    cases.append((["model.path=/nonexistent/model"], "model.path"))
    # tp that does not divide the kv heads (2)
    cases.append(([f"model.path={good}", "parallel.tp=4", "parallel.dp_shard=1"], "parallel.tp"))
    # weights that do not match config.json
    broken = make_model(tmp_path / "broken", "llama")
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(config))
    cases.append(([f"model.path={broken}"], "shape mismatches"))
    for overrides, needle in cases:
        run = train_command(monkeypatch, capfd, tmp_path / "run", *HF_FAST, *overrides, nproc=4)
        assert run.returncode != 0 and needle in run.output, (overrides, run.output[-3000:])


@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.dp_shard=2", "memory.activation_checkpointing=full"],
        ["parallel.dp_shard=2", "memory.activation_checkpointing=selective"],
        ["compile.enabled=true"],
        [
            "compile.enabled=true",
            "memory.activation_checkpointing=selective",
        ],  # the policy traced into the graph
    ],
)
def test_activation_checkpointing_and_compile_keep_the_curve(
    extra, model_dirs, single_process, tmp_path
):
    run = train_job(
        tmp_path,
        *HF_FAST,
        f"model.path={model_dirs[CHECKPOINTED]}",
        *extra,
        nproc=2 if "dp_shard=2" in extra[0] else 1,
    )
    _assert_parity(CHECKPOINTED, " ".join(extra), run.losses, single_process[CHECKPOINTED])


def test_from_scratch_init_is_transformers_scheme_and_layout_independent(model_dirs, tmp_path):
    """model.pretrained=false: transformers' own _init_weights per parameter (Gemma's norms start at
    0, linears at std initializer_range), seeded by name, so FSDP×TP+SP starts from the same weights
    as one process."""
    import torch.distributed.checkpoint as dcp

    from composer3d.checkpoint import SafeFileSystemReader

    path = model_dirs["gemma2"]
    scratch = [
        *HF_FAST,
        f"model.path={path}",
        "model.pretrained=false",
        "train.steps=3",
        "checkpoint.enabled=true",
        *NO_UPDATE,
    ]
    single = train_job(tmp_path / "one", *scratch)
    sharded = train_job(
        tmp_path / "four",
        *scratch,
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        nproc=4,
    )
    worst = max(abs(a - b) for a, b in zip(sharded.losses, single.losses))
    assert len(single.losses) == 3 and worst < 1e-4, (sharded.losses, single.losses)
    names = [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "lm_head.weight",
    ]
    state = {
        n: torch.empty(s)
        for n, s in [(names[0], (64,)), (names[1], (128, 64)), (names[2], (512, 64))]
    }
    wrapped = {"model": state}
    dcp.load(
        wrapped,
        storage_reader=SafeFileSystemReader(single.run_dir / "checkpoints" / "step-00000003"),
        no_dist=True,
    )
    assert torch.equal(state[names[0]], torch.zeros(64))  # Gemma's (1 + w) norms start at w = 0
    assert abs(state[names[1]].std().item() - 0.1) < 0.01  # initializer_range of the fixture
    assert not torch.equal(state[names[1]], _tensors(path)[names[1]])  # not the saved weights
    # Gemma 2's layers alternate a 24-token window with full attention: of a 32-token causal layer's
    # 528 scores a windowed one computes 24 · (64 − 24 + 1) / 2 = 492 (transformers' layer_types
    # name which layers)
    from transformers import AutoConfig

    from composer3d.training.flops import flops_per_token

    config = AutoConfig.from_pretrained(path)
    layers = sum(492 / 528 if kind == "sliding_attention" else 1 for kind in config.layer_types)
    assert 0 < config.layer_types.count("sliding_attention") < len(config.layer_types)
    info = single.run_info
    assert info["flops_per_token"] == flops_per_token(
        info["num_params"], 512 * 64, layers, 4 * 16, 32
    )


def test_resume_under_another_layout(model_dirs, tmp_path):
    """3 steps under FSDP, then the same command resumed under TP+SP to step 5 = 5 steps in one
    process."""
    # A constant schedule: the LR of a step does not depend on train.steps, which the two commands
    # change.
    common = [
        *HF_FAST,
        f"model.path={model_dirs['qwen3']}",
        "checkpoint.enabled=true",
        "optim.schedule=constant",
    ]
    straight = train_job(tmp_path / "straight", *common, "train.steps=5")
    train_job(tmp_path / "resumed", *common, "train.steps=3", "parallel.dp_shard=2", nproc=2)
    resumed = train_job(
        tmp_path / "resumed",
        *common,
        "train.steps=5",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        nproc=2,
    )
    assert "resumed from" in resumed.output
    assert max(abs(a - b) for a, b in zip(resumed.losses, straight.losses)) < 1e-4
    assert len(resumed.losses) == 5
