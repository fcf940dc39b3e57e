"""bf16 compute through FSDP's mixed-precision policy: trains, and stays near the fp32 curve."""

from harness import FAST, train


def test_bf16_params_fp32_reduce_tracks_fp32(tmp_path):
    fp32 = train(tmp_path / "fp32", *FAST, "train.steps=5", "parallel.dp_shard=2", nproc=2)
    bf16 = train(tmp_path / "bf16", *FAST, "train.steps=5", "parallel.dp_shard=2", "precision.param_dtype=bfloat16",
                 nproc=2)
    diffs = [abs(a - b) for a, b in zip(fp32.losses, bf16.losses)]
    assert len(diffs) == 5 and max(diffs) < 0.05, diffs
    assert diffs != [0.0] * 5, "bf16 compute should not be bit-identical to fp32: was the policy applied?"
