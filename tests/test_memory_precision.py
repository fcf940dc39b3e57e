"""Memory and precision switches: each trains under the parallelisms it composes with and matches
its reference, and does what it is for — a switch that silently did nothing would pass the loss
comparison alone."""

import json

import pytest
import torch
import torch.nn as nn
from harness import FAST, train, train_in_one_group, train_job

STEPS = ["train.steps=6"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return {
        layers: train_job(
            tmp_path_factory.mktemp(f"ref{layers}"),
            *FAST,
            *STEPS,
            f"model.n_layers={layers}",
            probe_effects=True,
        )
        for layers in (2, 4)
    }


def _id(value):
    """Test ids from the overrides: ``activation_checkpointing=full``, ``float8=true``,
    ``dp_shard=2``."""

    def short(arg):
        key, setting = arg.split("=", 1)
        parts = key.split(".")
        return f"{parts[-2] if parts[-1] == 'enabled' else parts[-1]}={setting}"

    return "+".join(map(short, value)) if isinstance(value, list) else None


def _max_diff(a, b):
    assert len(a.losses) == len(b.losses) == 6
    return max(abs(x - y) for x, y in zip(a.losses, b.losses))


# torchao's state subclass, and its bytes over fp32's (codes, block scales, code map)
LOW_BIT_STATE = {
    "adamw_8bit": (
        "OptimState8bit",
        0.30,
    ),  # 1 byte + 4/256 (scale) + a 256-entry fp32 map per tensor: 0.28 here
    "adamw_4bit": ("OptimState4bit", 0.15),  # 0.5 byte + 4/128 + a 16-entry map: 0.135 here
    "adamw_fp8": ("OptimStateFp8", 0.27),  # 1 byte + 4/256: 0.254
}


def assert_switch_effect(ranks: list[dict], switch: list[str], layout: list[str]) -> None:
    """What each switch in ``switch`` must have done on every rank
    (``harness.train(probe_effects=True)``)."""
    settings = dict(arg.split("=", 1) for arg in switch + layout)
    shards = int(settings.get("parallel.dp_shard", 1)) > 1
    assert ranks, "no effects recorded"
    for rank in ranks:
        blocks = rank["blocks"]
        mode = settings.get("memory.activation_checkpointing")
        if mode:
            every = int(settings.get("memory.ac_every", 0))
            wanted = [b for b in blocks if mode == "full" or every == 0 or int(b) % every == 0]
            # the blocks the mode names (by global layer id, also in a pipeline stage) run under
            # checkpoint
            assert wanted and rank["checkpointed_blocks"] == wanted, (
                rank["checkpointed_blocks"],
                wanted,
            )
        if settings.get("memory.activation_offload") == "true":
            # every block's call runs under the offload's hooks, and the first step's saved
            # activations went through the host copy and came back (each at least once); parameters
            # stayed (kept)
            moved = rank["activation_offload"] or {}
            assert rank["offloaded_blocks"] == blocks, rank["offloaded_blocks"]
            assert moved["tensors_offloaded"] > 0 and moved["tensors_kept"] > 0, moved
            assert moved["bytes_brought_back"] >= moved["bytes_offloaded"] > 0, moved
        if settings.get("parallel.offload") == "cpu":
            # On a CPU-only machine every tensor is on the CPU with or without offload, so devices
            # cannot tell; what offload changes is FSDP itself: it wraps even where no dim shards,
            # and every parameter it manages carries CPUOffloadPolicy's offload_to_cpu (on an
            # accelerator: shards, gradients and the optimizer step stay in host memory, copied to
            # the device only for the all-gather).
            offloaded = [flag for group in rank["fsdp"] for flag in group["offload_to_cpu"]]
            assert len(offloaded) == rank["num_params"] and all(offloaded), rank[
                "fsdp"
            ]  # every parameter
            # (trivial on the CPU; on an accelerator, where gradients and optimizer state must be
            # found)
            assert (
                set(rank["grad_devices"])
                == {s["device"] for s in rank["optimizer_state"]}
                == {"cpu"}
            )
        if settings.get("parallel.offload") == "optimizer":
            # The step runs on host copies: fp32 masters apart from the model's parameters (which
            # stay on the compute device with their gradients), and AdamW's moments beside them on
            # the host.
            masters, moments = rank["host_masters"], rank["optimizer_state"]
            assert (
                rank["optimizer_class"] == "HostOffloadOptimizer"
                and len(masters) == rank["num_params"]
            )
            assert {m["device"] for m in masters} == {s["device"] for s in moments} == {"cpu"}, (
                masters,
                moments,
            )
            assert not any(m["shares_param_storage"] for m in masters + moments)
            # exp_avg and exp_avg_sq of every parameter
            assert len(moments) == 2 * rank["num_params"]
            # there, the masters and moments are mapped files
            in_files = "parallel.offload_dir" in settings
            assert all(m["in_file"] == in_files for m in masters + moments), (masters, moments)
            assert rank["host_file_bytes"] == (
                sum(s["bytes"] for s in moments) * 3 // 2 if in_files else 0
            )
        if settings.get("compile.enabled") == "true":
            # every block compiled, and dynamo did compile graphs for the block forward during the
            # step
            assert rank["compiled_blocks"] == blocks and rank["block_forward_graphs"] > 0, rank[
                "compiled_blocks"
            ]
            # the loss's chunk kernels too, forward and backward, where this rank computes the loss
            assert all(rank["loss_graphs"]) == rank["computes_loss"], rank["loss_graphs"]
        if settings.get("precision.float8.enabled") == "true":
            linears = rank["linear_classes"]
            in_blocks = [fqn for fqn in linears if fqn.startswith("layers.")]
            # every block matmul (7 a block) is a Float8Linear; the output head stays high precision
            assert len(in_blocks) == 7 * len(blocks) and {linears[f] for f in in_blocks} == {
                "Float8Linear"
            }, linears
            assert linears.get("output", "Linear") == "Linear", linears
            if shards:  # tensorwise under FSDP: weights all-gathered as float8 bytes, not fp32
                assert rank["param_local_classes"].get("WeightWithDynamicFloat8CastTensor") == len(
                    in_blocks
                )
                assert "torch.uint8" in rank["collective_dtypes"]["all_gather"], rank[
                    "collective_dtypes"
                ]
        dtype = settings.get("precision.param_dtype")
        if dtype:
            low = f"torch.{dtype}"
            # the head computes in the low precision (FSDP's policy or autocast), on the ranks that
            # have it
            assert rank["output_dtypes"] in ([low], []), rank["output_dtypes"]
            assert rank["loss_scaler"] == (dtype == "float16")  # fp16 needs loss scaling, bf16 none
            cast = settings.get("precision.cast")
            # one rank, no FSDP: the weights' copies in the low dtype, the residual stream too
            if cast == "params":
                assert not rank["fsdp"] and rank["block_weight_dtypes"] == rank[
                    "block_input_dtypes"
                ] == [low], rank
                # the optimizer's parameters and gradients fp32; the copies gone with the step's
                # backward
                assert rank["param_dtypes"] == rank["grad_dtypes"] == ["torch.float32"], rank
                assert rank["shadowed_after_step"] == 0, rank["shadowed_after_step"]
                assert not any(rank["collective_dtypes"].values()), rank[
                    "collective_dtypes"
                ]  # none on one rank
            # fp32 parameters and residual stream; the matmuls cast as they run
            if cast == "autocast":
                assert not rank["fsdp"] and rank["block_weight_dtypes"] == rank[
                    "block_input_dtypes"
                ] == ["torch.float32"], rank
                # the head saves its fp32 weight, not a cast of it (cast_head_in_backward):
                # autocast's linear saves a bf16 copy of vocab x dim, which an accelerator's step
                # holds at its peak
                assert rank["head_saved_weight_dtypes"] == ["torch.float32"], rank[
                    "head_saved_weight_dtypes"
                ]
            if shards:
                # FSDP's policy: gathered params in the low dtype, gradients reduced in fp32
                # (reduce_dtype's default), and the collectives indeed carried those dtypes
                assert rank["fsdp"] and all(
                    g["param_dtype"] == low and g["reduce_dtype"] == "torch.float32"
                    for g in rank["fsdp"]
                ), rank["fsdp"]
                assert set(rank["collective_dtypes"]["all_gather"]) == {low}, rank[
                    "collective_dtypes"
                ]
                assert set(rank["collective_dtypes"]["reduce_scatter"]) == {"torch.float32"}
        name = settings.get("optim.name")
        if name:
            cls, ratio = LOW_BIT_STATE[name]
            states = rank["optimizer_state"]
            # torchao quantizes the moments of every tensor of >= 4096 local elements (smaller ones
            # stay fp32)
            large = [s for s in states if s["numel"] >= 4096]
            assert large and {s["class"] for s in large} == {cls}, {
                (s["param"], s["class"]) for s in states
            }
            quantized = sum(s["bytes"] for s in large) / sum(4 * s["numel"] for s in large)
            # about 1/4 (8-bit, fp8) or 1/8 (4-bit) of fp32's bytes
            assert quantized < ratio, quantized
    # some rank has the head (under PP only the last stage)
    if settings.get("precision.param_dtype"):
        assert any(rank["output_dtypes"] for rank in ranks)


def assert_effect_and_control(run, reference, switch, layout):
    assert_switch_effect(run.effects, switch, layout)
    # The control: the same checks on the run without the switch must fail, or they could not catch
    # a no-op.
    with pytest.raises(AssertionError):
        assert_switch_effect(reference.effects, switch, layout)


# Same math, so the curve must match the plain run within 1e-4.
@pytest.mark.parametrize(
    "switch, layout, nproc, layers",
    [
        (["memory.activation_checkpointing=full"], ["parallel.dp_shard=2"], 2, 2),
        (
            ["memory.activation_checkpointing=selective"],
            ["parallel.tp=2", "parallel.sequence_parallel=true"],
            2,
            2,
        ),
        (
            ["memory.activation_checkpointing=selective", "memory.ac_every=2"],
            ["parallel.pp=2"],
            2,
            4,
        ),
        (["memory.activation_checkpointing=full"], ["parallel.pp=2", "parallel.dp_shard=1"], 2, 4),
        (["parallel.offload=cpu"], ["parallel.dp_shard=2"], 2, 2),
        (["parallel.offload=optimizer"], ["parallel.dp_shard=2"], 2, 2),
        (["parallel.offload=optimizer", "parallel.offload_dir={tmp}/offload"], [], 1, 2),
        (["compile.enabled=true"], ["parallel.dp_shard=2"], 2, 2),
        # slow: full checkpointing wraps a compiled block as it wraps an eager one (the default run
        # trains each: compiled with selective, above and in test_hf_training)
        pytest.param(
            ["compile.enabled=true", "memory.activation_checkpointing=full"],
            ["parallel.dp_shard=2"],
            2,
            2,
            marks=pytest.mark.slow,
        ),
        (
            ["compile.enabled=true", "memory.activation_checkpointing=selective"],
            ["parallel.dp_shard=2"],
            2,
            2,
        ),
        (["compile.enabled=true"], ["parallel.pp=2"], 2, 4),
        # the compiled graph saves the policy's tensors through autograd, which the offload's hooks
        # see. Slow: the default run shows the offload inside compiled blocks, without graph breaks
        # (test_activation_offload), and its curve uncompiled
        pytest.param(
            [
                "compile.enabled=true",
                "memory.activation_checkpointing=selective",
                "memory.activation_offload=true",
            ],
            ["parallel.dp_shard=2"],
            2,
            2,
            marks=pytest.mark.slow,
        ),
    ],
    ids=_id,
)
def test_switch_keeps_the_reference_curve(tmp_path, reference, switch, layout, nproc, layers):
    switch = [arg.format(tmp=tmp_path) for arg in switch]
    run = train_job(
        tmp_path / "run",
        *FAST,
        *STEPS,
        f"model.n_layers={layers}",
        *switch,
        *layout,
        nproc=nproc,
        probe_effects=True,
    )
    assert _max_diff(reference[layers], run) < 1e-4
    assert_effect_and_control(run, reference[layers], switch, layout)


@pytest.mark.parametrize(
    "switch, layout, nproc, tolerance",
    [
        (["precision.float8.enabled=true"], ["parallel.dp_shard=2"], 2, 0.02),
        (
            ["precision.float8.enabled=true"],
            ["parallel.tp=2", "parallel.sequence_parallel=true"],
            2,
            0.02,
        ),
        (["precision.param_dtype=bfloat16"], ["parallel.dp_shard=2"], 2, 0.05),
        (["precision.param_dtype=float16"], ["parallel.dp_shard=2"], 2, 0.05),
        # one rank: a bf16 copy of the parameters once a step (parallel.cast_once), or autocast's
        # casts at each op
        (["precision.param_dtype=bfloat16", "precision.cast=params"], [], 1, 0.05),
        (["precision.param_dtype=bfloat16", "precision.cast=autocast"], [], 1, 0.05),
        (["optim.name=adamw_8bit"], ["parallel.dp_shard=2"], 2, 0.02),
        # torchao's other low-bit states run with -m slow; 8-bit, through the same torchao optimizer
        # path, runs here
        pytest.param(
            ["optim.name=adamw_4bit"], ["parallel.dp_shard=2"], 2, 0.05, marks=pytest.mark.slow
        ),
        pytest.param(
            ["optim.name=adamw_fp8"], ["parallel.dp_shard=2"], 2, 0.02, marks=pytest.mark.slow
        ),
    ],
    ids=_id,
)
def test_lower_precision_stays_close(tmp_path, reference, switch, layout, nproc, tolerance):
    run = train_job(tmp_path, *FAST, *STEPS, *switch, *layout, nproc=nproc, probe_effects=True)
    assert _max_diff(reference[2], run) < tolerance
    assert_effect_and_control(run, reference[2], switch, layout)


# The precision switches' compositions with TP and PP run with `-m slow`: each switch is checked
# under FSDP (and float8 under TP+SP) above, and TP and PP themselves by the parity tests; CPU
# offload's stay in the default run.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "switch, layout, tolerance",
    [
        pytest.param(
            ["precision.param_dtype=float16"],
            ["parallel.tp=2", "parallel.sequence_parallel=true"],
            0.05,
            marks=_SLOW,
        ),
        pytest.param(["precision.param_dtype=float16"], ["parallel.pp=2"], 0.05, marks=_SLOW),
        pytest.param(["precision.float8.enabled=true"], ["parallel.pp=2"], 0.02, marks=_SLOW),
        pytest.param(["optim.name=adamw_8bit"], ["parallel.tp=2"], 0.02, marks=_SLOW),
        pytest.param(["optim.name=adamw_8bit"], ["parallel.pp=2"], 0.02, marks=_SLOW),
        (["parallel.offload=cpu"], ["parallel.pp=2"], 1e-4),
        (["parallel.offload=cpu"], ["parallel.tp=2"], 1e-4),
    ],
    ids=_id,
)
def test_switch_composes_with_tp_and_pp(tmp_path, reference, switch, layout, tolerance):
    run = train_job(
        tmp_path, *FAST, *STEPS, "model.n_layers=4", *switch, *layout, nproc=2, probe_effects=True
    )
    assert _max_diff(reference[4], run) < tolerance
    assert_effect_and_control(run, reference[4], switch, layout)


