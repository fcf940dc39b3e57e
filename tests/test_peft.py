"""LoRA and QLoRA (``peft=lora|qlora``): adapters trained on a frozen base under every layout,
against plain PyTorch.

The layouts run through ``composer3d.commands.train.run`` in one 8-process group (start-up paid
once); the one-process references through the command. fp32 throughout, so every layout follows the
one-process curve within 1e-4.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import FAST, assert_follows, logged, spawn, train_in_one_group, train_job
from hf_models import make_model
from hydra import compose, initialize_config_module

from composer3d.checkpoint import read_meta
from composer3d.config.registration import register_configs
from composer3d.convert.export import stored_model_shapes

# A learning rate at which the adapters move the loss within 10 steps (LoRA's are higher than full
# fine-tuning's).
LORA = ["peft=lora", "optim.lr=1e-2", "optim.warmup_steps=2", "train.steps=10"]
LAYOUTS = {  # the default run: each parallelism on 2 ranks (2 processes on CI's 2 cores)
    "pp2": ["parallel.pp=2", "parallel.dp_shard=1", "checkpoint.interval=5"],
    "fsdp2_ac": ["parallel.dp_shard=2", "memory.activation_checkpointing=full"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"],
}
# 8 processes take ~7 minutes on 2 cores: slow. Their parts (FSDP, TP + SP, PP) run in the default
# run above.
LAYOUTS_8 = {
    "pp2_fsdp2_tp2_sp": [
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.micro_batch_size=1",
    ],
    "fsdp8": ["parallel.dp_shard=8", "train.micro_batch_size=1"],
    "tp2_sp_fsdp4": [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.dp_shard=4",
        "train.micro_batch_size=1",
    ],
    "pp2_fsdp4": ["parallel.pp=2", "parallel.dp_shard=4", "train.micro_batch_size=1"],
}
# Linears dominate: 2 layers of 512 wide, MLP 4096 wide (14.2M of 14.7M parameters).
QLORA_MODEL = [
    "model.dim=512",
    "model.ffn_hidden_dim=4096",
    "model.n_heads=8",
    "model.n_kv_heads=4",
]
QLORA = ["peft=qlora", "optim.lr=3e-3", "optim.warmup_steps=2", "train.steps=4", *QLORA_MODEL]


# A tiny random Qwen3 (transformers), its pretrained weights loaded into the LoRA-wrapped linears
HF = [o for o in FAST if not o.startswith("model=")] + [
    "model=hf",
    "train.seq_len=32",
    "data.max_tokens=30000",
    "checkpoint.enabled=false",
    "train.micro_batch_size=1",
]


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    return train_job(tmp_path_factory.mktemp("lora_ref"), *FAST, *LORA)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, qwen3):
    """The LoRA layouts, a resume of the PP run's step-5 checkpoint under TP + SP, QLoRA under FSDP
    and its step-2 checkpoint resumed, a Hugging Face model's LoRA under TP + SP beside its full
    fine-tune's first step, and LoRA on a full checkpoint's weights (``peft.base_from``) resumed
    under TP + SP, in one group of 2 processes."""
    root = tmp_path_factory.mktemp("lora_layouts")
    (root / "valid.txt").write_text("def f(x):\n    return x + 1\n" * 60)
    jobs = {name: [*FAST, *LORA, *overrides] for name, overrides in LAYOUTS.items()}
    # the global batch as one micro-batch: a tensor-parallel step costs DTensor's dispatch per
    # micro-batch (LoRA's accumulation is the other layouts')
    jobs["tp2_sp"].append("train.micro_batch_size=8")
    jobs["resumed_tp2_sp"] = [
        *FAST,
        *LORA,
        *LAYOUTS["tp2_sp"],
        f"checkpoint.resume={_step(root / 'pp2', 5)}",
    ]
    qlora = [*FAST, *QLORA, "parallel.dp_shard=2"]
    jobs["qlora_fsdp2"] = [
        *qlora,
        "checkpoint.interval=2",
        "train.eval_every=4",
        f"eval.path={root / 'valid.txt'}",
    ]
    jobs["qlora_resumed_fsdp2"] = [*qlora, f"checkpoint.resume={_step(root / 'qlora_fsdp2', 2)}"]
    jobs["qlora_resumed_pp2"] = [
        *FAST,
        *QLORA,
        *LAYOUTS["pp2"],
        f"checkpoint.resume={_step(root / 'qlora_fsdp2', 2)}",
    ]
    hf = [*HF, f"model.path={qwen3}"]
    jobs["hf_lora_tp2_sp"] = [*hf, *LORA, *LAYOUTS["tp2_sp"]]
    jobs["hf_full_fsdp2"] = [*hf, "train.steps=1", "parallel.dp_shard=2"]
    # a full run's final weights; a full run started from them, and LoRA on them (resumed under TP +
    # SP)
    fsdp2 = ["parallel.dp_shard=2", "train.steps=4"]
    jobs["full_fsdp2"] = [
        *FAST,
        *fsdp2,
        "optim.lr=1e-2",
        "checkpoint.model_only_final=true",
        "checkpoint.export_dtype=float32",
    ]
    full = _step(root / "full_fsdp2", 4)
    jobs["full_from_its_weights"] = [*FAST, *fsdp2, "train.steps=1", f"checkpoint.resume={full}"]
    jobs["lora_on_full"] = [*FAST, *LORA, *fsdp2, f"peft.base_from={full}", "checkpoint.interval=2"]
    jobs["lora_on_full_resumed_tp2_sp"] = [
        *FAST,
        *LORA,
        *LAYOUTS["tp2_sp"],
        "train.steps=4",
        f"peft.base_from={full}",
        f"checkpoint.resume={_step(root / 'lora_on_full', 2)}",
    ]
    # LoRA on them under PP (each stage reads its blocks of the base from the checkpoint)
    jobs["lora_on_full_pp2"] = [
        *FAST,
        *LORA,
        *LAYOUTS["pp2"],
        "train.steps=4",
        f"peft.base_from={full}",
    ]
    # QLoRA on a full run's weights (of QLoRA's model: whole NF4 blocks), quantized to NF4 as they
    # load, beside a full run started from them
    full_qlora_model = [*FAST, *QLORA_MODEL, *fsdp2]
    jobs["full_qlora_model"] = [
        *full_qlora_model,
        "optim.lr=3e-3",
        "checkpoint.model_only_final=true",
        "checkpoint.export_dtype=float32",
    ]
    weights = _step(root / "full_qlora_model", 4)
    jobs["full_qlora_model_from_its_weights"] = [
        *full_qlora_model,
        "train.steps=1",
        f"checkpoint.resume={weights}",
    ]
    jobs["qlora_on_full"] = [*FAST, *QLORA, "parallel.dp_shard=2", f"peft.base_from={weights}"]
    return dict(
        zip(jobs, train_in_one_group([(root / name, o) for name, o in jobs.items()], nproc=2))
    )


def _step(run_dir, step: int):
    return run_dir / "checkpoints" / f"step-{step:08d}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_follows_the_one_process_curve(name, reference, runs):
    _assert_follows(reference, runs[name], name)


@pytest.mark.slow  # 8 processes; FSDP, TP + SP and PP each follow the curve in the default run
def test_lora_follows_the_one_process_curve_on_8_ranks(reference, tmp_path):
    jobs = [(tmp_path / name, [*FAST, *LORA, *overrides]) for name, overrides in LAYOUTS_8.items()]
    for name, run in zip(LAYOUTS_8, train_in_one_group(jobs, nproc=8)):
        _assert_follows(reference, run, name)


def _assert_follows(reference, run, name):
    assert_follows(reference, run, name)
    assert run.run_info["trainable_params"] == reference.run_info["trainable_params"]


def test_hugging_face_lora_loads_the_pretrained_base_and_follows_one_process(tmp_path, qwen3, runs):
    """Qwen3 (q/k norms, GQA) with its pretrained weights under the adapters: the first step (B = 0)
    is the full model's own loss; TP 2 + SP follows the one-process curve."""
    one = train_job(tmp_path / "one", *HF, f"model.path={qwen3}", *LORA)
    sharded, full = runs["hf_lora_tp2_sp"], runs["hf_full_fsdp2"]
    assert abs(one.losses[0] - full.losses[0]) < 1e-5, (one.losses[0], full.losses[0])
    diffs = [abs(a - b) for a, b in zip(one.losses, sharded.losses)]
    assert len(sharded.losses) == 10 and max(diffs) < 1e-4, (one.losses, sharded.losses)
    assert (
        one.losses[-1] < one.losses[0]
        and one.run_info["trainable_params"] < full.run_info["num_params"] / 5
    )


