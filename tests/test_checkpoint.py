"""Checkpoints: exact resume, resume under other layouts, crash safety, corruption fallback,
pruning, async, safety."""

import io
import json
import pickle
import shutil

import pytest
import torch
from harness import FAST, run_command, train, train_job

from composer3d.checkpoint import META_FILE, SafeFileSystemReader, committed_checkpoints

KILL = "COMPOSER3D_TEST_KILL_DURING_SAVE"


def _command(run_dir, *overrides):
    """composer3d-train's module and arguments for a one-process run in ``run_dir``."""
    return "composer3d.commands.train", f"run.dir={run_dir}", *FAST, *overrides


def _steps(run):
    return [m["step"] for m in run.metrics]


def test_crash_during_save_keeps_previous_and_resume_is_bit_identical(tmp_path):
    args = [*FAST, "train.steps=8", "checkpoint.interval=4", "parallel.dp_shard=2"]
    straight = train_job(tmp_path / "straight", *args, nproc=2)

    crashed = train(tmp_path / "crash", *args, nproc=2, check=False, faults={KILL: "8:1"})
    assert crashed.returncode != 0, "rank 1 was killed during the step-8 save"
    ckpts = tmp_path / "crash" / "checkpoints"
    assert [p.name for p in committed_checkpoints(ckpts)] == ["step-00000004"]
    assert (ckpts / "step-00000008.partial").exists(), (
        "the interrupted save stays partial, never committed"
    )

    resumed = train(tmp_path / "crash", *args, nproc=2)  # the same command again: resume=auto
    assert "resumed from" in resumed.output and "step-00000004" in resumed.output
    assert _steps(resumed) == list(range(1, 9)), (
        "metrics.jsonl continues from the checkpoint, no duplicates"
    )
    assert resumed.losses == straight.losses, (
        "4 steps + resume must be bit-identical to 8 straight steps"
    )
    assert [m["grad_norm"] for m in resumed.metrics] == [m["grad_norm"] for m in straight.metrics]
    assert [p.name for p in committed_checkpoints(ckpts)] == ["step-00000008", "step-00000004"]
    assert not (ckpts / "step-00000008.partial").exists()


@pytest.fixture(scope="module")
def fsdp4_run(tmp_path_factory):
    return train_job(
        tmp_path_factory.mktemp("fsdp4"),
        *FAST,
        "train.steps=12",
        "checkpoint.interval=6",
        "parallel.dp_shard=4",
        nproc=4,
    )


