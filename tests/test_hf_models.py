"""model=hf: transformers causal LMs loaded from local directories into composer3d's parallel
layouts.

Forward parity: the logits composer3d computes for the loaded model under each layout match
transformers' own forward on the same directory within 1e-5 (fp32). Every architecture is checked in
the same process group, so a layout costs one spawn.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from harness import spawn
from hf_models import (
    ARCHITECTURES,
    COMMON,
    MOE_ARCHITECTURES,
    hf_config,
    make_model,
    reference_logits,
)
from omegaconf import OmegaConf

from composer3d.config.checks import resolve_model_config, validate
from composer3d.config.schema import TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
ATOL = 1e-5
SEQ = 32


def _make_models(tmp_path_factory, name: str, architectures) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(name)
    return {arch: make_model(root / arch, arch, seed=i) for i, arch in enumerate(architectures)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    found = _make_models(tmp_path_factory, "hf", ARCHITECTURES)
    # Llama 3.2's layout: the head tied to the embedding (under PP the last stage's twin of it,
    # ``parallel.tied``)
    found["llama_tied"] = make_model(
        found["llama"].parent / "llama_tied", "llama", seed=len(found), tie_word_embeddings=True
    )
    return found


@pytest.fixture(scope="module")
def references(models) -> dict[str, torch.Tensor]:
    tokens = _tokens()
    return {arch: reference_logits(path, tokens) for arch, path in models.items()}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(0))


def train_config(path: Path, **parallel) -> TrainConfig:
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model = OmegaConf.merge(
        cfg.model,
        {"name": "hf", "path": str(path), "dim": 0, "n_layers": 0, "n_heads": 0, "vocab_size": 0},
    )
    cfg.run.dir = "unused"
    cfg.precision.param_dtype = "float32"
    cfg.train.seq_len = SEQ
    cfg.train.global_batch_size = 8
    cfg.train.micro_batch_size = 1
    for key, value in parallel.items():
        cfg.parallel[key] = value
    resolve_model_config(cfg.model)
    return cfg


def _forward(model, stages, mesh, tokens: torch.Tensor) -> torch.Tensor:
    """Full logits on every rank: gathered from the vocab shards and, under PP, run stage by stage
    with the hidden states broadcast over the pp group (a plain relay; the schedules are exercised
    by training)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    with torch.no_grad():
        if not stages:
            return full(model(tokens))
        group, pp = mesh["pp"].get_group(), mesh.layout.pp
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)
        num_stages = stages[0].plan.num_stages
        h = tokens
        for s in range(num_stages):
            mine = [stage for stage in stages if stage.plan.index == s]
            out = full(mine[0](h, position_ids=position_ids)).contiguous() if mine else None
            shape = torch.tensor(out.shape if out is not None else [0, 0, 0])
            dist.broadcast(shape, group=group, group_src=s % pp)
            h = out if out is not None else torch.empty(*shape.tolist())
            dist.broadcast(h, group=group, group_src=s % pp)
        return h


def _check_forward(rank, world_size, models, references, parallel):
    for arch, path in models.items():
        if arch == "llama_tied" and parallel.get("pp", 1) == 1:
            # the tied head is the embedding's own weight here: it differs only where PP splits them
            continue
        _build_and_compare(world_size, arch, path, references[arch], parallel)


def _build_and_compare(world_size, arch, path, reference, parallel):
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.assemble import build_parallel_model

    cfg = train_config(path, **parallel)
    if parallel.get("sequence_parallel"):
        cfg.parallel.sequence_parallel = True
    mesh = ParallelMesh(validate(cfg, world_size), "cpu")
    built = build_parallel_model(cfg, mesh, torch.device("cpu"))
    built.model.eval()
    logits = _forward(built.model, built.stages, mesh, _tokens())
    error = (logits - reference).abs().max().item()
    assert error < ATOL, f"{arch} under {parallel}: max |Δlogits| = {error:.3g}"
    return built