OFFLOADS = {
    "cpu": ["parallel.offload=cpu"],
    "optimizer": ["parallel.offload=optimizer"],
    "files": ["parallel.offload=optimizer", "parallel.offload_dir={tmp}/nvme"],
}


def _losses_close(run, reference, tolerance: float) -> None:
    assert len(run.losses) == len(reference.losses) == 10, run.run_dir
    assert max(abs(a - b) for a, b in zip(run.losses, reference.losses)) < tolerance, (
        run.run_dir,
        run.losses,
    )


def test_offload_keeps_the_one_process_curve_and_resumes_on_it(tmp_path):
    """ZeRO-Offload — FSDP's (cpu), the optimizer's alone in host memory (optimizer) or in files
    (offload_dir) — follows the one-process curve over 10 steps: within 1e-5 on one process
    (compiled too), 1e-4 under FSDP 2 and FSDP 2 × TP 2 + SP; a checkpoint of each resumes on the
    straight curve, and an offloaded optimizer's checkpoint is an ordinary one (it resumes without
    offload)."""
    steps = [*FAST, "train.steps=10"]

    def jobs(prefix: str, extra: list[str], modes=OFFLOADS):
        return [
            (
                tmp_path / f"{prefix}_{mode}",
                [*steps, *extra, *(a.format(tmp=tmp_path / prefix) for a in args)],
            )
            for mode, args in modes.items()
        ]

    one = train_in_one_group(
        [
            (tmp_path / "plain", steps),
            *jobs("one", ["checkpoint.interval=5"]),
            (tmp_path / "compiled_cpu", [*steps, "parallel.offload=cpu", "compile.enabled=true"]),
        ],
        nproc=1,
    )
    plain = one[0]
    for run in one[1:]:
        _losses_close(run, plain, 1e-5)
    for run in train_in_one_group(jobs("fsdp", ["parallel.dp_shard=2"]), nproc=2):
        _losses_close(run, plain, 1e-4)
    fsdp_tp = ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"]
    for run in train_in_one_group(
        jobs("fsdp_tp", fsdp_tp, {k: OFFLOADS[k] for k in ("cpu", "optimizer")}), nproc=4
    ):
        _losses_close(run, plain, 1e-4)
    resumes = []
    for mode, args in OFFLOADS.items():
        step5 = f"checkpoint.resume={tmp_path / f'one_{mode}' / 'checkpoints' / 'step-00000005'}"
        resumes.append(
            (
                tmp_path / f"resumed_{mode}",
                [*steps, *(a.format(tmp=tmp_path / "resume") for a in args), step5],
            )
        )
    step5 = f"checkpoint.resume={tmp_path / 'one_optimizer' / 'checkpoints' / 'step-00000005'}"
    resumes.append((tmp_path / "resumed_on_device", [*steps, step5]))
    for run, straight in zip(train_in_one_group(resumes, nproc=1), [*one[1:4], one[2]]):
        assert run.losses == straight.losses[5:], run.run_dir  # the same numbers, bit for bit
    for folder in ("one", "fsdp", "resume"):
        assert not list((tmp_path / folder / "nvme").iterdir()), (
            "the mapped files unlinked, their folders removed"
        )


