"""Bad input is refused up front: one ConfigError naming the key and what would work, exit code 2,
before any worker starts (``preflight``), printed once — for the corpus, the checkpoint to resume,
the device, the output directories, keys Hydra's ``+`` adds, and what composer3d-eval would
evaluate.

Most cases call ``preflight`` in-process on a config composed by Hydra (fast: no torch import per
case); the CLI cases show the paths those errors take: the launcher refuses before starting workers,
a late corpus error in the workers is reported once, and Hydra's own errors exit 2 too.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from harness import FAST, logged, train, train_command, train_job
from hf_models import make_model
from hydra import compose, initialize_config_module

from composer3d.commands.evaluate import check_weights_source
from composer3d.config.checks import resolve_model_config
from composer3d.config.registration import register_configs
from composer3d.errors import ConfigError
from composer3d.launch.preflight import preflight

PREFIX = "composer3d: invalid configuration: "


@pytest.fixture(scope="module")
def compose_cfg(tmp_path_factory):
    register_configs()
    run_dir = tmp_path_factory.mktemp("run")
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        yield lambda *overrides: compose(
            "train", overrides=[f"run.dir={run_dir}", "launch.device=cpu", *overrides]
        )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One bad file of each kind (and a good one)."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "empty").mkdir()
    (root / "empty" / "a.txt").write_text("")
    (root / "good.txt").write_text("def f(x):\n    return x\n" * 200)
    (root / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (root / "nofield.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    (root / "malformed.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')
    (root / "nonstring.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    (root / "corrupt.parquet").write_bytes(b"PAR1" + bytes(100) + b"PAR1")
    pq.write_table(pa.table({"body": ["a", "b"]}), root / "nofield.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "nonstring.parquet")
    (root / "not_a_dir").write_text("a file where a directory is asked for")
    hf_unknown = make_model(root / "hf_unknown", "llama")
    config = json.loads((hf_unknown / "config.json").read_text())
    (hf_unknown / "config.json").write_text(
        json.dumps({**config, "model_type": "no_such_architecture"})
    )
    # weights cut short, as a download or copy that stopped leaves them: one file, and one shard of
    # a sharded save (model.safetensors.index.json beside the shards)
    from transformers import AutoModelForCausalLM

    whole = make_model(root / "hf_truncated", "llama", tokenizer=False)
    AutoModelForCausalLM.from_pretrained(whole).save_pretrained(
        root / "hf_sharded_truncated", max_shard_size="300KB"
    )
    for weights in (whole / "model.safetensors", root / "hf_sharded_truncated" / SHARD):
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real 2-step checkpoint of the FAST config, for the resume cases."""
    run_dir = tmp_path_factory.mktemp("trained")
    train_job(run_dir, *FAST, "train.steps=2")
    return run_dir / "checkpoints" / "step-00000002"


def _absent_accelerator() -> str:
    """An accelerator type this machine does not have (cuda, unless it has CUDA)."""
    here = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return "xpu" if here is not None and here.type == "cuda" else "cuda"


SHARD = "model-00002-of-00003.safetensors"

