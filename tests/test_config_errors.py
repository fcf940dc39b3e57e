"""Bad configurations fail fast, with a message naming the key to change.

The CLI cases run ``composer3d-train`` as a user would. Most ask for 4 local workers: a layout error
must be caught by the parent (exit code 2, the message printed once) before any worker starts, not
in 4 workers or in a hanging collective. The in-process cases check ``validate`` itself through
Hydra's compose API.
"""

import os
import shutil
import subprocess
import sys
import time

import pytest
from harness import hydra_cleared, run_command, train
from hydra import compose, initialize_config_module

from composer3d.config.checks import validate
from composer3d.config.registration import register_configs
from composer3d.errors import ConfigError

# a bad config fails in seconds (mostly torch's import); a minute means something waits
HANG_GUARD_S = 60
PREFIX = "composer3d: invalid configuration: "

# (id, nproc, overrides, text the output must contain: the offending key first, then any further
# fragments)
VALIDATION_CASES = [
    ("tp_not_dividing_world", 4, ["parallel.tp=3"], ["parallel.tp", "divides 4 (1, 2, 4)"]),
    ("tp_not_dividing_kv_heads", 8, ["parallel.tp=8"], ["parallel.tp", "model.n_kv_heads=4"]),
    ("product_not_world", 4, ["parallel.dp_shard=2"], ["parallel.dp_shard", "world size is 4"]),
    (
        "batch_not_divisible",
        4,
        ["train.global_batch_size=6", "train.micro_batch_size=2"],
        ["train.global_batch_size", "Use a multiple of 8"],
    ),
    ("unknown_model_name", 4, ["model.name=gpt"], ["model.name", "'gpt'"]),
    ("zero_stage_4", 4, ["parallel.zero_stage=4"], ["parallel.zero_stage"]),
    (
        "zero1_bucket_of_nothing",
        4,
        ["parallel.zero_stage=1", "parallel.zero1_bucket_mb=0"],
        ["parallel.zero1_bucket_mb", "must be > 0 MiB", "40 by default"],
    ),
    ("sp_without_tp", 4, ["parallel.sequence_parallel=true"], ["parallel.sequence_parallel"]),
    (
        "sp_seq_len_not_divisible",
        4,
        ["parallel.tp=4", "parallel.sequence_parallel=true", "train.seq_len=66"],
        ["train.seq_len", "Use a multiple of 4"],
    ),
    ("unknown_optimizer", 4, ["optim.name=sgd"], ["optim.name", "'sgd'"]),
    ("unknown_dtype", 4, ["precision.param_dtype=float64"], ["precision.param_dtype", "'float64'"]),
    ("text_files_without_paths", 4, ["data=text_files"], ["data.paths"]),
    (
        "cp_not_cutting_seq_len",
        3,
        ["parallel.cp=3", "parallel.dp_shard=1", "train.seq_len=256"],
        ["parallel.cp", "2·cp = 6 equal chunks"],
    ),
    ("more_stages_than_layers", 4, ["parallel.pp=4"], ["parallel.pp", "4 stages"]),
    ("kv_heads_not_dividing_heads", 4, ["model.n_kv_heads=3"], ["model.n_kv_heads"]),
    (
        "expert_parallel_of_a_dense_model",
        4,
        ["parallel.ep=2"],
        ["parallel.ep", "the model is dense", "model=tiny_moe"],
    ),
    (
        "tiles_not_dividing_the_sequence",
        4,
        ["memory.tile_loss=3"],
        ["memory.tile_loss", "Use one of 1, 2, 4"],
    ),
    # its policy's tensors stay in checkpoint's own cache, which saved-tensor hooks never see:
    # nothing would move
    (
        "activation_offload_with_eager_op_level_selective",
        2,
        ["memory.activation_offload=true", "memory.activation_checkpointing=selective"],
        [
            "memory.activation_offload",
            "checkpoint's own cache",
            "compile.enabled=true",
            "memory.ac_every>=1",
        ],
    ),
    # LoRA's patterns are matched on the model (built on meta) before any worker starts
    (
        "lora_targets_naming_no_linear",
        2,
        ["peft=lora", "peft.target_modules=[wqkv]"],
        ["peft.target_modules", "names no linear layer", "[wq, wk, wv, wo, w1, w2, w3]"],
    ),
    # tiny's 64x64 projections hold less than one NF4 block of scales (64 x 256 values)
    (
        "qlora_weights_smaller_than_nf4_blocks",
        2,
        ["peft=qlora"],
        ["peft.method", "NF4 blocks of 16384", "peft=lora"],
    ),
]


def assert_one_config_error(code: int, output: str, expected: list[str]) -> None:
    """Exit code 2 and a single message are the parent's ConfigError path; workers failing would
    give exit code 1 (the elastic agent's ChildFailedError) and one message per worker."""
    assert code == 2, f"expected the parent's config error (2), got {code}:\n{output}"
    assert output.count(PREFIX) == 1, output
    message = output[output.index(PREFIX) + len(PREFIX) :]
    assert message.startswith(expected[0] + ":"), (
        f"message should start with {expected[0]!r}:\n{output}"
    )
    for fragment in expected[1:]:
        assert fragment in message, f"{fragment!r} missing:\n{output}"
    assert "Traceback" not in output, output


@pytest.mark.parametrize(
    "nproc, overrides, expected",
    [c[1:] for c in VALIDATION_CASES],
    ids=[c[0] for c in VALIDATION_CASES],
)
def test_bad_config_fails_in_parent_naming_key(
    monkeypatch, capfd, tmp_path, nproc, overrides, expected
):
    """The command's own checks, in this process up to where it would start workers (which fails
    the test): the command line itself is the next test's."""
    code = run_command(
        monkeypatch,
        "composer3d.commands.train",
        "launch.device=cpu",
        f"launch.nproc_per_node={nproc}",
        f"run.dir={tmp_path / 'run'}",
        *overrides,
    )
    assert_one_config_error(code, capfd.readouterr().err, expected)
    assert not (tmp_path / "run").exists(), "nothing should be written for a config that cannot run"