def test_offloaded_parameters_are_drawn_where_the_forward_runs():
    """Each device type's generator draws its own numbers for a seed, so with parallel.offload=cpu
    the parameters' values are drawn on the compute device and copied to host memory: the offloaded
    run starts from the plain run's model (on an H200 it did not: step 1's loss 6.3127 against
    6.2605; test_offload_on_the_accelerator checks the values there). On the CPU both devices are
    the CPU, so the draws are followed instead: parameters held on one device (meta here) are drawn
    on the other, generator and all, and the buffers go there too."""
    from hydra import compose, initialize_config_module

    from composer3d.config.registration import register_configs
    from composer3d.models import build_model
    from composer3d.models.init import materialize

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        model_cfg = compose("train", overrides=["model=tiny", "run.dir=unused"]).model
    model = build_model(model_cfg)
    drawn_on = []
    rule_of = model.init_rule

    def spied_rule(name):
        rule = rule_of(name)

        def draw(shape, generator, device):
            drawn_on.append((str(generator.device), str(device)))
            return rule(shape, generator, device)

        return draw

    model.init_rule = spied_rule
    materialize(model, torch.device("meta"), 0, compute_device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert len(drawn_on) == len(list(model.parameters())) and set(drawn_on) == {("cpu", "cpu")}, (
        drawn_on
    )
    assert {b.device.type for b in model.buffers()} == {"cpu"}


ON_ACCELERATOR = [arg for arg in FAST if not arg.startswith("launch.device=")] + [
    "launch.device=auto"
]


@pytest.mark.accelerator
def test_one_device_bf16_casts_once_eager_and_per_op_compiled_on_the_accelerator(tmp_path):
    """precision.cast=auto on one accelerator: params eager (cast_once's copies: bf16 weights and
    residual stream in the blocks, fp32 state, no FSDP), autocast compiled; both curves within
    bf16's reach of each other, and a params checkpoint resumes under autocast."""
    args = [
        *ON_ACCELERATOR,
        "train.steps=4",
        "checkpoint.interval=2",
        "precision.param_dtype=bfloat16",
    ]
    eager = train(tmp_path / "eager", *args, probe_effects=True)
    compiled = train(tmp_path / "compiled", *args, "compile.enabled=true")
    per_op = train(tmp_path / "autocast", *args, "precision.cast=autocast")
    step2 = tmp_path / "eager" / "checkpoints" / "step-00000002"
    resumed = train(
        tmp_path / "resumed", *args, "precision.cast=autocast", f"checkpoint.resume={step2}"
    )
    assert "cast: params" in (tmp_path / "eager" / "config.yaml").read_text()
    assert "cast: autocast" in (tmp_path / "compiled" / "config.yaml").read_text()
    assert_switch_effect(
        eager.effects, ["precision.param_dtype=bfloat16", "precision.cast=params"], []
    )
    for other in (compiled, per_op):
        assert max(abs(a - b) for a, b in zip(eager.losses, other.losses)) < 0.05, (
            eager.losses,
            other.losses,
        )
    assert len(resumed.losses) == 2 and abs(resumed.losses[-1] - per_op.losses[-1]) < 0.05


@pytest.mark.accelerator
@pytest.mark.parametrize("mode", ["cpu", "optimizer"])
def test_offload_on_the_accelerator(tmp_path, mode):
    """On an accelerator the offloaded model state is in host memory (offload=cpu: parameter shards,
    gradients and the optimizer; optimizer: its state alone), the device's peak falls by at least
    the optimizer's 8 bytes a parameter, the curve is the device's own, and a checkpoint resumes on
    it (offload=cpu crashed at step 1)."""
    args = [
        *ON_ACCELERATOR,
        "train.steps=4",
        "checkpoint.interval=2",
        "precision.param_dtype=float32",
    ]
    plain = train(tmp_path / "plain", *args)
    run = train(tmp_path / mode, *args, f"parallel.offload={mode}", probe_effects=True)
    step2 = tmp_path / mode / "checkpoints" / "step-00000002"
    resumed = train(
        tmp_path / "resumed", *args, f"parallel.offload={mode}", f"checkpoint.resume={step2}"
    )
    rank = run.effects[0]
    accelerator = {device for device in rank["param_devices"] if device != "cpu"}
    assert (
        set(rank["param_devices"]) == ({"cpu"} if mode == "cpu" else accelerator)
        and len(accelerator) <= 1
    )
    assert {s["device"] for s in rank["optimizer_state"]} == {"cpu"}
    assert set(rank["grad_devices"]) == ({"cpu"} if mode == "cpu" else accelerator)
    params = run.run_info["num_params"]
    saved = max(m["peak_mem_bytes"] for m in plain.metrics) - max(
        m["peak_mem_bytes"] for m in run.metrics
    )
    assert saved >= 8 * params, (saved, params)
    assert max(abs(a - b) for a, b in zip(plain.losses, run.losses)) < 1e-4
    assert resumed.losses == run.losses[2:]


def test_low_bit_optimizer_state_is_smaller_and_checkpoints(tmp_path):
    args = [*FAST, "train.steps=4", "checkpoint.interval=2", "parallel.dp_shard=2"]
    # one process group, its start-up paid once: the resume runs after the run whose checkpoint it
    # reads
    full, low, resumed = train_in_one_group(
        [
            (tmp_path / "adamw", args),
            (tmp_path / "8bit", [*args, "optim.name=adamw_8bit"]),
            (
                tmp_path / "resumed",
                [
                    *args,
                    "optim.name=adamw_8bit",
                    f"checkpoint.resume={tmp_path / '8bit' / 'checkpoints' / 'step-00000002'}",
                ],
            ),
        ],
        nproc=2,
    )
    P = full.run_info["num_params"]
    adam_states = full.run_info["model_state_bytes_per_rank"] - 8 * P / 2
    low_states = low.run_info["model_state_bytes_per_rank"] - 8 * P / 2
    assert low_states < 0.4 * adam_states, (low_states, adam_states)  # 2 bytes/param + scales vs 8
    assert len(resumed.losses) == 2 and resumed.losses == low.losses[2:], (
        "8-bit optimizer state saved and restored exactly"
    )


def test_fp16_overflow_skips_the_step_on_every_rank(tmp_path):
    # 2**40 overflows fp16 gradients: the first steps must be skipped and the scale halved, on both
    # ranks alike.
    run = train_job(
        tmp_path,
        *FAST,
        "train.steps=8",
        "precision.param_dtype=float16",
        "precision.loss_scale_init=1099511627776",
        "parallel.dp_shard=2",
        nproc=2,
    )
    scales = [m["loss_scale"] for m in run.metrics]
    skipped = [m["skipped_steps"] for m in run.metrics]
    assert skipped[0] == 1 and skipped[-1] >= 1 and scales[1] == scales[0] / 2
    assert scales[-1] < scales[0]
    logs = [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    skips = [
        [line.split("step ")[1].split(":")[0] for line in log.splitlines() if "overflowed" in line]
        for log in logs
    ]
    assert skips[0] == skips[1] and len(skips[0]) == skipped[-1], skips
    assert all(m["loss"] == m["loss"] for m in run.metrics), "no NaN loss reported"


@pytest.mark.skipif(torch.accelerator.is_available(), reason="CPU-only limitations")
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["parallel.tp=2", "compile.enabled=true"], "compile.enabled"),
    ],
)
def test_known_cpu_limitations_are_refused(tmp_path, overrides, key):
    run = train(
        tmp_path,
        *FAST,
        *overrides,
        nproc=2 if "parallel.tp=2" in overrides else 1,
        check=False,
        timeout=120,
    )
    assert run.returncode != 0 and f"invalid configuration: {key}:" in run.output