# (id, overrides with {files}/{checkpoint} placeholders, key the message starts with, a fragment it
# contains)
PREFLIGHT_CASES = [
    (
        "empty_corpus",
        ["data=text_files", "data.paths=[{files}/empty]"],
        "data.paths",
        "every file is empty",
    ),
    (
        "jsonl_without_field",
        ["data=text_files", "data.paths=[{files}/nofield.jsonl]"],
        "data.text_field",
        "fields: ['body']",
    ),
    (
        "parquet_without_field",
        ["data=text_files", "data.paths=[{files}/nofield.parquet]"],
        "data.text_field",
        "fields: ['body']",
    ),
    (
        "binary_text",
        ["data=text_files", "data.paths=[{files}/binary.txt]"],
        "data.paths",
        "is not UTF-8 text",
    ),
    (
        "malformed_json_line",
        ["data=text_files", "data.paths=[{files}/malformed.jsonl]"],
        "data.paths",
        "line 2 is not valid JSON",
    ),
    (
        "corrupt_parquet",
        ["data=text_files", "data.paths=[{files}/corrupt.parquet]"],
        "data.paths",
        "is not a readable parquet file",
    ),
    (
        "non_string_json_text",
        ["data=text_files", "data.paths=[{files}/nonstring.jsonl]"],
        "data.text_field",
        "holds int '5'",
    ),
    (
        "non_string_parquet_column",
        ["data=text_files", "data.paths=[{files}/nonstring.parquet]"],
        "data.text_field",
        "holds int64, not text",
    ),
    (
        "paths_without_text_files",
        ["data.paths=[{files}/good.txt]"],
        "data.paths",
        "Add data=text_files",
    ),
    (
        "unknown_key_added_with_plus",
        ["+some.unknown_key=1"],
        "some.unknown_key",
        "is not a composer3d setting",
    ),
    ("unknown_nested_key", ["+train.stepz=3"], "train.stepz", "is not a composer3d setting"),
    (
        "resume_missing",
        ["checkpoint.resume={files}/nope"],
        "checkpoint.resume",
        "no composer3d.json",
    ),
    (
        "resume_other_model_shape",
        ["checkpoint.resume={checkpoint}", "model.n_layers=3"],
        "model",
        "a model of another shape",
    ),
    (
        "resume_past_train_steps",
        ["checkpoint.resume={checkpoint}", "train.steps=1"],
        "train.steps",
        "past train.steps=1",
    ),
    (
        "resume_adamw_state_with_muon",
        ["checkpoint.resume={checkpoint}", "train.steps=4", "optim.name=muon"],
        "optim.name",
        "holds the state of optim.name=adamw, which optim.name=muon cannot continue",
    ),
    (
        "async_pinned_on_cpu",
        ["checkpoint.async_mode=async_pinned"],
        "checkpoint.async_mode",
        "needs an accelerator",
    ),
    (
        "compile_tp_on_cpu",
        ["compile.enabled=true", "parallel.tp=2", "launch.nproc_per_node=2"],
        "compile.enabled",
        "wrong gradients on the CPU",
    ),
    (
        "absent_accelerator",
        ["launch.device={absent}"],
        "launch.device",
        "is not an accelerator here",
    ),
    ("unknown_device_name", ["launch.device=gpu"], "launch.device", "Use launch.device=auto"),
    ("run_dir_not_writable", ["run.dir={files}/not_a_dir/run"], "run.dir", "cannot write into"),
    (
        "checkpoint_dir_not_writable",
        ["checkpoint.dir={files}/not_a_dir/ckpt"],
        "checkpoint.dir",
        "cannot write into",
    ),
    (
        "unknown_hf_model_type",
        ["model=hf", "model.path={files}/hf_unknown"],
        "model.path",
        "no_such_architecture",
    ),
    (
        "truncated_safetensors",
        ["model=hf", "model.path={files}/hf_truncated", "data=synthetic"],
        "model.path",
        "hf_truncated/model.safetensors is truncated or corrupt (safetensors: ",
    ),
    (
        "truncated_safetensors_shard",
        ["model=hf", "model.path={files}/hf_sharded_truncated", "data=synthetic"],
        "model.path",
        f"hf_sharded_truncated/{SHARD} is truncated or corrupt (safetensors: ",
    ),
]


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [c[1:] for c in PREFLIGHT_CASES],
    ids=[c[0] for c in PREFLIGHT_CASES],
)
def test_preflight_refuses_naming_the_key(compose_cfg, files, checkpoint, overrides, key, fragment):
    filled = [
        o.format(files=files, checkpoint=checkpoint, absent=_absent_accelerator())
        for o in overrides
    ]
    with pytest.raises(ConfigError) as error:
        cfg = compose_cfg(*filled)
        resolve_model_config(cfg.model)
        preflight(cfg, cfg.launch.nproc_per_node)
    message = str(error.value)
    assert message.startswith(key + ": "), message
    assert fragment in message, message


@pytest.fixture
def never_logged_in(monkeypatch, tmp_path):
    """A machine where wandb was never logged in: a home, netrc file and wandb settings of its own,
    no WANDB_* variables, and a fresh wandb singleton and session (they keep what they read
    first)."""
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import authenticate

    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / ".config" / "wandb"))
    monkeypatch.chdir(tmp_path)  # the workspace settings: ./wandb/settings
    monkeypatch.setattr(wandb_setup, "_singleton", None)
    monkeypatch.setattr(authenticate, "_session_auth", None)
    return tmp_path