LAYOUTS = {
    "fsdp4": (4, {"dp_shard": 4}),
    "fsdp2_tp2_sp": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True}),
    "pp2_fsdp2": (4, {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_transformers(layout, models, references, tmp_path):
    world, parallel = LAYOUTS[layout]
    spawn(_check_forward, world, tmp_path, models, references, parallel)


# PP × FSDP × TP+SP on 8 processes; FSDP × TP+SP and PP × FSDP are in the default run (above)
@pytest.mark.slow
def test_forward_pp_fsdp_tp_8_procs(models, references, tmp_path):
    spawn(
        _check_forward,
        8,
        tmp_path,
        models,
        references,
        {"pp": 2, "dp_shard": 2, "tp": 2, "sequence_parallel": True, "pp_schedule": "gpipe"},
    )


def _with_plan(tmp_path: Path, plan) -> Path:
    import json

    path = make_model(tmp_path / "model", "llama")
    config = json.loads((path / "config.json").read_text())
    config["base_model_tp_plan"] = plan
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_tensor_parallel_with_an_unknown_style_is_refused_and_without_a_plan_takes_the_llama_layouts(  # noqa: E501
    tmp_path,
):
    from transformers import AutoConfig

    from composer3d.errors import ConfigError
    from composer3d.models.hf.tensor_parallel import LLAMA_LAYOUT_TP_PLAN, tp_plan

    no_plan = _with_plan(tmp_path / "none", {})
    validate(train_config(no_plan, dp_shard=2), 2)  # FSDP/PP need no plan
    # laid out like Llama: the Llama family's plan, derived
    validate(train_config(no_plan, tp=2), 2)
    assert tp_plan(AutoConfig.from_pretrained(no_plan)) == LLAMA_LAYOUT_TP_PLAN
    odd = _with_plan(
        tmp_path / "odd",
        {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "fancy_split"},
    )
    with pytest.raises(
        ConfigError, match=r"module layers\.\*\.mlp\.up_proj .* style 'fancy_split'"
    ):
        validate(train_config(odd, tp=2), 2)


def test_model_without_a_plan_still_trains_with_fsdp_and_pp(tmp_path):
    from harness import FAST, train_job

    path = _with_plan(tmp_path, {})
    run = train_job(
        tmp_path / "run",
        *[o for o in FAST if not o.startswith("model=")],
        "model=hf",
        f"model.path={path}",
        "train.steps=2",
        "train.seq_len=32",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "data.max_tokens=20000",
        "checkpoint.enabled=false",
        nproc=4,
    )
    assert len(run.losses) == 2


def _count_reads(rank, world_size, path, parallel, results):
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.assemble import build_parallel_model

    read = {"elements": 0}
    original = HuggingFaceStorageReader._process_read_request

    def counting(self, f, req, planner):
        read["elements"] += math.prod(req.lengths)
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counting
    cfg = train_config(path, **parallel)
    mesh = ParallelMesh(validate(cfg, world_size), "cpu")
    built = build_parallel_model(cfg, mesh, torch.device("cpu"))
    total = sum(math.prod(shape) for shape in built.model.full_shapes.values())
    share = read["elements"] / total
    assert share <= 1.05 / world_size + 0.01, (
        f"rank {rank} read {share:.1%} of the model under {parallel}"
    )


@pytest.mark.parametrize(
    "parallel", [{"dp_shard": 4}, {"dp_shard": 2, "tp": 2}, {"pp": 2, "dp_shard": 2}]
)
def test_each_rank_reads_only_its_shards(parallel, models, tmp_path):
    spawn(_count_reads, 4, tmp_path, models["llama"], parallel, None)


def test_tied_head_under_pipeline_parallel_is_refused_only_by_a_v_shaped_schedule(tmp_path):
    from composer3d.errors import ConfigError

    tied = make_model(tmp_path / "tied", "qwen3", tokenizer=False, tie_word_embeddings=True)
    # the head: the embedding's twin on the last stage (test_pp_tied)
    validate(train_config(tied, pp=2), 2)
    with pytest.raises(
        ConfigError,
        match="parallel.pp_schedule: zbv runs the first and the last stage on one "
        "rank.*tie_word_embeddings",
    ):
        validate(train_config(tied, pp=2, pp_schedule="zbv"), 2)


def test_hub_id_resolves_from_the_local_cache_only(tmp_path):
    """model.path=<org/name>: the snapshot already in the Hugging Face cache; a missing one is a
    clear error."""
    import subprocess
    import sys

    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "abc123"
    make_model(snapshot, "llama", tokenizer=False)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("abc123")
    script = (
        "from composer3d.models.hf import resolve_model_dir\n"
        "print(resolve_model_dir('tiny-org/tiny-llama'))\n"
        "try:\n    resolve_model_dir('tiny-org/absent')\nexcept Exception as e:\n    print(e)\n"
    )
    env = {**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    lines = out.stdout.strip().splitlines()
    assert lines[0] == str(snapshot), out.stderr
    assert (
        "model.path: 'tiny-org/absent' is neither a local directory nor a model in the local"
        in lines[1]
    )


def test_the_forward_check_passes_every_tested_architecture(models):
    """The check the launcher runs before training (a tiny replica of config.json, composer3d's
    forward against transformers'): every architecture above passes it, and under tp=2 so does
    StableLM's derived plan."""
    from composer3d.models.hf.forward_check import check_forward_matches_transformers

    for path in models.values():
        check_forward_matches_transformers(train_config(path).model, tensor_parallel=2)


# Families whose own top-level forwards scale the embeddings and/or the logits, with those scales
# away from 1.
SCALED = {
    "granite": dict(
        embedding_multiplier=12.0,
        logits_scaling=8.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078,
    ),
    "hyperclovax": dict(embedding_multiplier=3.0, logits_scaling=0.25),
    "cohere": dict(logit_scale=0.0625),
}


def _tiny_config_dir(path: Path, model_type: str, **fields) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model(
        model_type,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **fields,
    ).save_pretrained(path)
    return path


def test_embedding_and_logit_scalings_are_applied_as_each_family_does(tmp_path, monkeypatch):
    """Granite divides its logits by logits_scaling, HyperCLOVA X multiplies by the same key, Cohere
    multiplies by logit_scale: composer3d applies each, and the check sees it — without the table
    every one of them fails."""
    from composer3d.errors import ConfigError
    from composer3d.models.hf import model as hf
    from composer3d.models.hf.forward_check import check_forward_matches_transformers

    configs = {
        arch: train_config(_tiny_config_dir(tmp_path / arch, arch, **fields)).model
        for arch, fields in SCALED.items()
    }
    for cfg in configs.values():
        check_forward_matches_transformers(cfg)
    monkeypatch.setattr(hf, "_TOP_LEVEL_SCALING", {})
    for arch, cfg in configs.items():
        with pytest.raises(
            ConfigError, match=f"composer3d's forward of {arch} .* does not compute what"
        ):
            check_forward_matches_transformers(cfg)


def test_a_llama_layout_without_a_tp_plan_gets_the_llama_plan_checked_and_others_are_refused(
    models, tmp_path, monkeypatch
):
    """StableLM ships no base_model_tp_plan; laid out like Llama, it gets the Llama family's plan,
    whose split the check simulates in one process (each rank's slices of attention and MLP,
    summed). StableLM reshapes by its head count, so the plan makes the counts local — without that
    the split check refuses it. Per-head norms (StableLM's qk_layernorm) or BitNet's sub-norms
    inside attention are not split by the plan: refused, named."""
    from transformers import AutoConfig

    from composer3d.errors import ConfigError
    from composer3d.models.hf import forward_check as hf_forward_check
    from composer3d.models.hf.tensor_parallel import tensor_parallel_problem

    stablelm = train_config(models["stablelm"]).model
    assert not getattr(AutoConfig.from_pretrained(models["stablelm"]), "base_model_tp_plan", None)
    assert tensor_parallel_problem(stablelm) is None
    for tp in (2, 4):
        hf_forward_check.check_forward_matches_transformers(stablelm, tp)
    cfg = train_config(models["stablelm"], tp=2)
    assert validate(cfg, 2).tp == 2

    per_head_norms = train_config(
        _tiny_config_dir(tmp_path / "qk", "stablelm", qk_layernorm=True)
    ).model
    assert (
        "self_attn.q_layernorm.norms.0.weight, which that plan would not split"
        in tensor_parallel_problem(per_head_norms)
    )
    bitnet = train_config(_tiny_config_dir(tmp_path / "bitnet", "bitnet")).model
    assert (
        "self_attn.attn_sub_norm.weight, which that plan would not split"
        in tensor_parallel_problem(bitnet)
    )

    monkeypatch.setattr(hf_forward_check, "use_local_head_counts", lambda attention, ranks: None)
    with pytest.raises(ConfigError, match="parallel.tp: stablelm .* does not split it exactly"):
        hf_forward_check.check_forward_matches_transformers(stablelm, 2)


def test_an_architecture_whose_forward_composer3d_does_not_reproduce_is_refused_before_launch(
    monkeypatch, capfd, tmp_path
):
    """NanoChat normalizes the embeddings in its own top-level forward, which composer3d rebuilds
    without that norm: left alone it would train logits 0.2–0.4 away from transformers under every
    layout. Refused, exit 2, no worker."""
    from harness import FAST, train_command

    path = _tiny_config_dir(tmp_path / "nanochat", "nanochat")
    run = train_command(
        monkeypatch,
        capfd,
        tmp_path / "run",
        *[o for o in FAST if not o.startswith("model=")],
        "model=hf",
        f"model.path={path}",
        "parallel.dp_shard=2",
        nproc=2,
    )
    assert run.returncode == 2, run.output[-3000:]
    assert (
        run.output.count(
            "composer3d's forward of nanochat (NanoChatForCausalLM) does not compute what "
            "transformers' own does"
        )
        == 1
    ), run.output[-3000:]
    assert "failed first" not in run.output, "refused by the launcher, before any worker started"


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    return _make_models(tmp_path_factory, "hf_moe", MOE_ARCHITECTURES)


@pytest.fixture(scope="module")
def moe_references(moe_models) -> dict[str, torch.Tensor]:
    return {arch: reference_logits(path, _tokens()) for arch, path in moe_models.items()}


MOE_LAYOUTS = [
    {"dp_shard": 2},
    {"pp": 2, "pp_schedule": "gpipe"},
    {"dp_shard": 2, "ep": 2},
    {"tp": 2},
    {"tp": 2, "sequence_parallel": True},
]


def _check_moe_forward_and_reads(rank, world_size, models, references):
    """Each MoE architecture under each layout in one process group: transformers' logits, and each
    rank read the per-expert tensors of exactly the experts it holds (half of them: its FSDP
    shard's, its stage's layers', or under expert parallel its experts, whose forward then is
    composer3d's all-to-all; under tensor parallel, which splits attention and leaves the experts
    whole, all of them)."""
    from torch.distributed.tensor import DTensor

    from composer3d.models.hf.experts import EXPERT_PARALLEL
    from composer3d.models.hf.weights import ExpertFiles
    from composer3d.models.moe import local

    read = {"elements": 0}
    original = ExpertFiles.tensor

    def counting(self, key):
        tensor = original(self, key)
        read["elements"] += tensor.numel()
        return tensor

    ExpertFiles.tensor = counting
    for parallel in MOE_LAYOUTS:
        for arch, path in models.items():
            read["elements"] = 0
            built = _build_and_compare(world_size, arch, path, references[arch], parallel)
            held = sum(
                local(p).numel()
                for name, p in built.model.named_parameters()
                if ".experts." in name
            )
            whole = sum(
                math.prod(shape)
                for name, shape in built.model.full_shapes.items()
                if ".experts." in name
            )
            assert read["elements"] == held == whole // (world_size // parallel.get("tp", 1)), (
                f"rank {rank} read {read['elements']} expert weights under {parallel}, holds "
                f"{held} of {whole}"
            )
            assert (built.model.config._experts_implementation == EXPERT_PARALLEL) == (
                "ep" in parallel
            )
            tp_split = {
                name
                for name, p in built.model.named_parameters()
                if isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names
            }
            assert bool(tp_split) == ("tp" in parallel) and not any(
                ".mlp." in name for name in tp_split
            ), tp_split


def test_mixture_of_experts_checkpoints_load_on_one_process_and_under_fsdp_pp_and_ep(
    moe_models, moe_references, tmp_path
):
    """transformers saves each expert's weights as tensors of their own and fuses them while
    loading: composer3d maps them by transformers' conversion mapping and gives transformers'
    logits, whole and split."""
    from composer3d.models import build_model
    from composer3d.models.hf.weights import load_pretrained
    from composer3d.models.init import materialize

    for arch, path in moe_models.items():
        model = build_model(train_config(path).model)
        materialize(
            model,
            torch.device("cpu"),
            0,
            fsdp_roots=[],
            init_params=False,
            compute_device=torch.device("cpu"),
        )
        load_pretrained(model, str(path))
        with torch.no_grad():
            error = (model.eval()(_tokens()) - moe_references[arch]).abs().max().item()
        assert error < ATOL, f"{arch} on one process: max |Δlogits| = {error:.3g}"
    spawn(_check_moe_forward_and_reads, 2, tmp_path, moe_models, moe_references)


def test_routed_tokens_are_counted_as_transformers_routes_them(moe_models, tmp_path):
    """The expert-load metrics of a transformers MoE count, per layer and expert, the tokens
    transformers' own router sends there (its router logits' top-k on the same tokens), in training
    forwards only: not in evaluation, nor in a pipeline stage's shape inference."""
    from transformers import AutoModelForCausalLM

    from composer3d.models import build_model
    from composer3d.models.hf.experts import count_routing, hf_expert_modules
    from composer3d.models.hf.weights import load_pretrained
    from composer3d.models.init import materialize
    from composer3d.models.moe import routing_unrecorded

    for arch, path in moe_models.items():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            router_logits = reference(_tokens(), output_router_logits=True).router_logits
        k, experts = reference.config.num_experts_per_tok, len(router_logits[0][0])
        expected = [
            torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=experts).float()
            for logits in router_logits
        ]
        model = build_model(train_config(path).model)
        materialize(
            model,
            torch.device("cpu"),
            0,
            fsdp_roots=[],
            init_params=False,
            compute_device=torch.device("cpu"),
        )
        load_pretrained(model, str(path))
        modules = hf_expert_modules(model)
        count_routing(modules, torch.device("cpu"))
        with torch.no_grad():
            model.eval()(_tokens())
        with routing_unrecorded(model):
            model.train()(_tokens())
        assert all(m.routed_tokens.sum() == 0 for m in modules), (
            "evaluation and shape inference are not counted"
        )
        model.train()(_tokens()).sum().backward()
        assert len(modules) == len(expected) > 0
        for layer, (module, want) in enumerate(zip(modules, expected)):
            assert torch.equal(module.routed_tokens, want), (
                arch,
                layer,
                module.routed_tokens,
                want,
            )
            assert want.sum() == _tokens().numel() * k


def _with_router_loss(path: Path, out: Path, coef: float = 0.5) -> Path:
    """A copy of model directory ``path`` whose config.json asks for transformers' router loss (a
    large coefficient, so that its gradient shows)."""
    import json
    import shutil

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps({**config, "output_router_logits": True, "router_aux_loss_coef": coef})
    )
    return out


