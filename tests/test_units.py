"""Pieces checked directly: layout-independent init + forward, rank agreement, LR schedule, SLURM
env."""

import math

import pytest
import torch
from harness import spawn
from omegaconf import OmegaConf

from composer3d.config.schema import TrainConfig
from composer3d.launch import distributed
from composer3d.models import MODEL_REGISTRY, build_model
from composer3d.models.init import materialize
from composer3d.optim.schedule import lr_multiplier
from composer3d.parallel.compose import parallelize
from composer3d.parallel.mesh import Layout, ParallelMesh

# Uneven on purpose: vocab 514 and ffn 90 leave FSDP shards of different sizes (and empty-free but
# short last ranks).
UNEVEN = dict(
    name="llama",
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=4,
    vocab_size=514,
    ffn_hidden_dim=90,
    max_seq_len=64,
    rope_theta=10000.0,
)


def _train_config(overrides: dict):
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), overrides)
    cfg.precision.param_dtype = "float32"
    return cfg


def _forward_matches_reference(rank, world_size, layout, sequence_parallel, zero_stage, tie=False):
    cfg = _train_config(
        {
            "model": {**UNEVEN, "tie_embeddings": tie},
            "parallel": {"sequence_parallel": sequence_parallel, "zero_stage": zero_stage},
        }
    )
    model_cfg = cfg.model
    tokens = torch.randint(0, 514, (2, 16), generator=torch.Generator().manual_seed(1))

    reference = build_model(model_cfg)
    materialize(reference, torch.device("cpu"), seed=7)
    expected = reference(tokens)

    mesh = ParallelMesh(layout, "cpu")
    model = build_model(model_cfg)
    parallelize(
        model,
        MODEL_REGISTRY["llama"],
        mesh,
        torch.device("cpu"),
        parallel=cfg.parallel,
        precision=cfg.precision,
        memory=cfg.memory,
        compile=cfg.compile,
        peft=cfg.peft,
        windows=(),
    )
    materialize(model, torch.device("cpu"), seed=7)
    logits = model(tokens)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    if tie:
        assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize(
    "layout, sp, zero, tie",
    [
        (Layout(dp_shard=4), False, 3, False),
        (Layout(dp_shard=2, tp=2), True, 3, False),
        (
            Layout(dp_shard=2, tp=2),
            True,
            3,
            True,
        ),  # tied head: TP must leave one shared, vocab-sharded weight
        (Layout(dp_shard=4), False, 3, True),
        (Layout(dp_replicate=2, dp_shard=2), False, 2, False),
        (Layout(dp_shard=4), False, 1, False),
    ],
)
def test_parallel_forward_equals_single_process(tmp_path, layout, sp, zero, tie):
    spawn(_forward_matches_reference, layout.world_size, tmp_path, layout, sp, zero, tie)


def _agree(rank, world_size):
    assert distributed.agree_on(f"outputs/rank-{rank}-clock") == "outputs/rank-0-clock"