@pytest.mark.parametrize(
    "environment, message",
    [
        (
            {},
            "logging.wandb: not logged in to Weights & Biases (no API key in WANDB_API_KEY or "
            "the netrc file). Run `wandb login` once on this machine, or set WANDB_MODE=offline "
            "to log locally (`wandb sync` uploads the run later), or use logging.wandb=false",
        ),
        (
            {"WANDB_API_KEY": "short"},
            "logging.wandb: the Weights & Biases credentials are not usable (WANDB_API_KEY "
            "invalid: API key must have 40+ characters, has 5.). Run `wandb login --relogin`, or "
            "set WANDB_MODE=offline to log locally (`wandb sync` uploads the run later), or use "
            "logging.wandb=false",
        ),
    ],
    ids=["no_login", "malformed_key"],
)
def test_wandb_without_login_is_refused_before_any_worker(
    compose_cfg, never_logged_in, monkeypatch, environment, message
):
    """logging.wandb=true with no usable credentials: one line naming the key and the ways out
    (before: wandb.init's 32-line traceback in the workers, once the data and the model were
    built)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as error:
        preflight(compose_cfg("logging.wandb=true"), 1)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "environment, netrc",
    [
        ({"WANDB_MODE": "offline"}, ""),
        ({"WANDB_MODE": "disabled"}, ""),
        ({"WANDB_API_KEY": "k" * 40}, ""),
        ({}, f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n"),
    ],
    ids=["offline", "disabled", "key_in_environment", "key_in_netrc"],
)
def test_wandb_logged_in_or_offline_passes(
    compose_cfg, never_logged_in, monkeypatch, environment, netrc
):
    """What `wandb login` leaves (the netrc file), WANDB_API_KEY, and an offline or disabled wandb
    pass; only the files and the environment are read (a fake key is not refused)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    if netrc:
        (never_logged_in / ".netrc").write_text(netrc)
        (never_logged_in / ".netrc").chmod(0o600)
    preflight(compose_cfg("logging.wandb=true"), 1)