def test_router_loss_is_transformers_own(moe_models, tmp_path):
    """With output_router_logits: true, a training forward's gradients are those of transformers'
    own training loss (token cross-entropy + router_aux_loss_coef × its load-balancing loss) on the
    same tokens, for every parameter, and the loss it records is transformers' aux_loss; without the
    router loss the routers' gradients differ. Pipeline parallel, whose stages hold only some of the
    layers that loss pools, is refused with it."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from composer3d.errors import ConfigError
    from composer3d.models import build_model
    from composer3d.models.hf.weights import load_pretrained
    from composer3d.models.init import materialize

    tokens = _tokens()
    for arch, source in moe_models.items():
        path = _with_router_loss(source, tmp_path / arch)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        expected = reference(tokens, labels=tokens)
        expected.loss.backward()
        want = {name: p.grad for name, p in reference.named_parameters()}
        model = build_model(train_config(path).model)
        materialize(
            model,
            torch.device("cpu"),
            0,
            fsdp_roots=[],
            init_params=False,
            compute_device=torch.device("cpu"),
        )
        load_pretrained(model, str(path))
        for grad_scale in (0.5, 0.0):  # one micro-batch: the coefficient; then none
            model.zero_grad()
            model.router_loss.grad_scale = grad_scale
            logits = model.train()(tokens)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
            got = {name: p.grad for name, p in model.named_parameters()}
            routers = [name for name in got if ".mlp.gate." in name]
            assert routers and set(got) == set(want), sorted(set(got) ^ set(want))
            if grad_scale:
                assert model.router_loss.take_total().item() == pytest.approx(
                    expected.aux_loss.item(), rel=1e-6
                )
                for name, grad in got.items():
                    torch.testing.assert_close(
                        grad, want[name], atol=1e-5, rtol=1e-4, msg=f"{arch} {name}"
                    )
            else:
                assert all((got[name] - want[name]).abs().max() > 1e-4 for name in routers), arch
        cfg = train_config(path, pp=2, pp_schedule="gpipe")
        with pytest.raises(ConfigError, match="parallel.pp: .* output_router_logits: true"):
            validate(cfg, 2)


def test_a_mixture_of_experts_checkpoint_with_fused_or_missing_experts(moe_models, tmp_path):
    """A checkpoint transformers wrote with its experts already fused loads as it is; one missing an
    expert's tensor, or with more experts than config.json, is refused naming model.path before any
    worker starts."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from composer3d.errors import ConfigError
    from composer3d.models import build_model
    from composer3d.models.hf.weights import check_pretrained, load_pretrained
    from composer3d.models.init import materialize

    fused = tmp_path / "fused"
    AutoModelForCausalLM.from_pretrained(moe_models["mixtral"]).save_pretrained(
        fused, save_original_format=False
    )
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(fused / "model.safetensors")
    model = build_model(train_config(fused).model)
    materialize(
        model,
        torch.device("cpu"),
        0,
        fsdp_roots=[],
        init_params=False,
        compute_device=torch.device("cpu"),
    )
    load_pretrained(model, str(fused))
    with torch.no_grad():
        assert (
            model.eval()(_tokens()) - reference_logits(moe_models["mixtral"], _tokens())
        ).abs().max() < ATOL

    gap = shutil.copytree(moe_models["qwen3_moe"], tmp_path / "gap")
    weights = load_file(gap / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, gap / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"model.path: the weights in .*layers.1.mlp.experts.gate_up_proj is stacked from "
        r"mlp.experts.\*.up_proj.weight of experts 0..7, but the checkpoint has that tensor for "
        r"experts \[0, 1, 2, 4, 5, 6, 7\]",
    ):
        check_pretrained(build_model(train_config(gap).model), str(gap))
    fewer = shutil.copytree(moe_models["mixtral"], tmp_path / "fewer")
    config = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**config, "num_local_experts": 6}))
    with pytest.raises(
        ConfigError,
        match=r"model.path: .* shape mismatches, e.g. \['model.layers.0.mlp.experts.down_proj: "
        r"file \(8, 64, 128\) vs model \(6, 64, 128\)",
    ):
        check_pretrained(build_model(train_config(fewer).model), str(fewer))


