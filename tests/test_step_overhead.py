"""What the training step does on the hot path: the loss, the optimizer kernels, FSDP only where it
shards, low-precision compute without FSDP, metrics read back once per logging window, TFLOP/s and
MFU."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import FAST, logged, spawn, train_job
from hydra import compose, initialize_config_module
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from composer3d.config.checks import validate
from composer3d.config.registration import register_configs
from composer3d.data import IGNORE_INDEX
from composer3d.errors import ConfigError
from composer3d.optim import build as optim
from composer3d.optim.build import adamw_implementation, build_optimizer
from composer3d.optim.compiled_adamw import CompiledAdamW
from composer3d.training import loss as loss_module
from composer3d.training.flops import flops_per_token, peak_flops
from composer3d.training.loss import cross_entropy_sum

CPU = torch.device("cpu")


def _logits_and_targets(rows=24, vocab=515, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, rows // 2, vocab, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, vocab, (2, rows // 2), generator=generator)
    targets[0, :3] = IGNORE_INDEX  # prompt-like positions that take no loss
    return logits, targets


def _reference(logits, targets):
    full = logits.detach().float().requires_grad_(True)
    loss = F.cross_entropy(
        full.flatten(0, 1), targets.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    loss.backward()
    return loss.detach(), full.grad


def _compiled_graphs() -> int:
    """Graphs torch.compile made for the loss's chunk kernels (dynamo's cache on their code
    objects)."""
    return sum(
        len(_debug_get_cache_entry_list(kernel.__code__))
        for kernel in (loss_module._chunk_logsumexp, loss_module._chunk_grad_in_place)
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_chunked_cross_entropy_matches_torch(monkeypatch, dtype, tolerance, compiled):
    # 5 rows a chunk: several chunks, a ragged last one
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 515 * 5)
    logits, targets = _logits_and_targets(dtype=dtype)
    expected_loss, expected_grad = _reference(logits, targets)
    logits.requires_grad_(True)
    given = logits.detach().clone()
    graphs = _compiled_graphs()
    loss = cross_entropy_sum(logits, targets, compiled=compiled, in_place=True)
    (loss * 0.5).backward()  # a scaled loss, as the trainer divides by the token count
    assert torch.equal(logits.detach(), given), (
        "a leaf's logits are the caller's own: never overwritten"
    )
    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    assert torch.allclose(loss, expected_loss, rtol=1e-6, atol=1e-4), (loss, expected_loss)
    assert torch.allclose(logits.grad.float(), 0.5 * expected_grad, atol=tolerance), (
        (logits.grad.float() - 0.5 * expected_grad).abs().max()
    )
    assert logits.grad[0, :3].abs().max() == 0, "ignored targets take no gradient"
    # compiled: the forward and backward kernels ran as compiled graphs (a new dtype compiles anew);
    # eager: none
    assert (_compiled_graphs() > graphs) == compiled


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_in_place_loss_writes_the_logits_gradient_over_the_heads_output(monkeypatch, compiled):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 515 * 5)
    hidden, targets = _logits_and_targets(vocab=32)
    head = nn.Linear(32, 515, bias=False)
    reference = head.weight.detach().clone().requires_grad_(True)
    F.cross_entropy(
        F.linear(hidden, reference).flatten(0, 1),
        targets.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    ).backward()
    logits = head(hidden)
    storage, arrived = logits.data_ptr(), []
    logits.register_hook(lambda grad: arrived.append(grad.data_ptr()))
    cross_entropy_sum(logits, targets, compiled=compiled, in_place=True).backward()
    assert arrived == [storage], "the gradient took the logits' memory"
    assert torch.allclose(head.weight.grad, reference.grad, atol=1e-5), (
        (head.weight.grad - reference.grad).abs().max()
    )

    # logits an op saved for its own backward (its output): autograd's version check refuses, loudly
    capped = torch.tanh(F.linear(hidden, head.weight))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        cross_entropy_sum(capped, targets, compiled=compiled, in_place=True).backward()


def test_chunked_cross_entropy_keeps_no_full_vocabulary_fp32_tensor():
    logits, targets = _logits_and_targets(rows=64, vocab=1024, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    full = logits.numel()

    def saved_fp32_elements(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn()
        return max((t.numel() for t in saved if t.dtype == torch.float32), default=0)

    upcast = saved_fp32_elements(
        lambda: F.cross_entropy(
            logits.float().flatten(0, 1),
            targets.flatten(0, 1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
    )
    chunked = saved_fp32_elements(lambda: cross_entropy_sum(logits, targets))
    assert upcast >= full, "the check itself: the plain upcast keeps full fp32 logits for backward"
    assert chunked <= logits.shape[0] * logits.shape[1], (
        f"fp32 saved per token only, got {chunked} elements"
    )


def _vocab_parallel_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    loss_module.CHUNK_ELEMENTS = 258 * 5
    # 515 over 2 ranks: 258 + 257, uneven like DTensor's chunks
    logits, targets = _logits_and_targets(vocab=515)
    expected_loss, expected_grad = _reference(logits, targets)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for compiled in (
        False,
        True,
    ):  # the row max and sum of exponentials all-reduced between compiled kernels
        sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_(True)
        loss = cross_entropy_sum(sharded, targets, compiled=compiled)
        loss.backward()
        assert not isinstance(loss, type(sharded)) and torch.allclose(
            loss, expected_loss, rtol=1e-6, atol=1e-4
        )
        assert torch.allclose(sharded.grad.full_tensor(), expected_grad, atol=1e-5)
    assert len(_debug_get_cache_entry_list(loss_module._chunk_sum_exp.__code__)) > 0


def test_vocab_sharded_cross_entropy_matches_torch(tmp_path):
    spawn(_vocab_parallel_worker, 2, tmp_path)


def _tiny_model():
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))


@pytest.mark.parametrize(
    "implementation, fused, foreach",
    [
        ("auto", True, False),
        ("fused", True, False),
        ("foreach", False, True),
        ("for_loop", False, False),
    ],
)
def test_adamw_implementation_picks_its_kernels(implementation, fused, foreach):
    cfg = compose_cfg([f"optim.implementation={implementation}"]).optim
    model = _tiny_model()
    optimizer, _ = build_optimizer(model, cfg)
    assert all(g["fused"] == fused and g["foreach"] == foreach for g in optimizer.param_groups)
    model(torch.randn(4, 8)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer.step()
    ops = {event.key for event in prof.key_averages()}
    assert ("aten::_fused_adamw_" in ops) == fused, sorted(ops)
    # the unfused multi-tensor update
    assert ("aten::_foreach_addcdiv_" in ops) == foreach, sorted(ops)


def test_auto_compiles_the_step_where_every_parameter_is_on_the_accelerator(monkeypatch):
    """The accelerator stood in by the meta device (the CPU box has none): auto picks the compiled
    update there, the fused kernel on the CPU, foreach where some device has no fused kernel; a
    named implementation is kept."""
    monkeypatch.setattr(optim, "is_accelerator", lambda device: device.type == "meta")
    on_accelerator, on_cpu = torch.empty(2, device="meta"), torch.empty(2)
    assert adamw_implementation("auto", [on_accelerator]) == "compiled"
    assert adamw_implementation("auto", [on_cpu]) == "fused"
    assert adamw_implementation("auto", [on_accelerator, on_cpu]) == "foreach"
    assert adamw_implementation("fused", [on_accelerator]) == "fused"
    model = _tiny_model()
    monkeypatch.setattr(optim, "is_accelerator", lambda device: device.type == "cpu")
    assert isinstance(build_optimizer(model, compose_cfg([]).optim)[0], CompiledAdamW)


@pytest.mark.accelerator
def test_auto_builds_the_compiled_step_on_the_accelerator():
    model = _tiny_model().to(torch.accelerator.current_accelerator())
    assert isinstance(build_optimizer(model, compose_cfg([]).optim)[0], CompiledAdamW)


def test_low_bit_optimizer_refuses_a_kernel_choice():
    with pytest.raises(ConfigError, match="optim.implementation"):
        validate(compose_cfg(["optim.name=adamw_8bit", "optim.implementation=fused"]), 1)


def test_a_low_bit_optimizer_says_its_first_step_compiles():
    """torchao's low-bit AdamW compiles its update during step 1 (tens of seconds on a CPU): said
    when the optimizer is built, so the wait before step 1 is not taken for a hang; AdamW says
    nothing."""

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from composer3d.optim.build import optimizer_class

    # what optimizer_class turns off for the process, restored for the tests after this one by the
    # config modules' own patch (monkeypatch's undo deletes their entries: every later compile
    # fails)
    with (
        inductor_config.patch(fx_graph_cache=inductor_config.fx_graph_cache),
        functorch_config.patch(enable_autograd_cache=functorch_config.enable_autograd_cache),
        logged() as said,
    ):
        assert optimizer_class("adamw") is torch.optim.AdamW
        assert optimizer_class("adamw_8bit").__name__ == "AdamW8bit"
    assert said == [
        "optim.name=adamw_8bit: torchao compiles its low-bit update during step 1 (tens of "
        "seconds on a CPU, once per process)"
    ], said


def compose_cfg(overrides):
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        return compose(
            "train",
            overrides=[
                "data=synthetic",
                "data.synthetic_sequences=64",
                "run.dir=unused",
                "checkpoint.enabled=false",
                "launch.device=cpu",
                *overrides,
            ],
        )


def _fsdp_and_dtypes_worker(rank, world_size, overrides, expect_fsdp, expected):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from composer3d.launch.rank import prepare_rank
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.trainer import Trainer

    cfg = compose_cfg(
        [
            "model=tiny",
            "train.seq_len=32",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            *overrides,
        ]
    )
    layout, device = prepare_rank(cfg, None if world_size == 1 else _env(rank, world_size))
    from composer3d.data import build_sequences

    sequences = build_sequences(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, 0)
    trainer = Trainer(cfg, ParallelMesh(layout, device.type), device, sequences)
    assert any(isinstance(m, FSDPModule) for m in trainer.model.modules()) == expect_fsdp
    meshes = {
        p.device_mesh.mesh_dim_names for p in trainer.model.parameters() if isinstance(p, DTensor)
    }
    assert meshes == expected["meshes"], meshes
    outputs = []
    trainer.model.layers["0"].attention.wq.register_forward_hook(
        lambda m, i, o: outputs.append(o.dtype)
    )
    trainer.train_step()
    assert outputs and set(outputs) == {expected["compute"]}, outputs  # one per micro-batch
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}, "fp32 master weights"
    assert {p.grad.dtype for p in trainer.model.parameters()} == {torch.float32}
    states = [v for s in trainer.optimizer.state.values() for v in s.values() if v.ndim > 0]
    assert states and {v.dtype for v in states} == {torch.float32}


def _env(rank, world_size):
    from composer3d.launch.distributed import Env

    return Env(rank=rank, local_rank=rank, world_size=world_size)


@pytest.mark.parametrize(
    "overrides, world_size, expect_fsdp, expected",
    [
        (
            ["precision.param_dtype=bfloat16"],
            1,
            False,
            {"meshes": set(), "compute": torch.bfloat16},
        ),
        (["precision.param_dtype=float32"], 1, False, {"meshes": set(), "compute": torch.float32}),
        (
            ["parallel.tp=2", "parallel.dp_shard=1", "precision.param_dtype=bfloat16"],
            2,
            False,
            {"meshes": {("tp",)}, "compute": torch.bfloat16},
        ),
        (
            ["parallel.dp_shard=2", "precision.param_dtype=bfloat16"],
            2,
            True,
            {"meshes": {("dp_shard_cp",)}, "compute": torch.bfloat16},
        ),
    ],
)
def test_fsdp_only_where_a_data_parallel_dim_shards(
    tmp_path, overrides, world_size, expect_fsdp, expected
):
    """One device and TP-only layouts carry no FSDP (no all-gather/reduce-scatter copies), yet
    compute in bf16 over fp32 weights, gradients and optimizer state, like FSDP's mixed precision
    does."""
    spawn(_fsdp_and_dtypes_worker, world_size, tmp_path, overrides, expect_fsdp, expected)


def _garbage_collection_worker(rank, world_size, gc_every, steps, out):
    import gc
    import json
    from pathlib import Path

    from composer3d.data import build_sequences
    from composer3d.launch.rank import prepare_rank
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.metrics import MetricsSink
    from composer3d.training.trainer import Trainer

    cfg = compose_cfg(
        [
            "model=tiny",
            "train.seq_len=32",
            "train.global_batch_size=4",
            "train.micro_batch_size=1",
            "parallel.dp_shard=2",
            f"train.steps={steps}",
            f"train.gc_every={gc_every}",
        ]
    )
    layout, device = prepare_rank(cfg, _env(rank, world_size))
    sequences = build_sequences(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, 0)
    trainer = Trainer(cfg, ParallelMesh(layout, device.type), device, sequences)
    collections = []  # the step a collection ran after (the trainer's count of finished steps)
    in_step = [False]
    original_step = trainer.train_step

    def train_step():
        in_step[0] = True
        try:
            return original_step()
        finally:
            in_step[0] = False

    trainer.train_step = train_step

    def on_gc(phase, info):
        if phase == "start":
            collections.append(
                {
                    "step": trainer.step,
                    "in_step": in_step[0],
                    "generation": info["generation"],
                    "automatic": gc.isenabled(),
                }
            )

    gc.set_threshold(50)  # frequent automatic collections, so one inside a step cannot go unseen
    gc.callbacks.append(on_gc)
    try:
        trainer.fit(MetricsSink(Path(out), cfg, enabled=False, total_steps=steps), None)
    finally:
        gc.callbacks.remove(on_gc)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"collections": collections, "enabled": gc.isenabled()})
    )
    trainer.close()


@pytest.mark.parametrize("gc_every", [2, 0])
def test_garbage_collected_only_at_step_boundaries(tmp_path, gc_every):
    """train.gc_every=2: no collection runs inside a step; training's own (full) collections run on
    every rank when training starts (before freezing the setup) and after steps 2 and 4, and
    Python's collector is back on afterwards; gc_every=0 leaves Python's automatic collections,
    which then strike inside steps."""
    import json

    spawn(_garbage_collection_worker, 2, tmp_path, gc_every, 4, str(tmp_path))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        collections = result["collections"]
        assert result["enabled"], "the automatic collector is restored after training"
        if gc_every:
            assert not any(c["in_step"] for c in collections), collections
            assert [(c["step"], c["generation"]) for c in collections if not c["automatic"]] == [
                (0, 2),
                (2, 2),
                (4, 2),
            ], collections
        else:
            assert sum(c["in_step"] for c in collections) > 10, collections


def test_cpu_ranks_share_the_cores_among_their_compile_workers(monkeypatch):
    """On the CPU each of a node's ranks gives inductor's compile pool its share of the cores (the
    node's process count from LOCAL_WORLD_SIZE, as torchrun sets it); the environment's setting
    wins."""

    import torch._inductor.config as inductor_config

    from composer3d.launch import distributed

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(distributed, "cpu_cores", lambda: 8)
    monkeypatch.setattr(inductor_config, "compile_threads", 8)
    for processes, threads in (("1", 8), ("4", 2), ("16", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
        assert distributed.resolve_device("cpu", local_rank=0) == torch.device("cpu")
        assert inductor_config.compile_threads == threads, processes
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    monkeypatch.setattr(inductor_config, "compile_threads", 3)
    distributed.resolve_device("cpu", local_rank=0)
    assert inductor_config.compile_threads == 3


def test_training_freezes_its_setup_and_leaves_a_callers_freeze_frozen():
    """The setup is frozen while training (the step collections skip it) and thawed after; a heap
    the process froze itself before training (a server that forks its workers) stays frozen."""
    import gc

    from composer3d.training.garbage import StepGarbageCollection

    gc.unfreeze()
    try:
        with StepGarbageCollection(every=1):
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
        gc.freeze()
        frozen = gc.get_freeze_count()
        # neither thawed (0) nor frozen again (which would take in the objects made since, this
        # context manager among them); a frozen object another thread lets go of leaves the
        # permanent generation, so the count may drop by a few
        with StepGarbageCollection(every=1):
            assert frozen - 100 < gc.get_freeze_count() <= frozen
        assert frozen - 100 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_single_device_checkpoint_resumes_under_fsdp_and_tp(tmp_path):
    args = [*FAST, "train.steps=8", "checkpoint.interval=4"]
    single = train_job(tmp_path / "single", *args)
    resumed = train_job(
        tmp_path / "fsdp_tp",
        *args,
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        nproc=4,
        *[f"checkpoint.resume={single.run_dir / 'checkpoints' / 'step-00000004'}"],
    )
    assert [m["step"] for m in resumed.metrics] == [5, 6, 7, 8]
    assert max(abs(a - b) for a, b in zip(single.losses[4:], resumed.losses)) < 1e-4, (
        single.losses,
        resumed.losses,
    )


def test_metrics_are_read_back_once_per_window_with_the_same_values(tmp_path):
    """log_every=3 defers reading the loss to every third step (and the last), yet writes every
    step's line with the values a per-step read gives; TFLOP/s and, with a declared peak, MFU come
    with them."""
    every_step = train_job(tmp_path / "each", *FAST, "train.steps=7")
    windowed = train_job(
        tmp_path / "window",
        *FAST,
        "train.steps=7",
        "logging.log_every=3",
        "logging.peak_tflops=0.001",
    )
    assert [m["step"] for m in windowed.metrics] == list(range(1, 8))
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in windowed.metrics] == [m[key] for m in every_step.metrics], key
    times = [m["step_time_s"] for m in windowed.metrics]
    assert times[0] == times[1] == times[2] and times[3] == times[4] == times[5], (
        "the window's average"
    )
    for record in windowed.metrics:
        assert record["tflops_per_s"] > 0
        assert record["mfu"] == pytest.approx(record["tflops_per_s"] / 0.001)
    assert all(m["mfu"] is None for m in every_step.metrics), "no peak known for the CPU"
    info = windowed.run_info
    # tiny: vocab 512, dim 64
    assert info["flops_per_token"] == flops_per_token(info["num_params"], 512 * 64, 2, 64, 64)
    assert "MFU" in windowed.output and "TFLOP/s" in windowed.output


@pytest.mark.parametrize("seq_len", [8, 33])
def test_a_sliding_window_counts_the_scores_transformers_mask_keeps(seq_len):
    """attended_share: of a causal layer's (query, key) pairs, those transformers' sliding-window
    mask keeps, counted on the mask itself, for windows shorter than, equal to and longer than the
    sequence (0: no window)."""
    from fractions import Fraction

    import transformers.masking_utils as masks

    from composer3d.training.flops import attended_share

    q, k, zero = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :], torch.tensor(0)
    causal = int(masks.causal_mask_function(zero, zero, q, k).sum())
    for window in (1, 3, seq_len, seq_len + 7):
        kept = int(masks.sliding_window_causal_mask_function(window)(zero, zero, q, k).sum())
        assert Fraction(attended_share(window, seq_len)).limit_denominator(10**6) == Fraction(
            kept, causal
        ), window
    assert attended_share(0, seq_len) == 1.0


def test_flops_per_token_and_peak_table(monkeypatch):
    # Llama-3.2-1B shape, untied head, seq 8192: 6·(N − embedding) + 6·L·H·Q·T (causal: half the
    # score matrix)
    n, embedding = 1_498_482_688, 128256 * 2048
    assert (
        flops_per_token(n, embedding, 16, 32 * 64, 8192)
        == 6 * (n - embedding) + 6 * 16 * 2048 * 8192
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, "bfloat16") == 989.4e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(cuda, "bfloat16") == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops(cuda, "bfloat16") is None
    assert peak_flops(cuda, "bfloat16", override_tflops=500) == 500e12
    assert peak_flops(CPU, "float32") is None


@pytest.fixture
def one_rank_group():
    """A gloo process group of this one process (a Trainer's mesh needs one), gone after the
    test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "compile_enabled, accelerator, expect_compiled",
    [(False, False, False), (True, False, True), (False, True, True)],
    ids=["eager", "compile", "accelerator"],
)
@pytest.mark.parametrize("loss_impl", ["chunked", "fused"])
def test_loss_kernels_compile_with_compile_enabled_or_on_an_accelerator(
    monkeypatch, one_rank_group, loss_impl, compile_enabled, accelerator, expect_compiled
):
    """Trainer._compiled_loss: the step's loss asks for its compiled chunk kernels
    (``compiled_kernels``, whose graphs test_chunked_cross_entropy_matches_torch counts) with
    compile.enabled, and on an accelerator in an eager run too; an eager run on the CPU runs them
    eagerly. The same loss either way."""
    from composer3d.launch import distributed
    from composer3d.launch.rank import prepare_rank
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training import fused_loss
    from composer3d.training.trainer import Trainer

    requested = []

    def spy():  # the eager kernels: the test counts requests, it does not pay for inductor
        requested.append(True)
        return loss_module.EAGER_KERNELS

    for module in (loss_module, fused_loss):
        monkeypatch.setattr(module, "compiled_kernels", spy)
    # what the Trainer asks
    monkeypatch.setattr(distributed, "is_accelerator", lambda device: accelerator)
    # blocks eager: only the loss
    monkeypatch.setattr(torch.nn.Module, "compile", lambda *args, **kwargs: None)
    cfg = compose_cfg(
        [
            "model=tiny",
            "train.seq_len=16",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            f"compile.enabled={compile_enabled}",
            f"train.loss_impl={loss_impl}",
        ]
    )
    layout, device = prepare_rank(cfg, None)
    trainer = Trainer(cfg, ParallelMesh(layout, device.type), device, None)
    inputs = torch.randint(0, cfg.model.vocab_size, (2, 16))
    trainer._model_loss(inputs, inputs.roll(-1, 1)).backward()
    assert trainer._compiled_loss == expect_compiled
    assert bool(requested) == expect_compiled, requested