def test_wandb_not_installed_is_refused_naming_how_to_install(compose_cfg, monkeypatch):
    """Before: a ModuleNotFoundError traceback in the workers, once the model was built."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError) as error:
        preflight(compose_cfg("logging.wandb=true"), 1)
    assert str(error.value) == (
        "logging.wandb: the wandb package is not installed (composer3d depends on it; an install "
        "with --no-deps leaves it out). Install it with pip install wandb, or use "
        "logging.wandb=false"
    )


def test_model_sizes_given_with_a_hugging_face_model_are_refused_not_dropped(compose_cfg, tmp_path):
    """model=hf builds what its config.json describes: sizes given beside it would be dropped
    without a word, so they are refused naming the keys and the file; sizes equal to the file's
    pass."""
    path = make_model(tmp_path / "hf", "llama")
    config = json.loads((path / "config.json").read_text())
    layers, dim = config["num_hidden_layers"], config["hidden_size"]
    with pytest.raises(ConfigError) as error:
        resolve_model_config(
            compose_cfg("model=hf", f"model.path={path}", "model.n_layers=6", "model.dim=256").model
        )
    assert str(error.value) == (
        f"model.dim: model=hf builds the model {path}/config.json describes (dim={dim} "
        f"n_layers={layers}), so the model.dim=256 model.n_layers=6 given would be dropped. Leave "
        "the model.* sizes out, or give model.path a directory whose config.json has the sizes you "
        "want"
    )
    same = compose_cfg("model=hf", f"model.path={path}", f"model.n_layers={layers}").model
    resolve_model_config(same)
    assert same.n_layers == layers and same.dim == dim
    resolve_model_config(same)  # a config filled before holds the file's own sizes


def test_more_cpu_ranks_than_cores_are_said_before_any_worker(compose_cfg, monkeypatch):
    """launch.nproc_per_node above the cores on the CPU runs (a layout is tried so on a small
    machine), and the preflight says what it costs, once; within the cores it says nothing."""
    from composer3d.launch import distributed

    monkeypatch.setattr(distributed, "cpu_cores", lambda: 2)
    with logged(logging.WARNING) as said:
        for nproc in (2, 8):
            cfg = compose_cfg(
                "model=tiny", "train.micro_batch_size=1", f"launch.nproc_per_node={nproc}"
            )
            preflight(cfg, nproc)
    assert [m for m in said if "CPU ranks on" in m] == [
        "launch.nproc_per_node=8 CPU ranks on 2 cores: the ranks take turns on the cores and each "
        "collective waits for those not running, so a step takes several times as long as on 2 "
        "ranks. Right for trying a layout; to train, launch.nproc_per_node<=2"
    ], said


def test_preflight_passes_what_can_run(compose_cfg, files, checkpoint):
    """The checks are not simply refusing: good files, a matching checkpoint, writable dirs and an
    evaluation during training on a file that holds its windows pass."""
    cfg = compose_cfg(
        "data=text_files",
        f"data.paths=[{files}/good.txt]",
        f"checkpoint.resume={checkpoint}",
        "train.steps=4",
        "train.eval_every=2",
        f"eval.path={files}/good.txt",
    )
    assert preflight(cfg, 1).dp_shard == 1


def test_auto_device_needs_an_accelerator_per_local_process(monkeypatch):
    """launch.device=auto on a machine with one (simulated) CUDA device: one process takes it; four
    are refused before any worker starts (before: the workers past the first failed on a device
    index that does not exist), and so is a worker whose launcher says the node runs four
    (LOCAL_WORLD_SIZE, as torchrun sets it)."""
    from composer3d.launch import distributed

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda")
    )
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    assert distributed.device_type("auto", local_processes=1) == "cuda"
    assert distributed.device_type("cpu", local_processes=4) == "cpu"
    with pytest.raises(
        ConfigError,
        match=r"^launch.nproc_per_node: 4 processes on this node but it has 1 cuda device\(s\). "
        r"Use launch.nproc_per_node<=1, or launch.device=cpu",
    ):
        distributed.device_type("auto", local_processes=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="launch.nproc_per_node: 4 processes"):
        # rank 0 refuses too, not only the ranks past the device
        distributed.resolve_device("auto", local_rank=0)


def test_eval_refuses_random_weights(compose_cfg, checkpoint):
    with pytest.raises(
        ConfigError, match=r"^checkpoint\.resume: model=llama has no weights .* random"
    ):
        check_weights_source(compose_cfg("model=tiny"))
    # a checkpoint's weights: fine
    check_weights_source(compose_cfg(f"checkpoint.resume={checkpoint}"))


# ------------------------------------------------------------------------------------ the CLI paths


def _refused_once(run, key: str) -> str:
    assert run.returncode == 2, run.output
    assert run.output.count(PREFIX) == 1, run.output
    assert "Traceback" not in run.output, run.output
    message = run.output[run.output.index(PREFIX) + len(PREFIX) :]
    assert message.startswith(key + ":"), run.output
    return message


def test_launcher_refuses_bad_corpus_before_any_worker(monkeypatch, capfd, tmp_path, files):
    run = train_command(
        monkeypatch,
        capfd,
        tmp_path / "run",
        "data=text_files",
        f"data.paths=[{files}/nonstring.parquet]",
        "launch.device=cpu",
        nproc=2,
    )
    _refused_once(run, "data.text_field")
    assert "worker" not in run.output, "refused by the launcher, not by failing workers"


def test_late_corpus_error_in_workers_is_reported_once(tmp_path):
    """A malformed line past what the launcher reads up front fails in every worker alike: one
    message, exit 2."""
    corpus = tmp_path / "late.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(150))
        + '{"text": "cut\n'
    )
    run = train(
        tmp_path / "run",
        "data=text_files",
        f"data.paths=[{corpus}]",
        "launch.device=cpu",
        nproc=2,
        check=False,
    )
    message = _refused_once(run, "data.paths")
    # the line Python's JSON refuses, counted from 1 (arrow said "row 150", "Invalid encoding"), and
    # no noise of the datasets library (its progress bars, its own log of the failure)
    assert "late.jsonl line 151 is not valid JSON" in message, message
    assert "Generating train split" not in run.output and "Failed to load JSON" not in run.output, (
        run.output
    )


def test_resume_after_data_change_is_a_config_error_not_a_bad_checkpoint(tmp_path, checkpoint):
    """A healthy checkpoint resumed with another seq_len: named as the change it is, not as
    'unreadable' (found by the workers as they load it: one line, exit 2, through the launcher)."""
    run = train(
        tmp_path / "run",
        *FAST,
        "train.seq_len=16",
        "train.steps=4",
        f"checkpoint.resume={checkpoint}",
        nproc=2,
        check=False,
    )
    message = _refused_once(run, "checkpoint.resume")
    assert "train.seq_len or train.seed changed" in message and "unreadable" not in run.output


def test_resume_with_checkpointing_off_is_refused(monkeypatch, capfd, tmp_path, checkpoint):
    """checkpoint.resume=<step> with checkpoint.enabled=false: before, it trained from scratch
    without a word."""
    run = train_command(
        monkeypatch,
        capfd,
        tmp_path / "run",
        *FAST,
        "train.steps=4",
        "checkpoint.enabled=false",
        f"checkpoint.resume={checkpoint}",
    )
    assert "would not be read" in _refused_once(run, "checkpoint.resume")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model=nonexistent"], "model: no option 'nonexistent'"),
        (["train.steps=abc"], "train.steps"),
    ],
)
def test_hydra_errors_exit_2(tmp_path, overrides, fragment):
    run = train(tmp_path / "run", *overrides, nproc=2, check=False)
    assert run.returncode == 2 and fragment in run.output, run.output


def test_unreadable_metrics_line_is_refused_before_any_worker(monkeypatch, capfd, tmp_path):
    """A metrics.jsonl line that no crash could have cut (not the last) is refused in one line
    naming run.dir and the line, by the launcher: before, rank 0 raised a raw ValueError traceback
    once training had started."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('garbage{\n{"step": 2, "loss": 1.0}\n')
    run = train_command(monkeypatch, capfd, run_dir, *FAST, "train.steps=2", nproc=2)
    message = _refused_once(run, "run.dir")
    assert (
        "metrics.jsonl, line 1, is not a metrics record" in message and "worker" not in run.output
    )