def test_experts_are_found_as_each_transformers_version_marks_them():
    """transformers 5.17 marks its experts modules with has_gate, has_bias and is_transposed only
    (5.24 adds _is_expert_parallel, is_concatenated and has_post_expert_norm): experts marked the
    5.17 way are found and run under expert parallel, on whichever version is installed (the real
    5.17 runs the MoE tests above: docs/performance.md)."""
    from transformers import AutoModelForCausalLM

    from composer3d.models.hf import experts as hf_experts

    model = AutoModelForCausalLM.from_config(hf_config("mixtral"))
    modules = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    for module in modules:
        for added_after_5_17 in ("_is_expert_parallel", "is_concatenated", "has_post_expert_norm"):
            if hasattr(module, added_after_5_17):
                delattr(module, added_after_5_17)
    assert len(modules) == COMMON["num_hidden_layers"]
    assert hf_experts.hf_expert_modules(model) == modules
    assert hf_experts.experts_support(model, "mixtral") == (8, None)


def test_every_architecture_decodes_in_transformers_caches_as_transformers_generates(models):
    """Cached generation (``models.hf.generation``) of a left-padded batch of two prompts, in
    transformers' StaticCache and DynamicCache: each row the greedy tokens of transformers' generate
    on that prompt alone — sliding windows (the longer row outgrows the 24-token window),
    soft-capping, per-layer-type rotary embeddings, partial rotary, q/k norms included."""
    from transformers import AutoModelForCausalLM

    from composer3d.config.schema import GenerateConfig
    from composer3d.generation import generate
    from composer3d.models import build_model
    from composer3d.models.hf.weights import load_pretrained
    from composer3d.models.init import materialize

    prompts = [[1, 5, 9, 33, 7, 100, 12, 40, 41, 300, 17], [1, 40, 41]]
    for arch, path in models.items():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = [
                reference.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20)[
                    0, len(p) :
                ].tolist()
                for p in prompts
            ]
        expected = [
            ids[: ids.index(COMMON["eos_token_id"]) + 1] if COMMON["eos_token_id"] in ids else ids
            for ids in expected
        ]
        model = build_model(train_config(path).model)
        materialize(
            model,
            torch.device("cpu"),
            0,
            fsdp_roots=[],
            init_params=False,
            compute_device=torch.device("cpu"),
        )
        load_pretrained(model, str(path))
        for cache in ("static", "dynamic"):
            results = generate(
                model.eval(),
                prompts,
                GenerateConfig(max_new_tokens=20, cache=cache),
                COMMON["eos_token_id"],
                str,
                torch.device("cpu"),
            )
            assert [r.completion_ids for r in results] == expected, (arch, cache)