def test_activation_checkpointing_with_zero_bubble_schedule_is_refused(tmp_path):
    run = train(
        tmp_path,
        *FAST,
        "model.n_layers=4",
        "parallel.pp=2",
        "parallel.pp_schedule=zbv",
        "memory.activation_checkpointing=full",
        nproc=2,
        check=False,
        timeout=120,
    )
    assert (
        run.returncode == 2
        and "invalid configuration: memory.activation_checkpointing:" in run.output
    )


def test_auto_precision_is_fp32_on_cpu(tmp_path):
    run = train_job(tmp_path, *FAST, "train.steps=1")
    assert "param_dtype: float32" in (tmp_path / "config.yaml").read_text()
    # the resolved choice is recorded
    assert "cast: autocast" in (tmp_path / "config.yaml").read_text()
    assert json.loads((tmp_path / "run.json").read_text())["device"] == "cpu"
    assert len(run.metrics) == 1


def test_auto_cast_is_params_only_for_an_eager_run_on_one_accelerator():
    """precision.cast=auto by measurement: params (one cast a step) eager on one accelerator;
    autocast compiled, on the CPU, on several ranks (where FSDP casts wherever it shards, and params
    is refused), and where params cannot run (ZeRO-1, QLoRA)."""
    from composer3d.precision.autocast import auto_cast

    one = dict(accelerator=True, world_size=1, compiled=False, zero_stage=3, peft_method="none")
    assert auto_cast(**one) == auto_cast(**{**one, "peft_method": "lora"}) == "params"
    for change in (
        {"compiled": True},
        {"world_size": 2},
        {"zero_stage": 1},
        {"peft_method": "qlora"},
        {"accelerator": False},
    ):
        assert auto_cast(**{**one, **change}) == "autocast", change