@pytest.mark.cli
def test_bad_config_through_the_command_line_exits_2_before_any_worker(tmp_path):
    """As a user runs it: 4 workers asked for, the parent refuses in seconds (mostly torch's
    import); a minute means something waits in workers or a collective."""
    _, nproc, overrides, expected = VALIDATION_CASES[0]
    run = train(
        tmp_path / "run",
        "launch.device=cpu",
        *overrides,
        nproc=nproc,
        check=False,
        timeout=HANG_GUARD_S,
    )
    assert_one_config_error(run.returncode, run.output, expected)
    assert not (tmp_path / "run").exists(), "nothing should be written for a config that cannot run"
    assert run.seconds < HANG_GUARD_S


def test_a_fresh_start_in_a_used_run_dir_is_refused_and_the_old_run_kept(
    monkeypatch, capfd, tmp_path
):
    """checkpoint.resume=none where an earlier run lives would overwrite its metrics and config, and
    keep_last would prune the new run's checkpoints for the old run's (newer by step): refused,
    naming the way out."""
    run_dir = tmp_path / "run"
    old_checkpoint = run_dir / "checkpoints" / "step-00000040"
    old_checkpoint.mkdir(parents=True)
    (old_checkpoint / "composer3d.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}, "loss": 5.0}}\n' for s in range(1, 41))
    )
    (run_dir / "config.yaml").write_text("the earlier run's config\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}
    code = run_command(
        monkeypatch,
        "composer3d.commands.train",
        f"run.dir={run_dir}",
        "model=tiny",
        "launch.device=cpu",
        "train.steps=1",
        "checkpoint.resume=none",
    )
    output = capfd.readouterr().err
    assert code == 2 and output.count(PREFIX) == 1, output[-3000:]
    assert (
        f"{PREFIX}checkpoint.resume: none starts afresh, but run.dir {run_dir} holds an earlier "
        "run (metrics.jsonl with 40 records, checkpoints step-00000040 in "
        f"{run_dir / 'checkpoints'})" in output
    )
    assert (
        "Give this run a new run.name (or run.dir), or resume that run with checkpoint.resume=auto"
        in output
    )
    assert {
        p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()
    } == before


# Errors Hydra/OmegaConf raise while composing, before composer3d's code runs: (id, overrides, the
# one line after the prefix)
HYDRA_CASES = [
    (
        "missing_model_group",
        ["model=nonexistent"],
        "model: no option 'nonexistent'. Use model=<one of: hf, llama3_1b, llama3_405b, "
        "llama3_70b, llama3_8b, tiny, tiny_moe>",
    ),
    (
        "non_integer_steps",
        ["train.steps=abc"],
        "train.steps: Value 'abc' of type 'str' could not be converted to Integer. train.steps "
        "takes int, e.g. train.steps=100",
    ),
    (
        "not_a_bool",
        ["parallel.auto=maybe"],
        "parallel.auto: Value 'maybe' is not a valid bool (type str). parallel.auto takes bool, "
        "e.g. parallel.auto=false",
    ),
    (
        "override_syntax",
        ["train.steps=[1,2"],
        "train.steps=[1,2: not an override Hydra can read (no viable alternative at input "
        "'[1,2'). Write key=value, quoting a value with spaces or brackets; the grammar: "
        "https://hydra.cc/docs/advanced/override_grammar/basic/",
    ),
    (
        "plus_on_a_set_key",
        ["+train.steps=5"],
        "+train.steps=5: Could not append to config. An item is already at 'train.steps'. "
        "Without the +, train.steps=5 sets it",
    ),
    (
        "sweep_without_m",
        ["optim.lr=1e-3,2e-3"],
        "Ambiguous value for argument 'optim.lr=1e-3,2e-3': a comma-separated value is a sweep. "
        "Add -m to run it, or quote the value",
    ),
    (
        "swept_value_of_the_wrong_type",
        ["train.steps=3,abc", "-m"],
        "train.steps: Value 'abc' of type 'str' could not be converted to Integer. train.steps "
        "takes int, e.g. train.steps=100",
    ),
]


@pytest.mark.parametrize(
    "overrides, line", [c[1:] for c in HYDRA_CASES], ids=[c[0] for c in HYDRA_CASES]
)
def test_hydra_errors_are_one_line_naming_the_key_and_exit_2(
    monkeypatch, capfd, tmp_path, overrides, line
):
    """What Hydra refuses while composing is one line, exit 2, before any worker or run directory:
    not Hydra's paragraph and its HYDRA_FULL_ERROR hint."""
    code = run_command(
        monkeypatch,
        "composer3d.commands.train",
        "launch.device=cpu",
        "launch.nproc_per_node=4",
        f"run.dir={tmp_path / 'run'}",
        *overrides,
    )
    out, err = capfd.readouterr()
    assert (code, out, err.splitlines()) == (
        2,
        "",
        [f"composer3d-train: invalid configuration: {line}"],
    )
    assert not (tmp_path / "run").exists()


def test_a_submitit_launcher_without_the_slurm_extra_says_how_to_install_it(
    monkeypatch, capsys, tmp_path
):
    """hydra/launcher=slurm_local extends the submitit plugin's config; with the plugin not
    installed (its configs absent from Hydra's store), one line naming the extra."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # discovers the plugins, which store their configs
    launchers = ConfigStore.instance().repo["hydra"]["launcher"]
    for name in [n for n in launchers if n.startswith("submitit")]:
        monkeypatch.delitem(launchers, name)
    code = run_command(
        monkeypatch,
        "composer3d.commands.train",
        f"run.dir={tmp_path / 'sweep'}",
        "hydra/launcher=slurm_local",
        "optim.lr=1e-3,2e-3",
        "-m",
    )
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "composer3d-train: invalid configuration: hydra/launcher=slurm_local needs the submitit "
        "launcher (hydra-submitit-launcher), which is not installed here. Install composer3d's "
        "slurm extra: pip install 'composer3d[slurm]'"
    ]
    assert not (tmp_path / "sweep").exists()


# ------------------------------------------------------------- validate() in-process, no subprocess


@pytest.fixture(scope="module")
def compose_cfg():
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        yield lambda *overrides: compose("train", overrides=["run.dir=unused", *overrides])


@pytest.mark.parametrize(
    "world, overrides, expected",
    [
        (
            4,
            [],
            {"dp_shard": 4, "dp_replicate": 1, "tp": 1},
        ),  # the default dp_shard=-1 takes the whole world
        (8, ["parallel.tp=2"], {"dp_shard": 4, "tp": 2}),
        (
            8,
            ["parallel.dp_replicate=2", "parallel.tp=2"],
            {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
        ),
        (4, ["parallel.tp=4", "parallel.sequence_parallel=true"], {"dp_shard": 1, "tp": 4}),
        (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], {"dp_replicate": 2, "dp_shard": 1}),
        (1, [], {"dp_shard": 1, "tp": 1}),
        # ring attention (the default cp style) takes any head count: 2 KV heads on 4 cp ranks
        (4, ["parallel.cp=4", "model.n_kv_heads=2"], {"dp_shard": 1, "cp": 4}),
        # cp composes with TP + SP (Ulysses on the heads a tp rank holds: 8/2 and 4/2 over cp 2) and
        # with ZeRO-1
        (
            8,
            [
                "parallel.cp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.cp_style=ulysses",
            ],
            {"dp_shard": 2, "cp": 2, "tp": 2},
        ),
        (
            4,
            ["parallel.cp=2", "parallel.zero_stage=1", "compile.enabled=true"],
            {"dp_shard": 2, "cp": 2},
        ),
        # cp with pipeline parallel, and with expert parallel (ep: the 2 cp ranks × 2 of dp_shard)
        (4, ["parallel.pp=2", "parallel.cp=2"], {"pp": 2, "dp_shard": 1, "cp": 2}),
        (
            8,
            ["model=tiny_moe", "parallel.cp=2", "parallel.ep=4"],
            {"dp_shard": 4, "cp": 2, "ep": 4},
        ),
        # and with pipeline and tensor + sequence parallel, compile or ZeRO-1 at once, and with EP
        # compiled (tests/test_cp_pp_ep.py)
        (
            8,
            ["parallel.pp=2", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
            {"pp": 2, "dp_shard": 1, "cp": 2, "tp": 2},
        ),
        (
            4,
            ["parallel.pp=2", "parallel.cp=2", "compile.enabled=true"],
            {"pp": 2, "dp_shard": 1, "cp": 2},
        ),
        (
            4,
            ["parallel.pp=2", "parallel.cp=2", "parallel.zero_stage=1"],
            {"pp": 2, "dp_shard": 1, "cp": 2},
        ),
        (
            4,
            ["model=tiny_moe", "parallel.cp=2", "parallel.ep=4", "compile.enabled=true"],
            {"dp_shard": 2, "cp": 2, "ep": 4},
        ),
        (
            8,
            ["model=tiny_moe", "parallel.cp=2", "parallel.ep=2", "parallel.tp=2"],
            {"dp_shard": 2, "cp": 2, "ep": 2, "tp": 2},
        ),
        # ZeRO-1 under EP (the experts' state over the ranks holding the same experts), under cp too
        (4, ["model=tiny_moe", "parallel.ep=2", "parallel.zero_stage=1"], {"dp_shard": 4, "ep": 2}),
        (
            4,
            ["model=tiny_moe", "parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1"],
            {"dp_shard": 2, "cp": 2, "ep": 2},
        ),
    ],
)
def test_validate_resolves_degrees(compose_cfg, world, overrides, expected):
    degrees = validate(compose_cfg(*overrides), world).as_dict()
    assert {k: degrees[k] for k in expected} == expected
    assert all(degrees[k] == 1 for k in ("pp", "cp", "ep") if k not in expected)
    product = (
        degrees["pp"]
        * degrees["dp_replicate"]
        * degrees["dp_shard"]
        * degrees["cp"]
        * degrees["tp"]
    )
    assert product == world


@pytest.mark.parametrize(
    "world, overrides, key, hint",
    [
        # what would work: the divisors of the world size
        (
            6,
            ["parallel.tp=4"],
            "parallel.tp",
            "Choose degrees whose product divides 6 (1, 2, 3, 6)",
        ),
        # what would work: the next multiple of micro_batch_size × dp
        (
            4,
            ["train.global_batch_size=12", "train.micro_batch_size=2"],
            "train.global_batch_size",
            "Use a multiple of 8, e.g. 8",
        ),
        # what would work: the divisors of n_heads
        (1, ["model.n_kv_heads=3"], "model.n_kv_heads", "Choose n_kv_heads among 1, 2, 4, 8"),
        (4, ["parallel.dp_shard=3"], "parallel.dp_shard", "set parallel.dp_shard=-1 to infer it"),
        (
            4,
            ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero_stage=1"],
            "parallel.zero_stage",
            "Use zero_stage=2 or 3 for HSDP",
        ),
        # checks added with these tests: each used to pass validation and fail later, inside the
        # workers
        (1, ["model.n_kv_heads=-4"], "model.n_kv_heads", "must be >= 1"),
        (1, ["data.max_tokens=-1"], "data.max_tokens", "Use 0 for no cap"),
        (
            1,
            ["data=synthetic", "data.synthetic_sequences=0"],
            "data.synthetic_sequences",
            "must be >= 1",
        ),
        (2, ["launch.timeout_minutes=0"], "launch.timeout_minutes", "must be > 0, got 0"),
        # mixture of experts: ep borrows dp_shard ranks and shards the experts; both must divide
        (
            4,
            ["model=tiny_moe", "parallel.ep=3"],
            "parallel.ep",
            "Choose parallel.ep among 1, 2, 4, 8",
        ),
        (
            4,
            ["model=tiny_moe", "parallel.ep=4", "parallel.tp=2"],
            "parallel.ep",
            "Choose parallel.ep among 1, 2",
        ),
        (1, ["model=tiny_moe", "model.moe.top_k=9"], "model.moe.top_k", "between 1 and experts=8"),
        (
            1,
            ["model=tiny_moe", "model.moe.dense_layers=4"],
            "model.moe.dense_layers",
            "at least one MoE layer",
        ),
        (
            1,
            ["model=tiny_moe", "model.moe.score_func=relu"],
            "model.moe.score_func",
            "Choose softmax or sigmoid",
        ),
        (
            1,
            ["model=tiny_moe", "model.moe.score_func=sigmoid", "model.moe.normalize_top_k=false"],
            "model.moe.normalize_top_k",
            "normalize_top_k=true",
        ),
        (
            1,
            ["model=tiny_moe", "model.moe.capacity_factor=-1"],
            "model.moe.capacity_factor",
            "Use 0 to turn it off",
        ),
        (
            2,
            ["model=tiny_moe", "parallel.tp=2", "model.moe.expert_hidden_dim=63"],
            "parallel.tp",
            "model.moe.expert_hidden_dim=63",
        ),
        # ZeRO-Offload: FSDP's or the optimizer's; the files need the optimizer's, whose host step
        # is torch's AdamW
        (1, ["parallel.offload=gpu"], "parallel.offload", "Choose none, cpu"),
        (
            2,
            ["parallel.offload=optimizer", "parallel.zero_stage=1"],
            "parallel.offload",
            "zero_stage=2 or 3",
        ),
        (
            1,
            ["parallel.offload=optimizer", "optim.name=adamw_8bit"],
            "parallel.offload",
            "Use optim.name=adamw",
        ),
        (
            1,
            ["parallel.offload_dir=/nvme"],
            "parallel.offload_dir",
            "Add parallel.offload=optimizer",
        ),
        (
            1,
            ["parallel.offload=optimizer", "optim.implementation=compiled"],
            "optim.implementation",
            "Use optim.implementation=auto with parallel.offload=optimizer",
        ),
        # what op-level selective checkpointing keeps: one of its policies, and only where it runs
        (
            1,
            ["memory.activation_checkpointing=selective", "memory.ac_policy=odd_matmuls"],
            "memory.ac_policy",
            "Choose one of ('all_matmuls', 'alternate_matmuls')",
        ),
        (
            1,
            ["memory.activation_checkpointing=full", "memory.ac_policy=alternate_matmuls"],
            "memory.ac_policy",
            "Add memory.activation_checkpointing=selective memory.ac_every=0",
        ),
        # keeping the all-gathers' outputs: only op-level selective over blocks that all-gather (SP,
        # cp's allgather)
        (
            2,
            [
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "memory.activation_checkpointing=full",
                "memory.ac_save_gathers=true",
            ],
            "memory.ac_save_gathers",
            "Use it with memory.activation_checkpointing=selective memory.ac_every=0 and "
            "parallel.tp>1",
        ),
        (
            2,
            [
                "parallel.tp=2",
                "parallel.dp_shard=1",
                "memory.activation_checkpointing=selective",
                "memory.ac_save_gathers=true",
            ],
            "memory.ac_save_gathers",
            "sequence_parallel=False, cp=1",
        ),
        # the fused loss runs the head from its whole weight inside the model's forward
        (1, ["train.loss_impl=liger"], "train.loss_impl", "Choose chunked or fused"),
        (
            2,
            ["train.loss_impl=fused", "parallel.tp=2"],
            "train.loss_impl",
            "Use train.loss_impl=chunked with parallel.tp>1",
        ),
        (
            2,
            ["train.loss_impl=fused", "parallel.pp=2"],
            "train.loss_impl",
            "Use train.loss_impl=chunked with parallel.pp>1",
        ),
        (
            1,
            ["train.loss_impl=fused", "memory.tile_loss=2"],
            "train.loss_impl",
            "Use memory.tile_loss=0 with it",
        ),
        # context parallel's attention styles; ulysses splits the (KV) heads over cp
        (
            2,
            ["parallel.cp=2", "parallel.cp_style=zigzag"],
            "parallel.cp_style",
            "Use ring (the default",
        ),
        (
            2,
            ["parallel.cp=2", "parallel.cp_balance=zigzag"],
            "parallel.cp_balance",
            "Use documents (the default",
        ),
        (
            4,
            ["parallel.cp=4", "parallel.cp_style=ulysses", "model.n_kv_heads=2"],
            "parallel.cp_style",
            "model.n_kv_heads=2 is not divisible by cp=4",
        ),
        # under TP, ulysses splits the heads each tp rank holds: 4 KV heads over tp=2 leave 2, not
        # divisible by cp=4
        (
            8,
            ["parallel.cp=4", "parallel.tp=2", "parallel.cp_style=ulysses"],
            "parallel.cp_style",
            "model.n_kv_heads=4 over tp=2 leaves 2 a rank, which is not divisible by cp=4",
        ),
        # hierarchical cp: Ulysses over cp_ulysses ranks × the ring across those groups
        (
            4,
            ["parallel.cp=4", "parallel.cp_style=hierarchical"],
            "parallel.cp_ulysses",
            "Use parallel.cp_ulysses in [2] (the cp ranks of a node)",
        ),
        (
            2,
            ["parallel.cp=2", "parallel.cp_style=hierarchical", "parallel.cp_ulysses=2"],
            "parallel.cp_ulysses",
            "cp=2 has no divisor between 1 and cp",
        ),
        (
            4,
            ["parallel.cp=4", "parallel.cp_ulysses=2"],
            "parallel.cp_ulysses",
            "got 2 with cp_style=ring",
        ),
        (
            8,
            [
                "parallel.pp=2",
                "parallel.cp=4",
                "parallel.cp_style=hierarchical",
                "parallel.cp_ulysses=2",
            ],
            "parallel.pp",
            "cp_style=hierarchical does not compose with parallel.pp yet",
        ),
        (
            16,
            [
                "parallel.cp=8",
                "parallel.tp=2",
                "parallel.cp_style=hierarchical",
                "parallel.cp_ulysses=4",
            ],
            "parallel.cp_ulysses",
            "model.n_kv_heads=4 over tp=2 leaves 2 a rank, which is not divisible by cp_ulysses=4",
        ),
        # sequence parallel splits the tokens a cp rank holds: 36 of seq_len=72 over cp=2 do not
        # divide by tp=8
        (
            16,
            [
                "parallel.cp=2",
                "parallel.tp=8",
                "model.n_heads=16",
                "model.n_kv_heads=8",
                "model.dim=128",
                "parallel.sequence_parallel=true",
                "train.seq_len=72",
            ],
            "train.seq_len",
            "the 36 tokens each of the cp=2 ranks holds is not divisible by tp=8",
        ),
        # under cp, ep takes every cp rank (a sequence's tokens meet at the same experts) and ep/cp
        # of dp_shard
        (
            8,
            ["model=tiny_moe", "parallel.cp=4", "parallel.ep=2"],
            "parallel.ep",
            "Choose parallel.ep among 4, 8",
        ),
        # expert capacity keeps a sequence's earliest choices, a position no cp rank sees alone
        (
            2,
            ["model=tiny_moe", "parallel.cp=2", "model.moe.capacity_factor=1.25"],
            "model.moe.capacity_factor",
            "Use model.moe.capacity_factor=0 with parallel.cp>1",
        ),
        # sequence tiling: tiles of the tokens a rank holds (seq_len / cp, / tp under sequence
        # parallel)
        (1, ["memory.tile_mlp=-1"], "memory.tile_mlp", "must be >= 0, got -1"),
        (1, ["train.seq_len=96", "memory.tile_mlp=64"], "memory.tile_mlp", "the 96 tokens"),
        (
            2,
            ["parallel.cp=2", "train.seq_len=96", "memory.tile_loss=32"],
            "memory.tile_loss",
            "the 48 tokens of a sequence each rank holds (train.seq_len=96 over cp=2)",
        ),
        (
            2,
            [
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "train.seq_len=96",
                "memory.tile_mlp=32",
            ],
            "memory.tile_mlp",
            "sequence parallel's tp=2",
        ),
        (
            2,
            ["parallel.pp=2", "memory.tile_loss=2"],
            "memory.tile_loss",
            "Use memory.tile_loss=0 with parallel.pp>1",
        ),
        (
            1,
            ["model=tiny_moe", "model.moe.dense_layers=0", "memory.tile_mlp=2"],
            "memory.tile_mlp",
            "every layer of this model is a mixture of experts",
        ),
        (
            2,
            ["parallel.pp=2", "model.tie_embeddings=true", "parallel.zero_stage=1"],
            "parallel.zero_stage",
            "Use parallel.zero_stage=2 or 3 for a tied model under parallel.pp",
        ),
        (
            2,
            [
                "parallel.pp=2",
                "parallel.pp_schedule=zbv",
                "model.n_layers=4",
                "train.eval_every=5",
                "eval.path=held_out.txt",
            ],
            "train.eval_every",
            "forward only, which torch's zbv cannot",
        ),
        (1, ["eval.num_fewshot=-2"], "eval.num_fewshot", "Use -1 for each task's own default"),
        (1, ["eval.limit=-1"], "eval.limit", "Use 0 for every document"),
        # composer3d-generate's decoding keys
        (1, ["generate.top_k=-1"], "generate.top_k", "Use 0 for no top-k cut"),
        (1, ["generate.stop=[END,'']"], "generate.stop", "Drop the empty one"),
        (
            1,
            ["generate.cache=paged"],
            "generate.cache",
            "Choose one of ('static', 'dynamic', 'none')",
        ),
        (
            1,
            ["generate.cache=dynamic"],
            "generate.cache",
            "Use generate.cache=static (or none)",
        ),  # native: static only
        # LoRA / QLoRA (peft)
        (1, ["peft.method=dora"], "peft.method", "Choose one of ('none', 'lora', 'qlora')"),
        (1, ["peft=lora", "peft.rank=0"], "peft.rank", "must be >= 1, got 0"),
        (1, ["peft=lora", "peft.alpha=0"], "peft.alpha", "must be > 0"),
        (1, ["peft=lora", "peft.dropout=1.0"], "peft.dropout", "must be in [0, 1)"),
        (1, ["peft=lora", "peft.target_modules=[]"], "peft.target_modules", "nothing would train"),
        (
            2,
            ["peft=lora", "peft.dropout=0.1", "parallel.tp=2"],
            "peft.dropout",
            "Use peft.dropout=0 with tensor parallel",
        ),
        (
            1,
            ["model=tiny_moe", "peft=lora", "peft.target_modules=[wq,moe.experts]"],
            "peft.target_modules",
            "routed experts",
        ),
        (
            1,
            ["peft=lora", "precision.float8.enabled=true"],
            "precision.float8.enabled",
            "Use precision.float8.enabled=false",
        ),
        (2, ["peft=qlora", "parallel.tp=2"], "parallel.tp", "NF4 weights split only by rows"),
        (
            2,
            ["peft=qlora", "parallel.zero_stage=1"],
            "parallel.zero_stage",
            "Use parallel.zero_stage=3 or 2",
        ),
        (
            2,
            ["peft=qlora", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
            "parallel.zero_stage",
            "DDP",
        ),
        (
            1,
            ["peft=qlora", "parallel.offload=cpu"],
            "parallel.offload",
            "Use parallel.offload=none",
        ),
        (1, ["peft.init_from=/no/adapter"], "peft.init_from", "peft.method is none"),
        (
            1,
            ["peft=lora", "peft.init_from=/no/adapter"],
            "peft.init_from",
            "/no/adapter is not a directory",
        ),
        (
            1,
            ["peft.base_from=/a/full/step-4"],
            "peft.base_from",
            "checkpoint.resume=/a/full/step-4",
        ),
        # how one rank reaches the compute dtype
        (
            1,
            ["precision.cast=once"],
            "precision.cast",
            "Choose one of ('auto', 'params', 'autocast')",
        ),
        (
            2,
            ["precision.cast=params", "parallel.tp=2"],
            "precision.cast",
            "Use precision.cast=auto",
        ),
        (
            1,
            ["precision.cast=params", "precision.param_dtype=float32"],
            "precision.cast",
            "precision.param_dtype=bfloat16",
        ),
        (
            1,
            ["precision.cast=params", "parallel.zero_stage=1"],
            "precision.cast",
            "parallel.zero_stage=3",
        ),
        (1, ["precision.cast=params", "peft=qlora"], "precision.cast", "autocast with peft=qlora"),
    ],
)
def test_validate_error_names_key_and_fix(compose_cfg, world, overrides, key, hint):
    with pytest.raises(ConfigError) as error:
        validate(compose_cfg(*overrides), world)
    message = str(error.value)
    assert message.startswith(key + ": "), message
    assert hint in message, message


def _adapter_dir(path, tensors: dict, **config):
    """A PEFT adapter directory as PeftModel.save_pretrained writes one (the fields
    ``peft.init_from`` reads)."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, **config})
    )
    save_file(
        {k: torch.zeros(shape) for k, shape in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )
    return path


@pytest.mark.parametrize(
    "config, key, hint",
    [
        ({"r": 16}, "peft.rank", "Use peft.rank=16"),
        ({"lora_alpha": 32}, "peft.alpha", "Use peft.alpha=32"),
        ({"use_dora": True}, "peft.init_from", "Name a plain LoRA adapter"),
    ],
)
def test_init_from_an_adapter_of_another_rank_or_alpha_names_the_key(
    compose_cfg, tmp_path, config, key, hint
):
    adapter = _adapter_dir(tmp_path / "adapter", {}, **config)
    with pytest.raises(ConfigError) as error:
        validate(compose_cfg("peft=lora", f"peft.init_from={adapter}"), 1)
    assert str(error.value).startswith(key + ": ") and hint in str(error.value), error.value


def test_init_from_an_adapter_of_other_targets_exits_2_before_any_worker(
    monkeypatch, capfd, tmp_path
):
    """Checked on the model (on meta) in the parent: the adapter lacks the run's w1-w3 adapters and
    holds one for a linear the run does not target."""
    prefix = "base_model.model.model.layers.{}.self_attn.{}_proj.lora_{}.weight"
    shapes = {prefix.format(i, p, "A"): (8, 64) for i in range(2) for p in "qkvo"}
    shapes.update(
        {prefix.format(i, p, "B"): (64 if p in "qo" else 32, 8) for i in range(2) for p in "qkvo"}
    )
    shapes["base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight"] = (8, 64)
    adapter = _adapter_dir(tmp_path / "adapter", shapes)
    code = run_command(
        monkeypatch,
        "composer3d.commands.train",
        f"run.dir={tmp_path / 'run'}",
        "launch.device=cpu",
        "launch.nproc_per_node=2",
        "peft=lora",
        f"peft.init_from={adapter}",
    )
    output = capfd.readouterr().err
    assert code == 2 and output.count(PREFIX) == 1, output
    message = output[output.index(PREFIX) + len(PREFIX) :]
    assert message.startswith("peft.init_from: "), output
    assert "lacks ['base_model.model.model.layers.0.mlp.down_proj.lora_A.weight'" in message, output
    assert "x_proj" in message and "peft.target_modules" in message, output
    assert not (tmp_path / "run").exists()


# Hugging Face models under context parallel: what composer3d's attention in transformers' interface
# cannot compute
@pytest.mark.parametrize(
    "arch, config, reason",
    [
        ("gemma2", {}, "gemma2 soft-caps its attention scores"),
        ("llama", {"attention_dropout": 0.1}, "llama has attention dropout (0.1)"),
        ("qwen3_moe", {"output_router_logits": True}, "qwen3_moe's router load-balancing loss"),
        ("llama", {}, None),
        ("qwen3", {}, None),  # they pass (tests/test_cp_hf.py checks them against transformers)
        ("mistral", {}, None),  # sliding windows, every layer's
        ("gemma3_text", {}, None),  # windowed and full layers
    ],
)
def test_context_parallel_of_a_hugging_face_model_refuses_what_its_attention_cannot_compute(
    compose_cfg, tmp_path, arch, config, reason
):
    from hf_models import hf_config

    from composer3d.config.checks import resolve_model_config

    hf_config(arch, **config).save_pretrained(tmp_path)
    cfg = compose_cfg(
        "model=hf",
        f"model.path={tmp_path}",
        "parallel.cp=2",
        "parallel.dp_shard=1",
        "train.seq_len=32",
    )
    resolve_model_config(cfg.model)
    if reason is None:
        assert validate(cfg, 2).cp == 2
        return
    with pytest.raises(ConfigError) as error:
        validate(cfg, 2)
    assert str(error.value).startswith(
        f"parallel.cp: context parallel (cp=2) of this model: {reason}"
    ), error.value
    assert "Use parallel.cp=1" in str(error.value)


# The fused loss runs a head that is the final norm and one bias-free linear layer, nothing more
@pytest.mark.parametrize(
    "arch, config, fusable",
    [
        ("llama", {}, True),
        ("gemma2", {}, False),  # gemma2 soft-caps its logits
        ("cohere", {}, False),  # cohere scales them (logit_scale)
    ],
)
def test_fused_loss_of_a_hugging_face_model_refuses_a_head_that_does_more(
    compose_cfg, tmp_path, arch, config, fusable
):
    from hf_models import hf_config

    from composer3d.config.checks import resolve_model_config
    from composer3d.models import build_model

    hf_config(arch, **config).save_pretrained(tmp_path)
    cfg = compose_cfg(
        "model=hf", f"model.path={tmp_path}", "train.loss_impl=fused", "train.seq_len=32"
    )
    resolve_model_config(cfg.model)
    if fusable:
        validate(cfg, 1)
        model = build_model(cfg.model)
        norm, weight = model.linear_head()  # what the fused loss runs
        assert norm is model.norm and weight is model.lm_head.weight
        return
    with pytest.raises(
        ConfigError,
        match=r"^train\.loss_impl: fused runs the head as the final norm .* Use "
        r"train\.loss_impl=chunked",
    ):
        validate(cfg, 1)


def test_context_parallel_refuses_attention_that_bypasses_transformers_interface(
    compose_cfg, tmp_path, monkeypatch
):
    """An attention module computing its own softmax (never calling the interface) is found on the
    tiny replica."""
    from hf_models import hf_config
    from transformers.models.llama import modeling_llama

    from composer3d.config.checks import resolve_model_config

    # the module's lookup gives it its own default, eager attention, whatever the config names
    class Bypassed:
        def get_interface(self, name, default):
            return default

    hf_config("llama").save_pretrained(tmp_path)
    cfg = compose_cfg(
        "model=hf",
        f"model.path={tmp_path}",
        "parallel.cp=2",
        "parallel.dp_shard=1",
        "train.seq_len=32",
    )
    resolve_model_config(cfg.model)
    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", Bypassed())
    with pytest.raises(
        ConfigError,
        match=r"parallel\.cp: .*llama's attention is not all reached through transformers' "
        r"attention interface \(0 calls for 2 layers\)",
    ):
        validate(cfg, 2)


def test_context_parallel_of_a_soft_capped_model_exits_2_before_any_worker(
    monkeypatch, capsys, tmp_path
):
    """Gemma 2 soft-caps its attention scores, which cp's kernels do not (its sliding windows they
    compute: tests/test_cp_hf.py)."""
    from hf_models import make_model

    path = make_model(tmp_path / "gemma2", "gemma2")
    assert (
        run_command(
            monkeypatch,
            "composer3d.commands.train",
            f"run.dir={tmp_path / 'run'}",
            "launch.device=cpu",
            "model=hf",
            f"model.path={path}",
            "launch.nproc_per_node=2",
            "parallel.cp=2",
            "parallel.dp_shard=1",
            "train.seq_len=32",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count(PREFIX) == 1 and f"{PREFIX}parallel.cp: " in err and "soft-caps" in err, err
    assert not (tmp_path / "run").exists()


def test_help_documents_every_key_with_its_composed_value_and_lists_groups_and_recipes(
    monkeypatch, capsys
):
    """`composer3d-train --help`: every key of the sections it reads (all but generate.*) with its
    value in the composed config (a recipe's, when one is chosen) and the schema's comment on it;
    the config groups and the recipes. Exit 0, nothing trained."""
    import dataclasses

    from composer3d.commands.cli import TRAIN
    from composer3d.config.schema import TrainConfig

    def keys(prefix, cls):
        for f in dataclasses.fields(cls):
            nested = f.default_factory if dataclasses.is_dataclass(f.default_factory) else None
            yield from keys(f"{prefix}{f.name}.", nested) if nested else [f"{prefix}{f.name}"]

    code = run_command(monkeypatch, "composer3d.commands.train", "recipe=llama3_1_8b", "--help")
    text = capsys.readouterr().out
    assert code == 0, text[-3000:]
    listed = {key: f"  {key}=" in text for key in keys("", TrainConfig)}
    assert {
        k for k, shown in listed.items() if shown != (k.split(".")[0] in TRAIN.sections)
    } == set()
    assert set(TRAIN.sections) == {f.name for f in dataclasses.fields(TrainConfig)} - {"generate"}
    assert "  model.name=hf " in text and "  train.seq_len=4096 " in text, (
        "the recipe's values, not the defaults"
    )
    # data.max_tokens's, schema.py
    assert "cap on tokens read from the corpus into memory (0 = no cap)" in text
    assert (
        "model: hf, llama3_1b," in text
        and "data: chat, preference, stdlib, synthetic, text_files" in text
    )
    assert "recipe: gemma2_9b, gemma2_9b_8x8, llama3_1_70b," in text
    assert "train:\n" in text and "Override any key as key=value" in text
    # each key's own comment, not one run on from the class above it; data.name names the data=chat
    # option
    assert "  model.moe.experts=0                   routed experts per MoE layer" in text
    assert "text_files (the data=chat option" in text


# ---------------------------------------------------------------------- the entry points in-process


@pytest.mark.parametrize(
    "typed, near",
    [
        ("train.stepz=3", "train.steps"),
        ("trian.steps=3", "train.steps"),
        ("model.moe.expert=4", "model.moe.experts"),
        ("precision.float8.enabeld=true", "precision.float8.enabled"),
    ],
)
def test_mistyped_key_names_the_nearest_real_key_not_hydras_plus_hint(
    monkeypatch, capsys, typed, near
):
    """One line naming the key typed and the nearest real one, exit 2; not Hydra's "use +key" (which
    we refuse)."""
    assert (
        run_command(
            monkeypatch, "composer3d.commands.train", "run.dir=unused", typed, "launch.device=cpu"
        )
        == 2
    )
    err = capsys.readouterr().err
    key = typed.split("=")[0]
    assert err.strip().splitlines() == [
        f"composer3d-train: invalid configuration: {key}: is not a composer3d setting. Did you "
        f"mean {near}?"
    ], err


def test_every_schema_key_is_a_setting_and_free_form_values_are_not_second_guessed():
    from composer3d.config.keys import names_a_setting, schema_keys

    # run.dir's value is missing (???) in the schema
    assert len(schema_keys()) > 100 and "run.dir" in schema_keys()
    assert [k for k in schema_keys() if not names_a_setting(k)] == []
    assert not names_a_setting("train.stepz") and not names_a_setting("trian.steps")


def test_key_added_with_plus_names_the_nearest_real_key(compose_cfg):
    with pytest.raises(
        ConfigError, match=r"train\.stepz: is not a composer3d setting.*Did you mean train\.steps\?"
    ):
        validate(compose_cfg("+train.stepz=3"), 1)


@pytest.mark.parametrize(
    "module, command, listed, unlisted",
    [
        ("composer3d.commands.plan", "composer3d-plan", "cluster.nodes", "generate.prompt"),
        ("composer3d.commands.generate", "composer3d-generate", "generate.prompt", "optim.lr"),
        ("composer3d.commands.prepare", "composer3d-prepare", "data.prepared", "parallel.tp"),
        ("composer3d.commands.evaluate", "composer3d-eval", "eval.path", "optim.lr"),
        ("composer3d.commands.train", "composer3d-train", "optim.lr", "generate.prompt"),
    ],
)
def test_each_command_help_opens_with_its_own_banner_and_lists_its_own_keys(
    monkeypatch, capsys, module, command, listed, unlisted
):
    assert run_command(monkeypatch, module, "--help") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{command}: "), out[:300]
    examples = out[out.index("Examples: ") :]
    assert command in examples, examples
    assert ("composer3d-train -m" in examples) == (command == "composer3d-train"), examples
    assert (f"  {listed}=" in out, f"  {unlisted}=" in out) == (True, False), out
    # the sections left out are named, so a key's absence is not taken for its nonexistence
    assert f" {unlisted.split('.')[0]}" in out[out.index("(this command does not read") :]


def test_help_imports_no_torch(tmp_path):
    """--help (and a refused override) answer before torch's import (3.6 s of CPU), which the
    commands' own modules need: the console scripts' module imports Hydra and the schema only."""
    probe = (
        "import atexit, sys\n"
        "from composer3d.commands.cli import generate\n"
        "sys.argv = ['composer3d-generate', '--help']\n"
        # the console script ends the process: what it imported is told as it ends
        "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
        "generate()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("composer3d-generate: ")
    assert done.stdout.splitlines()[-1] == "torch imported: False"


def test_help_into_a_pipe_its_reader_closed_is_no_traceback(tmp_path):
    """`composer3d-train --help | head -1`: the reader gone before the help is written."""
    probe = (
        "import sys\n"
        "from composer3d.commands.cli import train\n"
        "sys.argv = ['composer3d-train', '--help']\n"
        "train()\n"
    )
    read, write = os.pipe()
    os.close(read)  # nothing will read what the command writes
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.timing
def test_each_command_help_takes_under_2_s():
    """The console script a user types, from process start to exit, alone on the machine."""
    for command in (
        "composer3d-train",
        "composer3d-generate",
        "composer3d-eval",
        "composer3d-plan",
    ):
        start = time.perf_counter()
        done = subprocess.run(
            [shutil.which(command), "--help"], capture_output=True, text=True, timeout=60
        )
        seconds = time.perf_counter() - start
        assert done.returncode == 0 and done.stdout.startswith(f"{command}: "), done.stderr
        assert seconds < 2, f"{command} --help took {seconds:.2f} s"


@pytest.mark.parametrize(
    "overrides, key, what",
    [
        (["model=hf", "model.path={tmp}"], "model", "model=hf (a Hugging Face model)"),
        (["data.tokenizer={tmp}"], "data.tokenizer", "a Hugging Face tokenizer"),
    ],
)
def test_hugging_face_without_the_hf_extra_says_how_to_install_it(
    monkeypatch, capsys, tmp_path, overrides, key, what
):
    # `import transformers` fails, as uninstalled
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    argv = [o.format(tmp=tmp_path) for o in overrides]
    assert (
        run_command(
            monkeypatch,
            "composer3d.commands.train",
            f"run.dir={tmp_path / 'run'}",
            "launch.device=cpu",
            *argv,
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"composer3d: invalid configuration: {key}: {what} needs transformers, which is not "
        "installed here. Install composer3d's hf extra: pip install 'composer3d[hf]'"
    ], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("launcher", ["slurm_local", "submitit_local", "slurm"])
def test_max_restarts_in_a_submitit_sweep_is_refused_before_any_job(
    monkeypatch, capsys, tmp_path, launcher
):
    assert (
        run_command(
            monkeypatch,
            "composer3d.commands.train",
            f"run.dir={tmp_path / 'sweep'}",
            "launch.device=cpu",
            f"hydra/launcher={launcher}",
            "launch.max_restarts=1",
            "optim.lr=1e-3,2e-3",
            "-m",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "composer3d-train: invalid configuration: launch.max_restarts: 1 restarts asked for, but "
        "they are the local launcher's, and the ranks of a submitit job are its tasks: nothing "
        "would restart them. Use launch.max_restarts=0; under SLURM, "
        "hydra.launcher.max_num_timeout=N requeues a job preempted or out of time (it resumes from "
        "its last checkpoint)"
    ], err
    assert not (tmp_path / "sweep").exists()  # nothing submitted


@pytest.mark.parametrize(
    "argv",
    [
        ["hydra/launcher=slurm_local", "launch.max_restarts=0", "-m"],  # no restarts asked for
        [
            "launch.max_restarts=1",
            "optim.lr=1e-3,2e-3",
            "-m",
        ],  # Hydra's basic launcher: the local launcher restarts
        [
            "hydra/launcher=slurm_local",
            "launch.max_restarts=1",
        ],  # no -m: Hydra's launcher is not used
    ],
)
def test_max_restarts_where_the_local_launcher_runs_is_not_refused(argv):
    from composer3d.config.overrides import compose_overrides
    from composer3d.config.sweep import check_sweep

    register_configs()  # as importing the command line's glue does
    multirun = "-m" in argv
    overrides = ["run.dir=unused", *(a for a in argv if not a.startswith("-"))]
    with hydra_cleared():  # as the command line starts
        check_sweep(compose_overrides("composer3d.conf", "train", overrides, multirun), multirun)


def _checkpoint(path, peft: dict, **meta):
    """A committed checkpoint as far as the resume checks read one: composer3d.json and a DCP
    index."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"x": torch.zeros(1)}}, checkpoint_id=path, no_dist=True)
    config = {"model": {"name": "llama"}, "peft": peft, "train": {"seed": 0}}
    (path / "composer3d.json").write_text(
        json.dumps({"format": 1, "step": 2, "model_only": False, "config": config, **meta})
    )
    return path


@pytest.mark.filterwarnings("ignore:.*single process:UserWarning")
@pytest.mark.parametrize("case", ["base_gone", "base_not_named", "resume_full", "base_is_adapters"])
def test_a_peft_base_that_cannot_be_found_or_is_no_base_exits_2_naming_the_key(
    monkeypatch, capsys, tmp_path, case
):
    """A LoRA checkpoint holds no base, only where it came from: at resume that source must be there
    and be what this run's config builds; a full checkpoint is LoRA's base through peft.base_from,
    not checkpoint.resume."""
    # the full run's weights the adapters trained on, deleted since
    gone = tmp_path / "full" / "step-00000004"
    lora = _checkpoint(
        tmp_path / "lora" / "step-00000002",
        {"method": "lora", "base_from": str(gone)},
        peft_base={"checkpoint": str(gone)},
    )
    full = _checkpoint(tmp_path / "other" / "step-00000004", {"method": "none"})
    argv, expected = {
        "base_gone": (
            [f"peft.base_from={gone}", f"checkpoint.resume={lora}"],
            f"peft.base_from: {gone} is not a composer3d checkpoint",
        ),
        "base_not_named": (
            [f"checkpoint.resume={lora}"],
            f"checkpoint.resume: {lora}'s adapters were trained on the full checkpoint {gone} "
            "(peft.base_from), and this run's config builds its base from the initialization from "
            f"train.seed=0. To resume, set peft.base_from={gone}",
        ),
        "resume_full": ([f"checkpoint.resume={full}"], f"start with peft.base_from={full}"),
        "base_is_adapters": (
            [f"peft.base_from={lora}"],
            f"peft.base_from: {lora} is a peft=lora checkpoint: it holds adapters, not a base. "
            f"Continue it with checkpoint.resume={lora}, or name the base",
        ),
    }[case]
    code = run_command(
        monkeypatch,
        "composer3d.commands.train",
        f"run.dir={tmp_path / 'run'}",
        "launch.device=cpu",
        "model=tiny",
        "peft=lora",
        "launch.nproc_per_node=2",
        *argv,
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count(PREFIX) == 1 and expected in err, err