def test_attention_masks_are_built_without_the_keyword_transformers_deprecates(models):
    """composer3d builds its full and sliding-window masks without create_causal_mask's
    past_key_values keyword, which transformers 5.24 deprecates (a FutureWarning on every forward;
    removed in 5.40)."""
    from composer3d.models import build_model
    from composer3d.models.init import materialize

    for arch in ("llama", "mistral"):
        model = build_model(train_config(models[arch]).model)
        materialize(
            model,
            torch.device("cpu"),
            0,
            fsdp_roots=[],
            init_params=True,
            compute_device=torch.device("cpu"),
        )
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", FutureWarning)
            model.eval()(_tokens())


def test_expert_parallel_of_a_dense_or_unsupported_hugging_face_model_is_refused(
    models, moe_models, tmp_path
):
    """parallel.ep>1 with model=hf needs transformers' fused SwiGLU experts (gate_up_proj,
    down_proj, no biases): a dense model, an expert count ep does not divide, and GPT-OSS's biased,
    transposed experts are refused."""
    from transformers import AutoConfig

    from composer3d.errors import ConfigError

    assert validate(train_config(moe_models["mixtral"], dp_shard=4, ep=4), 4).ep == 4
    with pytest.raises(
        ConfigError,
        match=r"parallel.ep: expert parallel \(ep=2\) needs a mixture-of-experts model, and "
        r".*llama is a dense model",
    ):
        validate(train_config(models["llama"], dp_shard=2, ep=2), 2)
    with pytest.raises(
        ConfigError,
        match=r"parallel.ep: ep=3 does not divide the 8 routed experts .* among 1, 2, 4, 8",
    ):
        validate(train_config(moe_models["qwen3_moe"], dp_shard=3, ep=3), 3)
    AutoConfig.for_model(
        "gpt_oss",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
    ).save_pretrained(tmp_path / "gpt_oss")
    with pytest.raises(
        ConfigError,
        match=r"parallel.ep: .* GptOssExperts \(gpt_oss\) has weights .*gate_up_proj_bias",
    ):
        validate(train_config(tmp_path / "gpt_oss", dp_shard=2, ep=2), 2)