def test_memory_breakdown_shows_activation_checkpointing_effect(tmp_path):
    args = [*FAST, "train.steps=2", "parallel.dp_shard=2", "logging.memory_breakdown=true"]
    plain = train_job(tmp_path / "none", *args, nproc=2).run_info
    full = train_job(
        tmp_path / "full", *args, "memory.activation_checkpointing=full", nproc=2
    ).run_info
    acts = (
        plain["memory_breakdown_bytes_per_rank"]["ACT"],
        full["memory_breakdown_bytes_per_rank"]["ACT"],
    )
    assert acts[1] < 0.6 * acts[0], acts
    # Adam's two fp32 moments of half the parameters (dp_shard=2), counted by the tracker as
    # optimizer state.
    opt = plain["memory_breakdown_bytes_per_rank"]["OPT"]
    assert abs(opt - 8 * plain["num_params"] / 2) / opt < 0.05


class _KeptForBackward(torch.utils._python_dispatch.TorchDispatchMode):
    """Storages every op of a forward allocates, by weak reference: those still alive after it are
    what autograd keeps for backward (saved_tensors_hooks would not do: checkpoint's own hooks hide
    the tensors selective AC keeps from an outer hook, so op-level selective and full would look the
    same)."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def test_activation_checkpointing_keeps_fewer_activations():
    """In-process, the tiny model's forward under each mode: the bytes of activations it leaves for
    backward."""
    from hydra import compose, initialize_config_module

    from composer3d.config.registration import register_configs
    from composer3d.memory.activation_checkpointing import apply_activation_checkpointing
    from composer3d.models import build_model
    from composer3d.models.init import materialize

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        model_cfg = compose("train", overrides=["model=tiny", "run.dir=unused"]).model  # 2 blocks
    tokens = torch.randint(
        0, model_cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.arange(64).expand(2, 64)

    def kept(mode, every=0, policy="all_matmuls"):
        model = build_model(model_cfg)
        apply_activation_checkpointing(model, mode, every, policy)
        materialize(model, torch.device("cpu"), 0)
        with _KeptForBackward() as meter:
            logits = model(tokens, position_ids=positions)
        kept_bytes = meter.alive_bytes() - logits.untyped_storage().nbytes()
        logits.float().sum().backward()  # and the checkpointed blocks recompute without error
        assert all(p.grad is not None for p in model.parameters())
        return kept_bytes

    none, op_level, every_2nd, full = (
        kept("none"),
        kept("selective"),
        kept("selective", 2),
        kept("full"),
    )
    alternate = kept("selective", policy="alternate_matmuls")
    # op-level selective drops the cheap ops' outputs and keeps the matmuls' and attention's
    assert full < op_level < 0.8 * none, (none, op_level, full)
    # alternate_matmuls keeps less: of each block's 7 matmuls (wq wk wv wo w1 w3 w2) the 2nd, 4th
    # and 6th are recomputed, so the outputs of wk (kv_dim wide), wo (dim) and w3 (ffn) are not
    # kept: exactly those bytes
    dim, kv_dim, ffn = 64, 64 // 8 * 4, 192
    tokens = tokens.numel()
    assert op_level - alternate == model_cfg.n_layers * tokens * 4 * (kv_dim + dim + ffn), (
        op_level,
        alternate,
    )
    assert full < alternate, (alternate, full)
    # every 2nd block (block 0 of 2) fully recomputed: between none and full
    assert full < every_2nd < 0.8 * none, (none, every_2nd, full)
    assert full < 0.5 * none, (
        none,
        full,
    )  # full keeps only each block's input (and what lies outside the blocks)


def test_selective_checkpointing_under_compile_recomputes_only_cheap_ops():
    """Compiled blocks under op-level selective checkpointing: the compiled graph keeps the matmuls'
    and attention's outputs (fewer bytes than without checkpointing), and backward reruns neither
    (torch's hook-based checkpoint, used before, hid the compiled ops from the policy: backward
    recomputed the whole block)."""
    from composer3d.memory.activation_checkpointing import apply_activation_checkpointing
    from composer3d.models.llama import TransformerBlock, rope_tables

    torch.manual_seed(0)
    x = torch.randn(2, 64, 64, requires_grad=True)
    cos, sin = rope_tables(16, 64, 10000.0)

    def run(mode, policy="all_matmuls"):
        torch.manual_seed(1)  # the same weights for every mode
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({"0": TransformerBlock(64, 4, 4, 256, 1e-5)})
        apply_activation_checkpointing(model, mode, 0, policy)
        block = model.layers["0"]
        block.compile()
        block(x, cos, sin, None).sum().backward()  # compiles
        saved = {}
        inputs = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *block.parameters())}

        def pack(t):
            if t.untyped_storage().data_ptr() not in inputs:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x, cos, sin, None)
        x.grad = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as backward:
            out.sum().backward()
        ops = {event.key: event.count for event in backward.key_averages()}
        recomputed_attention = sum(
            n
            for op, n in ops.items()
            if op.startswith("aten::_scaled_dot_product") and "backward" not in op
        )
        return sum(saved.values()), ops.get("aten::mm", 0), recomputed_attention, x.grad.clone()

    none, selective = run("none"), run("selective")
    assert selective[0] < 0.8 * none[0], (selective[0], none[0])  # cheap ops' outputs dropped
    # backward: the same matmuls as without checkpointing (2 per forward matmul), no attention
    # forward rerun
    assert selective[1:3] == none[1:3] == (14, 0), (selective[1:3], none[1:3])
    assert torch.allclose(selective[3], none[3], atol=1e-5)
    # torchtitan's policy traced into the compiled graph too: wk's, wo's and w3's outputs (64 + 64 +
    # 256 wide over 128 tokens, fp32) not kept, those 3 matmuls rerun in backward, attention still
    # not
    alternate = run("selective", "alternate_matmuls")
    assert selective[0] - alternate[0] == 128 * 4 * (64 + 64 + 256), (selective[0], alternate[0])
    assert alternate[1:3] == (14 + 3, 0), alternate[1:3]
    assert torch.allclose(alternate[3], none[3], atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_autocast_head_computes_autocasts_bits_and_keeps_no_cast_of_its_weight(tied):
    """cast_head_in_backward: the head's output and both gradients are autocast's linear's to the
    bit (the same kernels on the same operands; a tied head's gradient adds to its embedding's), and
    what forward saves for backward holds no low-precision copy of the weight: autocast's linear
    saves one (vocab x dim), which on an accelerator's one-device step is alive at the peak, in the
    head's backward."""
    from composer3d.precision.autocast import cast_head_in_backward

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings, self.output = (
                nn.Embedding(1000, 64),
                nn.Linear(64, 1000, bias=False),
            )
            if tied:
                self.output.weight = self.tok_embeddings.weight

        def forward(self, tokens):
            return self.output(self.tok_embeddings(tokens) * 1.5)

    torch.manual_seed(0)
    plain, recast = Model(), Model()
    recast.load_state_dict(plain.state_dict())
    cast_head_in_backward(recast)
    tokens = torch.randint(0, 1000, (2, 37))
    grad = torch.randn(2, 37, 1000, generator=torch.Generator().manual_seed(1)).bfloat16()
    results = {}
    for name, model in (("plain", plain), ("recast", recast)):
        weight = model.output.weight
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens)
        logits.backward(grad)
        head_sized = [t for t in saved if t.shape in (weight.shape, weight.t().shape)]
        results[name] = logits, weight.grad, model.tok_embeddings.weight.grad, head_sized
    assert [t.dtype for t in results["plain"][3]] == [torch.bfloat16]  # autocast's cast, kept
    assert [t.data_ptr() for t in results["recast"][3]] == [
        recast.output.weight.data_ptr()
    ]  # the weight itself
    for a, b in zip(results["plain"][:3], results["recast"][:3]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):  # evaluation: the plain linear
        assert torch.equal(recast(tokens), plain(tokens))
    assert recast(tokens).dtype == torch.float32  # outside autocast: fp32, as nn.Linear