def test_all_ranks_agree_on_rank0_value(tmp_path):
    spawn(_agree, 3, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_each_pair_by_its_angle(dtype):
    """apply_rope (eager: one complex product in fp32; compiled: the pairwise products, which
    Inductor fuses) against the rotation written out pair by pair: the same numbers, forward and
    backward, for the whole tables and for tables gathered at position ids."""
    from composer3d.models.llama import apply_rope
    from composer3d.models.llama.attention import rope_tables

    cos, sin = rope_tables(16, 32, 10000.0)
    x = (
        torch.randn(2, 32, 4, 16, generator=torch.Generator().manual_seed(0))
        .to(dtype)
        .requires_grad_()
    )
    positions = torch.tensor([list(range(32)), list(range(16)) * 2])

    def written_out(x, cos, sin):
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
        return (
            torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
            .flatten(-2)
            .to(dtype)
        )

    grad = torch.randn(2, 32, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    traced = []

    # what Dynamo hands the compiler: Inductor gets no complex op to run unfused
    def backend(graph, example_inputs):
        traced.append(graph)
        return graph.forward

    compiled = torch.compile(apply_rope, backend=backend, fullgraph=True)
    low = cos.to(dtype), sin.to(dtype)  # a model cast whole to bf16 casts its tables with it
    for tables, expected_tables in (
        ((cos, sin), (cos[:32], sin[:32])),
        ((cos[positions], sin[positions]), (cos[positions], sin[positions])),
        (low, (low[0][:32], low[1][:32])),
    ):
        reference = written_out(x, *expected_tables)
        (reference_grad,) = torch.autograd.grad(reference, x, grad)
        for rope in (apply_rope, compiled):
            ours = rope(x, *tables)
            assert ours.dtype == dtype
            torch.testing.assert_close(ours, reference, rtol=0, atol=0)
            (ours_grad,) = torch.autograd.grad(ours, x, grad)
            torch.testing.assert_close(ours_grad, reference_grad, rtol=1e-6, atol=1e-6)
    # it rotates: position 0's pairs alone stay put
    assert not torch.equal(apply_rope(x, *tables), x)
    assert traced and not any(
        "complex" in str(node.target) for graph in traced for node in graph.graph.nodes
    )


def test_lr_schedule_warmup_then_cosine_to_floor():
    mult = [
        lr_multiplier(s, warmup_steps=10, total_steps=110, schedule="cosine", min_ratio=0.1)
        for s in range(111)
    ]
    assert mult[0] == pytest.approx(0.1) and mult[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(mult[10:], mult[11:])), "cosine decay must not increase"
    assert mult[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert mult[110] == pytest.approx(0.1)
    assert lr_multiplier(50, 10, 110, "linear", 0.0) == pytest.approx(0.6)
    assert lr_multiplier(50, 10, 110, "constant", 0.0) == 1.0


def _restore_environ_after(monkeypatch) -> None:
    """The variables ``job_env`` sets that were unset before: monkeypatch restores only what it
    changed itself, so a later in-process launch would read this test's RANK and take itself for a
    torchrun worker."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "unset")  # recorded (restored to absent) before the test deletes it


def test_slurm_task_per_device_becomes_torch_env(monkeypatch):
    _restore_environ_after(monkeypatch)  # job_env writes the torch variables into os.environ
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242137")
    env = distributed.job_env()
    assert env == distributed.Env(rank=5, local_rank=1, world_size=8)
    import os

    assert os.environ["MASTER_ADDR"] == "10.0.0.7" and os.environ["RANK"] == "5"
    assert os.environ["MASTER_PORT"] == "17137"  # the job's own: 15000 + its id's last 4 digits


def test_submitit_local_task_becomes_torch_env(monkeypatch):
    """hydra/launcher=submitit_local's tasks (its own variables, one machine) join like SLURM's, on
    a port of their job's; inside a SLURM allocation, the allocation's variables do not count."""
    _restore_environ_after(monkeypatch)  # job_env writes the torch variables into os.environ
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_JOB_ID": "31234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
    }.items():
        monkeypatch.setenv(key, value)
    assert distributed.job_env() == distributed.Env(rank=1, local_rank=1, world_size=2)
    import os

    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"] == "16234"


def test_single_slurm_task_is_not_a_job(monkeypatch):
    """One task per node running torchrun (or a 1-task allocation) must not be mistaken for rank 0
    of N."""
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.job_env() is None


def _params_gathered_after_forward(rank, world_size, zero_stage, expect_gathered):
    from torch.distributed.tensor import DTensor

    cfg = _train_config({"model": UNEVEN, "parallel": {"zero_stage": zero_stage}})
    mesh = ParallelMesh(Layout(dp_shard=world_size), "cpu")
    model = build_model(cfg.model)
    parallelize(
        model,
        MODEL_REGISTRY["llama"],
        mesh,
        torch.device("cpu"),
        parallel=cfg.parallel,
        precision=cfg.precision,
        memory=cfg.memory,
        compile=cfg.compile,
        peft=cfg.peft,
        windows=(),
    )
    materialize(model, torch.device("cpu"), seed=0)
    loss = model(torch.zeros(1, 8, dtype=torch.long)).sum()
    # FSDP2 swaps a block's sharded DTensor params for plain gathered tensors while they are
    # unsharded.
    gathered = not isinstance(model.layers["0"].attention.wq.weight, DTensor)
    assert gathered == expect_gathered, (
        f"zero_stage={zero_stage}: block params gathered after forward = {gathered}"
    )
    loss.backward()
    assert isinstance(model.layers["0"].attention.wq.weight, DTensor), (
        "after backward params are sharded again"
    )


@pytest.mark.parametrize("zero_stage, gathered", [(3, False), (2, True)])
def test_zero2_keeps_params_gathered_from_forward_to_backward(tmp_path, zero_stage, gathered):
    spawn(_params_gathered_after_forward, 2, tmp_path, zero_stage, gathered)


def test_known_harmless_library_warnings_are_dropped_and_the_rest_kept():
    """torchao's note on its optional C++ kernels and torch's Enum-constant deprecation (both logged
    on every run, nothing a user can do) are dropped at their loggers; their other warnings still
    reach the user."""
    import logging

    import composer3d  # noqa: F401  (its import puts the filters on the libraries' loggers)

    class Records(logging.Handler):
        """Sits on the logger itself: torch's logging setup (run by an earlier test in this process)
        stops 'torch.*' records from propagating to the root, where pytest's caplog listens."""

        def __init__(self):
            super().__init__(logging.WARNING)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    cases = [
        ("torchao", "Failed to load /site/torchao/_C_mxfp8.so: Could not load this library", True),
        ("torchao", "Skipping import of cpp extensions due to incompatible torch version", False),
        (
            "torch.utils._pytree",
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported",
            True,
        ),
        ("torch.utils._pytree", "a pytree node type was registered twice", False),
    ]
    for name, message, dropped in cases:
        logger, seen = logging.getLogger(name), Records()
        logger.addHandler(seen)
        try:
            logger.warning(message)
        finally:
            logger.removeHandler(seen)
        assert (not seen.records) == dropped, (name, message)


def test_a_checkpoints_optimizer_groups_are_kept_by_parameter():
    """Each pipeline stage holds other parameters: saved by parameter, the stages' group settings
    are all kept (a checkpoint keeps one object per key: two stages' lists would be one key, one
    stage's list winning), and each stage reads back its own groups with its own settings."""
    from composer3d.optim.build import groups_by_parameter, groups_of_this_rank

    def stage(names: list[list[str]], lr: float) -> dict:
        groups = [
            {"lr": lr, "weight_decay": wd, "params": group} for group, wd in zip(names, (0.1, 0.0))
        ]
        return {"state": {n: {"step": 3} for g in names for n in g}, "param_groups": groups}

    first = stage([["embed.weight", "layers.0.w"], ["layers.0.norm"]], 1e-3)
    last = stage([["layers.1.w", "output.weight"], ["norm.weight"]], 2e-3)
    saved = {}  # what both stages' keys make together
    for own in (first, last):
        by_parameter = groups_by_parameter(own)
        saved.setdefault("param_groups", {}).update(by_parameter["param_groups"])
        saved.setdefault("state", {}).update(by_parameter["state"])
    for own in (first, last):
        assert groups_of_this_rank(saved, own)["param_groups"] == own["param_groups"]
    # each parameter's settings one stored object (a list a checkpoint does not take apart)
    assert all(isinstance(v, list) for v in saved["param_groups"].values())
    # a stage with no parameter in a group keeps that group's own settings
    lone = stage([["layers.1.w"], []], 5e-4)
    assert groups_of_this_rank(saved, lone)["param_groups"] == [
        {**last["param_groups"][0], "params": ["layers.1.w"]},
        lone["param_groups"][1],
    ]
