"""``train.deterministic=true`` on an accelerator (issue 31, item 6): two runs of one config give
bit-identical metrics, and a run stopped at a checkpoint and resumed gives the straight run's bit
for bit — eager with the fused SDPA kernels (causal), eager and compiled with packed-document masks
(flex attention: the heads are 32 wide). The CPU side of the same promise is held by
tests/test_checkpoint.py (every CPU test runs deterministic)."""

import pytest
from harness import train

pytestmark = pytest.mark.accelerator

BASE = [
    "model=tiny",
    "model.dim=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "data.max_tokens=400000",
    "train.seq_len=256",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "logging.progress_bar=false",
    "train.deterministic=true",
    "launch.device=auto",
    "checkpoint.interval=5",
]
MODES = {
    "eager_causal": ["data.document_masking=false"],
    "eager_documents": ["data.document_masking=true"],
    "compiled_documents": ["data.document_masking=true", "compile.enabled=true"],
}


def _trace(run) -> list[tuple]:
    """What must repeat bit for bit: each step's loss and gradient norm."""
    return [(m["step"], m["loss"], m.get("grad_norm")) for m in run.metrics]


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_reruns_and_resume_are_bit_exact(tmp_path, mode):
    overrides = [*BASE, *MODES[mode]]
    straight = train(tmp_path / "straight", *overrides, "train.steps=10")
    again = train(tmp_path / "again", *overrides, "train.steps=10")
    train(tmp_path / "resumed", *overrides, "train.steps=5")
    resumed = train(tmp_path / "resumed", *overrides, "train.steps=10")
    assert len(_trace(straight)) == 10
    assert _trace(again) == _trace(straight), "a rerun of the same config must be bit-identical"
    assert _trace(resumed) == _trace(straight), (
        "stopped at step 5 and resumed must equal the straight run"
    )