def test_lora_trains_only_the_adapters(reference):
    info = reference.run_info
    # tiny: dim 64, 4 kv heads of 16 (kv width 32), MLP 192; rank 8 on q, k, v, o, w1, w2, w3 of 2
    # layers
    per_layer = 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 192) * 3)
    assert info["trainable_params"] == 2 * per_layer < info["num_params"] / 5
    assert reference.losses[-1] < reference.losses[0] - 0.3, reference.losses  # the adapters learn
    # MFU's FLOPs: forward and activation gradients through base and adapters (4·N), weight
    # gradients for the adapters alone (2·A), causal attention 6·L·H·Q·T; a full fine-tune's 6·N is
    # well above it
    matmul, adapters, attention = info["num_params"] - 512 * 64, 2 * per_layer, 6 * 2 * 64 * 64
    assert info["flops_per_token"] == 4 * (matmul + adapters) + 2 * adapters + attention
    # less the base's weight gradients
    assert info["flops_per_token"] < 0.83 * (6 * matmul + attention)


def test_lora_resumes_under_another_layout(reference, runs):
    """PP 2 saved step 5: the adapters and their Adam state, not the frozen base (its source
    recorded); TP 2 + SP rebuilt the base, resumed it and continued the one-process curve."""
    resumed = runs["resumed_tp2_sp"].metrics
    assert [m["step"] for m in resumed] == list(range(6, 11))
    diffs = [abs(m["loss"] - ref) for m, ref in zip(resumed, reference.losses[5:])]
    assert max(diffs) < 1e-4, diffs
    step5 = _step(runs["pp2"].run_dir, 5)
    assert read_meta(step5)["peft_base"] == {"seed": 0}
    stored = set(stored_model_shapes(step5))
    assert stored == {
        f"layers.{i}.{w}.lora_{ab}.weight"
        for i in range(2)
        for ab in "AB"
        for w in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    # on disk: the adapters and their two Adam moments in fp32 (12 bytes a parameter, and
    # torch.save's framing of each small tensor): less than the base's fp32 weights alone would take
    trainable, base = reference.run_info["trainable_params"], reference.run_info["num_params"]
    data = sum(f.stat().st_size for f in step5.glob("*.distcp"))
    assert 12 * trainable <= data < 4 * base, (data, trainable, base)


def test_lora_on_a_full_checkpoints_weights_starts_at_its_loss_and_resumes_from_it(reference, runs):
    """``peft.base_from``: the adapters start at B = 0 on the full run's final weights, so LoRA's
    first loss is the loss of those weights on the first batch (a full run started from them); its
    checkpoints record the base's source, and TP 2 + SP resumed one, rebuilt the base from that
    checkpoint and continued the curve."""
    lora, full = runs["lora_on_full"], runs["full_from_its_weights"]
    assert abs(lora.losses[0] - full.losses[0]) < 1e-6, (lora.losses[0], full.losses[0])
    assert abs(lora.losses[0] - reference.losses[0]) > 0.1  # not the seed's base
    assert lora.losses[-1] < lora.losses[0], lora.losses  # the adapters learn
    step2 = _step(lora.run_dir, 2)
    assert read_meta(step2)["peft_base"] == {
        "checkpoint": str(_step(runs["full_fsdp2"].run_dir, 4))
    }
    resumed = runs["lora_on_full_resumed_tp2_sp"].metrics
    assert [m["step"] for m in resumed] == [3, 4]
    diffs = [abs(m["loss"] - ref) for m, ref in zip(resumed, lora.losses[2:])]
    assert max(diffs) < 1e-4, diffs


def test_peft_base_from_under_pp_and_under_qlora(runs):
    """``peft.base_from`` under PP 2: each stage's blocks of the base come from the full checkpoint,
    so its curve is FSDP's (``lora_on_full``) within 1e-4; under QLoRA the base is that checkpoint
    quantized to NF4: its first loss is the full weights' to within NF4's rounding, far from the
    seed's, and its checkpoints record the base's source."""
    lora = runs["lora_on_full"].losses
    pp = runs["lora_on_full_pp2"].losses
    assert len(pp) == len(lora) == 4 and max(abs(a - b) for a, b in zip(pp, lora)) < 1e-4, (
        pp,
        lora,
    )
    qlora, full = runs["qlora_on_full"], runs["full_qlora_model_from_its_weights"]
    assert abs(qlora.losses[0] - full.losses[0]) < 0.01, (qlora.losses[0], full.losses[0])
    # not the seed's base: QLoRA's from the seed starts elsewhere
    assert abs(qlora.losses[0] - runs["qlora_fsdp2"].losses[0]) > 0.1
    assert qlora.losses[-1] < qlora.losses[0], qlora.losses
    assert read_meta(_step(qlora.run_dir, 4))["peft_base"] == {
        "checkpoint": str(_step(runs["full_qlora_model"].run_dir, 4))
    }


def test_qlora_stores_the_base_in_nf4_and_follows_one_process_under_fsdp(tmp_path, runs):
    one = train_job(tmp_path / "qlora", *FAST, *QLORA)
    sharded = runs["qlora_fsdp2"]
    diffs = [abs(a - b) for a, b in zip(one.losses, sharded.losses)]
    assert len(one.losses) == 4 and max(diffs) < 1e-4, (one.losses, sharded.losses)
    assert one.losses[-1] < one.losses[0], one.losses
    for run, ranks in ((one, 1), (sharded, 2)):
        info = run.run_info
        frozen = info["num_params"]  # every parameter of the base is frozen (no modules_to_save)
        bf16 = 2 * frozen / ranks
        assert info["frozen_param_bytes_per_rank"] <= 0.35 * bf16, (
            info["frozen_param_bytes_per_rank"],
            bf16,
        )


def test_qlora_resumes_bit_exact_and_evaluates_from_its_rebuilt_nf4_base(runs):
    """The checkpoints hold the adapters, not the NF4 base: resuming step 2 re-quantizes the base
    (whole, then cut to each rank's rows) and continues bit for bit, and under PP 2 (each stage's
    layers whole) on the curve; composer3d-eval of step 4 in one process rebuilds it from the
    recorded seed (not its own train.seed) to the loss the run measured."""
    run, resumed, pp2 = runs["qlora_fsdp2"], runs["qlora_resumed_fsdp2"], runs["qlora_resumed_pp2"]
    assert [m["step"] for m in resumed.metrics] == [m["step"] for m in pp2.metrics] == [3, 4]
    assert resumed.losses == run.losses[2:], (resumed.losses, run.losses)
    assert max(abs(a - b) for a, b in zip(pp2.losses, run.losses[2:])) < 1e-4, (
        pp2.losses,
        run.losses,
    )
    assert not any("base_layer" in name for name in stored_model_shapes(_step(run.run_dir, 2)))
    measured = next(m["eval_loss"] for m in run.metrics if m["step"] == 4)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer3d.commands.evaluate",
            "launch.device=cpu",
            "train.seq_len=64",
            "train.seed=7",
            "logging.progress_bar=false",
            f"eval.path={run.run_dir.parent / 'valid.txt'}",
            f"checkpoint.resume={_step(run.run_dir, 4)}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][0])
    assert abs(got["loss"] - measured) < 1e-4, (got, measured)


def test_composer3d_generate_runs_a_qlora_checkpoint_cached_as_recomputed(runs):
    """composer3d-generate of a QLoRA checkpoint rebuilds its NF4 base from the record and adds the
    adapters: greedy tokens through the KV cache equal those of the whole-sequence recompute
    path."""
    step = _step(runs["qlora_fsdp2"].run_dir, 4)
    tokens = []
    for cache in ("static", "none"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "composer3d.commands.generate",
                "launch.device=cpu",
                "generate.output=json",
                f"checkpoint.resume={step}",
                "generate.prompt=hello there",
                "generate.max_new_tokens=8",
                "generate.stop_at_eos=false",
                f"generate.cache={cache}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        tokens.append(json.loads(proc.stdout.strip().splitlines()[-1])["completion_ids"])
    assert len(tokens[0]) == 8 and tokens[0] == tokens[1], tokens


def test_lora_math_matches_plain_pytorch_for_a_step():
    """One step of composer3d's LoRA model and optimizer against a plain PyTorch reference: the same
    base model without adapters (same seed: the same weights), each targeted linear's output plus
    alpha/r · x Aᵀ Bᵀ by forward hooks, AdamW over A and B alone. The losses before and after the
    step and the updated adapters agree."""
    from composer3d.models import build_model
    from composer3d.models.init import materialize
    from composer3d.optim.build import build_optimizer
    from composer3d.peft.apply import apply_peft

    cfg = _compose(
        ["model=tiny", "peft=lora", "peft.rank=4", "peft.alpha=8", "optim.warmup_steps=1"]
    )
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    lora = build_model(cfg.model)
    apply_peft(lora, cfg.peft)
    materialize(lora, torch.device("cpu"), seed=0)
    optimizer, _ = build_optimizer(lora, cfg.optim)
    frozen = [p for p in lora.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen) == sum(
        p.numel() for p in build_model(cfg.model).parameters()
    )

    plain = build_model(cfg.model)
    materialize(plain, torch.device("cpu"), seed=0)
    plain.requires_grad_(False)
    adapters = {}
    for name, module in plain.named_modules():
        if name.rpartition(".")[2] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            a = lora.get_submodule(name).lora_A.weight.detach().clone().requires_grad_()
            b = lora.get_submodule(name).lora_B.weight.detach().clone().requires_grad_()
            adapters[name] = (a, b)
            module.register_forward_hook(
                lambda m, args, out, a=a, b=b: out + 2.0 * (args[0] @ a.T) @ b.T
            )
    reference_optimizer = torch.optim.AdamW(
        [p for ab in adapters.values() for p in ab],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    assert len(adapters) == 14 and all((b == 0).all() for _, b in adapters.values())

    def loss(model):
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    for model, opt in ((lora, optimizer), (plain, reference_optimizer)):
        before = loss(model)
        before.backward()
        opt.step()
        model.after = loss(model).item()
        model.before = before.item()
    assert abs(lora.before - plain.before) < 1e-6 and abs(lora.after - plain.after) < 1e-6
    assert lora.after != lora.before
    for name, (a, b) in adapters.items():
        torch.testing.assert_close(lora.get_submodule(name).lora_B.weight, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(lora.get_submodule(name).lora_A.weight, a, rtol=0, atol=1e-6)
        assert (b != 0).any()
    assert all(p.grad is None for p in frozen) and not any(
        id(p) in map(id, frozen) for p in optimizer.state
    )


def test_frozen_base_has_no_optimizer_state_and_no_gradient_collectives(tmp_path):
    spawn(_count_collectives, 2, tmp_path)


def _count_collectives(rank, world_size):
    """FSDP over 2 ranks: the reduce-scatters carry exactly the adapters' gradients (padded to the
    shard size), the all-gathers the whole model (the frozen base is gathered for the forward, as it
    must be)."""
    from composer3d.config.checks import validate
    from composer3d.optim.build import build_optimizer
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.assemble import build_parallel_model

    cfg = _compose([*FAST, "peft=lora", "launch.nproc_per_node=2", "precision.param_dtype=float32"])
    mesh = ParallelMesh(validate(cfg, world_size), "cpu")
    model = build_parallel_model(cfg, mesh, torch.device("cpu")).model
    optimizer, _ = build_optimizer(model, cfg.optim)
    carried = {"reduce_scatter": 0, "all_gather": 0}

    def counting(name, original):
        def collective(*args, **kwargs):
            carried[name] += kwargs.get("input", args[1] if len(args) > 1 else None).numel()
            return original(*args, **kwargs)

        return collective

    originals = {
        "reduce_scatter_tensor": dist.reduce_scatter_tensor,
        "all_gather_into_tensor": dist.all_gather_into_tensor,
    }
    for attr in ("reduce_scatter_single", "all_gather_single"):
        if hasattr(dist, attr):
            originals[attr] = getattr(dist, attr)
    try:
        for attr, original in originals.items():
            setattr(
                dist,
                attr,
                counting("reduce_scatter" if "reduce" in attr else "all_gather", original),
            )
        tokens = torch.randint(
            0, cfg.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(rank)
        )
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
    finally:
        for attr, original in originals.items():
            setattr(dist, attr, original)
    params = dict(model.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    padded = sum(
        math.ceil(p.shape[0] / world_size) * world_size * p[0].numel() for p in trainable.values()
    )
    assert carried["reduce_scatter"] == padded, (carried, padded)
    # each rank sends its shard
    assert carried["all_gather"] * world_size >= sum(p.numel() for p in params.values())
    assert all(p.grad is None for n, p in params.items() if n not in trainable)
    assert all(p.grad is not None for p in trainable.values())
    state_ids = {id(p) for p in optimizer.state}
    assert state_ids == {id(p) for p in trainable.values()}


def _compose(overrides: list[str]):
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose("train", overrides=["run.dir=unused", *overrides])
    cfg.precision.param_dtype = "float32"
    return cfg


def test_modules_to_save_train_whole_beside_the_adapters():
    from composer3d.models import build_model
    from composer3d.peft.apply import apply_peft, trainable_params

    cfg = _compose(
        ["model=tiny", "peft=lora", "peft.modules_to_save=[output]", "peft.target_modules=[wq,wv]"]
    )
    model = build_model(cfg.model)
    counted = trainable_params(model, cfg.peft)
    apply_peft(model, cfg.peft)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == {"output.weight"} | {
        f"layers.{i}.attention.{w}.lora_{ab}.weight"
        for i in range(2)
        for w in ("wq", "wv")
        for ab in "AB"
    }
    assert counted == sum(trainable.values()) == 512 * 64 + 2 * 8 * ((64 + 64) + (64 + 32))
    assert not model.layers[
        "0"
    ].attention.wk.weight.requires_grad  # not targeted: frozen, not wrapped


def test_compiled_lora_blocks_have_no_graph_break_and_train_as_eager():
    """Each block with its LoRA linears compiled (dynamo's graphs through aot_eager, the joint
    forward and backward graph run without a code generator): no graph break, no recompilation at
    later steps, and the losses of 3 AdamW steps equal to the eager model's (1e-6), its adapters to
    2e-5 of the ~3e-2 they moved: eager RoPE is one complex product, compiled the pairwise products
    Inductor fuses, the same numbers forward and a rounding apart in backward, which AdamW's
    normalized steps carry into the weights. (``compile.enabled=true`` runs them through inductor:
    test_lora_compiled_run_follows_eager, slow.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from composer3d.models import build_model
    from composer3d.models.init import materialize
    from composer3d.optim.build import build_optimizer
    from composer3d.peft.apply import apply_peft

    cfg = _compose(
        ["model=tiny", "model.n_layers=1", "peft=lora", "optim.warmup_steps=1", "optim.lr=1e-2"]
    )
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0)
    )
    torch._dynamo.reset()
    counters.clear()
    curves, models = [], []
    for compiled in (False, True):
        model = build_model(cfg.model)
        apply_peft(model, cfg.peft)
        materialize(model, torch.device("cpu"), seed=0)
        if compiled:
            for block in model.layers.values():
                block.compile(backend="aot_eager")
        optimizer, _ = build_optimizer(model, cfg.optim)
        losses, graphs = [], []
        for _ in range(3):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
        curves.append(losses)
        models.append(model)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # compiled at the first step, never again
    assert graphs[0] >= 1 and graphs[0] == graphs[-1], graphs
    assert max(abs(a - b) for a, b in zip(*curves)) < 1e-6 and curves[0][-1] < curves[0][0], curves
    eager, compiled = (dict(m.named_parameters()) for m in models)
    for name in (n for n, p in eager.items() if p.requires_grad):
        torch.testing.assert_close(compiled[name], eager[name], rtol=0, atol=2e-5)


# compile and LoRA each train in the default run; here inductor compiles LoRA's blocks
@pytest.mark.slow
def test_lora_compiled_run_follows_eager(reference, tmp_path):
    compiled = train_job(tmp_path / "compiled", *FAST, *LORA, "compile.enabled=true")
    diffs = [abs(a - b) for a, b in zip(reference.losses, compiled.losses)]
    assert len(compiled.losses) == 10 and max(diffs) < 1e-4, (reference.losses, compiled.losses)


def test_adapters_over_a_random_base_are_said_before_any_worker(tmp_path):
    """peft=lora on the native model without peft.base_from trains over the seed's initialization:
    allowed (reproducible), and the preflight says so once; a named base says nothing."""
    import logging

    from composer3d.config.checks import resolve_model_config
    from composer3d.launch.preflight import preflight

    make_model(tmp_path / "hf", "llama")
    with logged(logging.WARNING) as said:
        for run, model in (
            ("random", ["model=tiny"]),
            ("named", ["model=hf", f"model.path={tmp_path}/hf"]),
        ):
            cfg = _compose([*model, "peft=lora", "launch.device=cpu"])
            cfg.run.dir = str(tmp_path / run)
            resolve_model_config(cfg.model)  # as the command does: model=hf reads its config.json
            before = len(said)
            preflight(cfg, 1)
            random_base = [m for m in said[before:] if "trains adapters over a random base" in m]
            assert len(random_base) == (1 if run == "random" else 0), said[before:]
    assert "train.seed=" in said[0] and "peft.base_from=" in said[0], said