def _moe_training_args(path: Path) -> list[str]:
    from harness import FAST

    return [
        *[o for o in FAST if not o.startswith("model=")],
        "model=hf",
        f"model.path={path}",
        "model.pretrained=false",
        "train.steps=3",
        "train.seq_len=32",
        "data.max_tokens=20000",
        "checkpoint.enabled=false",
    ]


def _assert_same_training(name: str, run, one) -> None:
    """``run``'s loss curve within 1e-4 of the one-process run's, its gradient norms (whose terms a
    replicated or sharded parameter must each add once), and the same expert load: the global
    batch's, whichever ranks routed which tokens (an auxiliary loss only where config.json asks for
    transformers')."""
    assert (
        len(run.losses) == 3 and max(abs(a - b) for a, b in zip(one.losses, run.losses)) < 1e-4
    ), (name, one.losses, run.losses)
    for record, single in zip(run.metrics, one.metrics):
        assert ("moe_aux_loss" in record) == ("moe_aux_loss" in single), name
        assert record["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4), (
            name,
            record,
            single,
        )
        assert record["expert_load_max"] == pytest.approx(single["expert_load_max"], rel=1e-6), name
        assert record["expert_load_min"] == pytest.approx(single["expert_load_min"], rel=1e-6), name


@pytest.mark.slow
def test_mixture_of_experts_models_train_under_pp_fsdp_tp_sp_and_ep_on_8_processes(
    moe_models, tmp_path
):
    """Every tested MoE architecture under PP 2 × FSDP 2 × TP 2 + SP × EP 2 (each composition is in
    the 4-process test)."""
    from harness import train, train_in_one_group

    layout = [
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.pp_schedule=1f1b",
    ]
    ones = {
        arch: train(tmp_path / arch / "one", *_moe_training_args(path))
        for arch, path in moe_models.items()
    }
    runs = train_in_one_group(
        [
            (tmp_path / arch / "pp_fsdp_tp_ep", [*_moe_training_args(path), *layout])
            for arch, path in moe_models.items()
        ],
        nproc=8,
    )
    for (arch, one), run in zip(ones.items(), runs):
        _assert_same_training(arch, run, one)