@pytest.mark.parametrize(
    "layout, nproc",
    [
        (["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4),
        (["parallel.dp_shard=1"], 1),
        (["parallel.dp_shard=4", "parallel.zero_stage=1"], 4),
        (["parallel.dp_replicate=2", "parallel.dp_shard=1"], 2),
        (["parallel.pp=2", "parallel.dp_shard=2"], 4),
    ],
)
def test_resume_under_another_layout_follows_the_same_curve(tmp_path, fsdp4_run, layout, nproc):
    checkpoint = fsdp4_run.run_dir / "checkpoints" / "step-00000006"
    run = train_job(
        tmp_path, *FAST, "train.steps=12", f"checkpoint.resume={checkpoint}", *layout, nproc=nproc
    )
    assert _steps(run) == list(range(7, 13))
    diffs = [abs(a - b) for a, b in zip(fsdp4_run.losses[6:], run.losses)]
    assert max(diffs) < 1e-4, diffs


def test_zero1_checkpoint_resumes_under_tensor_parallel(tmp_path):
    """ZeRO-1 saves its sharded Adam state in the parameter-shaped form every other layout reads."""
    base = train_job(
        tmp_path / "zero1",
        *FAST,
        "train.steps=8",
        "checkpoint.interval=4",
        "parallel.dp_shard=2",
        "parallel.zero_stage=1",
        nproc=2,
    )
    run = train_job(
        tmp_path / "tp",
        *FAST,
        "train.steps=8",
        "parallel.tp=2",
        "parallel.dp_shard=1",
        f"checkpoint.resume={base.run_dir / 'checkpoints' / 'step-00000004'}",
        nproc=2,
    )
    assert max(abs(a - b) for a, b in zip(base.losses[4:], run.losses)) < 1e-4


def test_corrupt_checkpoint_falls_back_with_a_clear_error(tmp_path):
    args = [*FAST, "train.steps=6", "checkpoint.interval=3"]
    first_losses = train_job(tmp_path, *args).losses
    newest = tmp_path / "checkpoints" / "step-00000006"
    data_file = next(newest.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated, as by a full disk

    explicit = train(tmp_path / "other", *args, f"checkpoint.resume={newest}", check=False)
    assert (
        explicit.returncode == 2 and f"checkpoint.resume: {newest} is incomplete" in explicit.output
    )
    assert f"{data_file.name} has 100 bytes" in explicit.output, (
        "refused before training, naming the short file"
    )
    assert not (tmp_path / "other" / "metrics.jsonl").exists()

    # resume=auto: the newest fails verification, is never chosen, and never counts as one keep_last
    # keeps. The run resumes from step 3 and saves step 5: keep_last=1 keeps it, not the corrupt
    # (newer by step) step 6.
    again = train_job(tmp_path, *args, "train.steps=5", "checkpoint.keep_last=1")
    assert f"checkpoint {newest} is incomplete: {data_file.name} has 100 bytes" in again.output
    assert "never resumed from nor counted by checkpoint.keep_last" in again.output
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000003'} at step 3" in again.output
    assert _steps(again) == [1, 2, 3, 4, 5], (
        "metrics.jsonl rewound to the checkpoint, then continued"
    )
    assert again.losses == first_losses[:5]
    assert [p.name for p in committed_checkpoints(tmp_path / "checkpoints")] == [
        "step-00000006",
        "step-00000005",
    ]
    # the same command again
    finished = train_job(tmp_path, *args, "train.steps=5", "checkpoint.keep_last=1")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000005'} at step 5" in finished.output
    assert "already finished" in finished.output


def test_keep_last_prunes_and_model_only_final(tmp_path):
    run = train_job(
        tmp_path,
        *FAST,
        "train.steps=8",
        "checkpoint.interval=2",
        "checkpoint.keep_last=2",
        "checkpoint.model_only_final=true",
    )
    kept = committed_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in kept] == ["step-00000008", "step-00000006"]
    final = json.loads((kept[0] / META_FILE).read_text())
    assert final["model_only"] is True and "data" not in final
    assert not (kept[0] / "rng").exists() or not any((kept[0] / "rng").iterdir())
    # Only weights, in the export dtype (bf16: half the bytes of the fp32 weights in a full
    # checkpoint's model part).
    metadata = SafeFileSystemReader(str(kept[0])).read_metadata()
    assert all(k.startswith("model.") for k in metadata.state_dict_metadata)
    assert {str(m.properties.dtype) for m in metadata.state_dict_metadata.values()} == {
        "torch.bfloat16"
    }
    full = SafeFileSystemReader(str(kept[1])).read_metadata()
    assert any(k.startswith("optim.") for k in full.state_dict_metadata)
    assert len(run.metrics) == 8


def test_async_save_gives_sync_losses_and_resumable_checkpoints(tmp_path):
    args = [
        *FAST,
        "train.steps=6",
        "checkpoint.interval=2",
        "checkpoint.keep_last=0",
        "parallel.dp_shard=2",
    ]
    sync = train_job(tmp_path / "sync", *args, nproc=2)
    # Three saves through one stager, which closes itself after each as torch 2.11-2.12's does: each
    # save still works.
    asynchronous = train(
        tmp_path / "async",
        *args,
        "checkpoint.async_mode=async",
        nproc=2,
        faults={"COMPOSER3D_TEST_STAGER_CLOSES_AFTER_STAGE": "1"},
    )
    assert asynchronous.losses == sync.losses
    assert [p.name for p in committed_checkpoints(tmp_path / "async" / "checkpoints")] == [
        "step-00000006",
        "step-00000004",
        "step-00000002",
    ]
    resumed = train_job(
        tmp_path / "resumed",
        *args,
        f"checkpoint.resume={tmp_path / 'async' / 'checkpoints' / 'step-00000004'}",
        nproc=2,
    )
    assert resumed.losses == sync.losses[4:], (
        "the async checkpoint holds the state of step 4, not a later one"
    )


def test_metadata_with_foreign_pickle_is_refused(tmp_path):
    source = tmp_path / "real"
    train_job(source, *FAST, "train.steps=1")
    checkpoint = next(iter(committed_checkpoints(source / "checkpoints")))
    evil = tmp_path / "evil"
    shutil.copytree(checkpoint, evil)

    class Exploit:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (evil / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata"):
        SafeFileSystemReader(str(evil)).read_metadata()
    assert not (tmp_path / "pwned").exists()
    buffer = io.BytesIO()
    # the real one loads fine
    pickle.dump(SafeFileSystemReader(str(checkpoint)).read_metadata(), buffer)


@pytest.mark.parametrize(
    "override, key",
    [
        ("checkpoint.resume=/nonexistent/step-00000001", "checkpoint.resume"),
        pytest.param(
            "checkpoint.async_mode=async_pinned",
            "checkpoint.async_mode",
            marks=pytest.mark.skipif(
                torch.accelerator.is_available(), reason="pinned memory needs no accelerator"
            ),
        ),
        ("checkpoint.async_mode=later", "checkpoint.async_mode"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
    ],
)
def test_bad_checkpoint_settings_fail_fast_naming_the_key(
    monkeypatch, capfd, tmp_path, override, key
):
    code = run_command(monkeypatch, *_command(tmp_path, "train.steps=2", override))
    output = capfd.readouterr().err
    assert code == 2 and f"invalid configuration: {key}:" in output, output[-2000:]


def test_resuming_with_another_model_shape_is_refused(monkeypatch, capfd, tmp_path):
    train_job(tmp_path, *FAST, "train.steps=2")
    code = run_command(monkeypatch, *_command(tmp_path, "train.steps=4", "model.n_layers=3"))
    output = capfd.readouterr().err
    assert code == 2 and "invalid configuration: model: the checkpoint" in output, output[-2000:]
    assert "layers.2." in output, "names a parameter that differs"


def test_peft_base_reader_reads_every_tensor_whole_and_the_index_once(tmp_path, monkeypatch):
    """``peft.base_from``'s reader (peft/base.py): each tensor as saved, whatever its dtype, and the
    DCP index unpickled once for all of them (it lists every saved chunk of every tensor)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from composer3d.checkpoint import format as checkpoint_format
    from composer3d.errors import ConfigError
    from composer3d.peft.base import tensor_reader

    saved = {
        f"layers.{i}.w": torch.randn(3 + i, 5, dtype=torch.bfloat16 if i % 2 else torch.float32)
        for i in range(6)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    unpickled = []
    real_load = checkpoint_format._MetadataUnpickler.load
    monkeypatch.setattr(
        checkpoint_format._MetadataUnpickler,
        "load",
        lambda self: unpickled.append(1) or real_load(self),
    )
    read = tensor_reader(tmp_path)
    for name, tensor in saved.items():
        assert torch.equal(read(name, tuple(tensor.shape)), tensor.float())
    assert len(unpickled) == 1, (
        f"the index was unpickled {len(unpickled)} times for {len(saved)} tensors"
    )
    with pytest.raises(ConfigError, match=r"holds no tensor model.layers.0.w of shape \(4, 5\)"):
        read("layers.0.w", (4, 5))


def test_zero1_bf16_gather_saves_the_fp32_masters_and_resumes_bit_identically(tmp_path):
    """ZeRO-1 under bf16 all-gathers bf16 parameters: the replicas hold rounded values, the
    optimizer fp32 masters. A checkpoint (staged asynchronously) must hold the masters, and a resume
    must take them back: its losses then equal the straight run's bit for bit; rounded values saved
    or not taken back would drift from the fourth step."""
    import torch.distributed.checkpoint as dcp
    from harness import train_in_one_group

    bf16 = [*FAST, "train.steps=6", "parallel.dp_shard=2", "precision.param_dtype=bfloat16"]
    args = [*bf16, "parallel.zero_stage=1"]
    saved = tmp_path / "straight" / "checkpoints" / "step-00000003"
    straight, resumed, fsdp = train_in_one_group(
        [
            (
                tmp_path / "straight",
                [
                    *args,
                    "checkpoint.interval=3",
                    "checkpoint.keep_last=0",
                    "checkpoint.async_mode=async",
                ],
            ),
            (tmp_path / "resumed", [*args, f"checkpoint.resume={saved}"]),
            (
                tmp_path / "fsdp",
                [*bf16, f"checkpoint.resume={saved}"],
            ),  # FSDP (bf16 params) reads the same masters
        ],
        nproc=2,
    )
    assert _steps(resumed) == [4, 5, 6] and resumed.losses == straight.losses[3:]
    assert max(abs(a - b) for a, b in zip(fsdp.losses, straight.losses[3:])) < 1e-3, (
        fsdp.losses,
        straight.losses,
    )
    metadata = SafeFileSystemReader(str(saved)).read_metadata().state_dict_metadata
    weights = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.")
    }
    dcp.load(weights, storage_reader=SafeFileSystemReader(str(saved)), no_dist=True)
    assert weights and all(w.dtype == torch.float32 for w in weights.values())
    rounded = [k for k, w in weights.items() if torch.equal(w, w.bfloat16().float())]
    assert not rounded, f"saved as the bf16-rounded replicas, not the fp32 masters: {rounded}"