def test_a_mixture_of_experts_model_trains_from_scratch_with_fsdp_and_expert_parallel(
    moe_models, tmp_path
):
    """From transformers' own init (model.pretrained=false) a tiny Qwen3-MoE trains on the
    one-process curve under FSDP and expert parallel (its experts sharded over the ep ranks, tokens
    sent to them by all-to-all): ep 4, ep 2 with the experts FSDP-sharded over the 2 ranks it
    leaves, ep 2 under ZeRO-1, ep 2 inside a pipeline stage, and ep 2 × FSDP 2 with attention
    tensor- and sequence-parallel over 2 more; its expert-load metrics are the one-process run's.
    With transformers' router loss asked for (output_router_logits), under EP 2 × FSDP 4 with full
    activation checkpointing and EP 2 × FSDP 2 × TP 2 + SP, curve and router loss are the
    one-process run's too."""
    from harness import train_in_one_group

    args = _moe_training_args(moe_models["qwen3_moe"])
    aux_args = _moe_training_args(
        _with_router_loss(moe_models["qwen3_moe"], tmp_path / "router_loss")
    )
    one, aux_one = train_in_one_group(
        [(tmp_path / "one", args), (tmp_path / "aux_one", aux_args)], nproc=1
    )
    aux_layouts = {
        "aux_fsdp4_ep2_full_ac": [
            "parallel.dp_shard=4",
            "parallel.ep=2",
            "memory.activation_checkpointing=full",
        ],
        "aux_fsdp2_ep2_tp2_sp": [
            "parallel.dp_shard=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
    }
    # ep 4 also saves step 2, which ep 2 and ep 1 (FSDP 4) resume to train step 3 (jobs of a group
    # run in turn)
    step2 = tmp_path / "ep4" / "checkpoints" / "step-00000002"
    resumed = {
        "resumed_ep2": ["parallel.dp_shard=4", "parallel.ep=2"],
        "resumed_ep1": ["parallel.dp_shard=4"],
    }
    layouts = {
        "fsdp4": ["parallel.dp_shard=4"],
        "ep4": [
            "parallel.dp_shard=4",
            "parallel.ep=4",
            "checkpoint.enabled=true",
            "checkpoint.interval=2",
        ],
        "fsdp4_ep2": ["parallel.dp_shard=4", "parallel.ep=2"],
        # ZeRO-1: the experts' state over the 2 ranks holding the same ones, the rest over all 4
        "zero1_ep2": ["parallel.dp_shard=4", "parallel.ep=2", "parallel.zero_stage=1"],
        "pp2_fsdp2_ep2": [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "parallel.ep=2",
            "parallel.pp_schedule=1f1b",
        ],
        "fsdp2_ep2_tp2_sp": [
            "parallel.dp_shard=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
    }
    runs = train_in_one_group(
        [(tmp_path / name, [*args, *overrides]) for name, overrides in layouts.items()]
        + [(tmp_path / name, [*aux_args, *overrides]) for name, overrides in aux_layouts.items()]
        + [
            (
                tmp_path / name,
                [*args, "checkpoint.enabled=true", f"checkpoint.resume={step2}", *overrides],
            )
            for name, overrides in resumed.items()
        ],
        nproc=4,
    )
    for name, run in zip(layouts, runs):
        _assert_same_training(name, run, one)
    # the experts' weights and Adam state, saved split over 4 ep ranks, resharded over 2 and over
    # none
    for name, run in zip(resumed, runs[len(layouts) + len(aux_layouts) :]):
        assert [m["step"] for m in run.metrics] == [3], (name, run.metrics)
        (record,), single = run.metrics, one.metrics[2]
        assert abs(record["loss"] - single["loss"]) < 1e-4, (name, record, single)
        assert record["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4), (
            name,
            record,
            single,
        )
        assert record["expert_load_max"] == pytest.approx(single["expert_load_max"], rel=1e-6), name
    # transformers' router loss (output_router_logits): the same curve and loss under every layout
    # (4 micro-batches of 2 sequences each: accumulated on one process, spread over ranks here), and
    # it changes the training
    for name, run in zip(aux_layouts, runs[len(layouts) : len(layouts) + len(aux_layouts)]):
        _assert_same_training(name, run, aux_one)
        for record, single in zip(run.metrics, aux_one.metrics):
            assert record["moe_aux_loss"] == pytest.approx(single["moe_aux_loss"], rel=1e-5), name
    # top_k=2 when balanced
    assert all(1.0 < m["moe_aux_loss"] < 8 for m in aux_one.metrics), aux_one.metrics
    assert max(abs(a - b) for a, b in zip(aux_one.losses[1:], one.losses[1:])) > 1e-5, (
        aux_one.losses,
        one.losses,
    )
    assert all(m["expert_load_max"] >= 1.0 >= m["expert_load_min"] >= 0.0 for m in one.metrics), (
        one.metrics
    )
    assert any(m["expert_load_max"] > 1.0 for m in one.metrics), (
        "a random router does not balance exactly"
    )
    # FLOPs per token count the experts a token goes through: top_k of each layer's
    # (tests/hf_models.py's shape)
    c = hf_config("qwen3_moe")
    per_expert = 3 * c.moe_intermediate_size * c.hidden_size
    inactive = c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * per_expert
    assert one.run_info["num_params"] - one.run_info["num_active_params"] == inactive
