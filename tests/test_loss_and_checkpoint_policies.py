"""train.loss_impl=fused: the head's matmul and the cross-entropy per chunk of rows
(training/fused_loss.py); and the activation-checkpointing policies' curves (memory.ac_policy),
trained in the same process group.

Against plain ``F.cross_entropy`` over the full logits (fp32, CPU): the same loss and gradients,
ignored targets included, eagerly and compiled; no tensor of the full logits' size ever allocated;
and a multi-process run whose curve is the chunked loss's. Each checkpointing policy's run gives the
curve of none."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from harness import FAST, train_in_one_group
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import composer3d.training.fused_loss as fused_loss
import composer3d.training.loss as loss_module
from composer3d.data import IGNORE_INDEX
from composer3d.training.fused_loss import fused_linear_cross_entropy_sum

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ROWS, DIM, VOCAB = 2 * 37, 16, 100  # 37: the last chunk is a short one


class _LargestLogits(TorchDispatchMode):
    """The most elements of any op's output over the vocabulary or part of it (logits, their
    gradient; not the head's weight nor the tensors over ``dim``)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [
            t.numel()
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and DIM not in t.shape
        ]
        self.largest = max([self.largest, *sizes])
        return out


@pytest.fixture
def fresh_dynamo():
    """The chunk kernels compiled afresh, and left so: their graphs here (several shapes and dtypes)
    would count towards dynamo's recompile limit in the tests of the chunked loss that share
    them."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_graphs() -> int:
    """Graphs torch.compile made for the chunk kernels the fused loss shares with the chunked
    one."""
    return sum(
        len(_debug_get_cache_entry_list(kernel.__code__))
        for kernel in (loss_module._chunk_logsumexp, loss_module._chunk_grad_in_place)
    )


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, ROWS // 2, DIM, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2, ROWS // 2), generator=generator)
    targets[0, :5] = IGNORE_INDEX  # a prompt (or a document boundary): no loss
    targets[1, -1] = IGNORE_INDEX
    return x, weight, targets


def _reference(x, weight, targets, scale):
    loss = F.cross_entropy(
        (x @ weight.t()).flatten(0, 1),
        targets.flatten(),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )
    (loss * scale).backward()
    return loss.detach(), x.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_loss_and_gradients_equal_cross_entropy_over_full_logits(
    monkeypatch, fresh_dynamo, compiled
):
    # chunks of 10 rows: 8 of them, the last of 4
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 10 * VOCAB)
    x, weight, targets = _inputs()
    # a grad_output ≠ 1: the global-token normalization
    expected = _reference(x, weight, targets, 0.25)
    x.grad = weight.grad = None
    # The memory meter watches the eager kernels only: dynamo never compiles a function first called
    # under a dispatch mode (nor afterwards), and the compiled kernels are the chunked loss's too
    with contextlib.nullcontext() if compiled else _LargestLogits() as meter:
        loss = fused_linear_cross_entropy_sum(x, weight, targets, compiled=compiled)
        (loss * 0.25).backward()
    assert loss.dtype == torch.float32
    assert (_compiled_graphs() > 0) or not compiled
    assert abs(loss.item() - expected[0].item()) <= 1e-5 * abs(expected[0].item())
    torch.testing.assert_close(x.grad, expected[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad, expected[2], rtol=0, atol=1e-5)
    # The effect: one chunk's logits at a time (10 × vocab; ∂W's chunks: all 74 rows × 13 entries),
    # never the full logits (74 × vocab) nor their gradient
    assert compiled or meter.largest == 10 * VOCAB, meter.largest


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_loss_in_bf16_rounds_where_the_full_logits_do(monkeypatch, fresh_dynamo, compiled):
    """Under bf16 autocast (as the trainer runs the head) against ``F.cross_entropy`` over the same
    bf16 logits in fp32: the gradients are rounded where autograd rounds them, the logits' gradient
    scaled by the step's output gradient (``grad_scale``, 1 / tokens) before it is rounded to bf16
    and ∂W one matmul over all rows. Before, the scale was applied in bf16 after the matmuls and ∂W
    summed over the row chunks in bf16: gradients off by up to 0.7% of their largest element, 40-66%
    of them different."""
    rows, dim, vocab = 256, 64, 4096
    # 8 chunks of rows; ∂W in 32 of the vocabulary
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 32 * vocab)
    generator = torch.Generator().manual_seed(0)
    x0, w0 = (
        torch.randn(rows, dim, generator=generator),
        torch.randn(vocab, dim, generator=generator) * dim**-0.5,
    )
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[:5] = IGNORE_INDEX
    scale = 1 / 251  # the trained targets: not a power of two, so its rounding shows

    def run(loss_fn):
        x, weight = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            loss = loss_fn(x, weight)
        (loss * scale).backward()
        return loss.detach(), x.grad, weight.grad

    expected = run(lambda x, w: F.cross_entropy(F.linear(x, w).float(), targets, reduction="sum"))
    loss, *grads = run(
        lambda x, w: fused_linear_cross_entropy_sum(x, w, targets, compiled, grad_scale=scale)
    )
    # fp32's summation order only
    assert abs(loss.item() - expected[0].item()) <= 1e-6 * expected[0].item()
    assert (_compiled_graphs() > 0) or not compiled
    for grad, reference in zip(grads, expected[1:]):
        assert grad.dtype == reference.dtype == torch.float32
        bf16_step = 2**-8 * reference.abs().max().item()  # one bf16 step at the largest element
        torch.testing.assert_close(grad, reference, rtol=0, atol=bf16_step)
        # the rare element fp32's last bit rounds over
        assert (grad != reference).float().mean().item() < 0.01


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def test_fused_loss_without_gradients_is_the_same_loss():
    """Evaluation (no_grad): the loss alone, the same as with gradients, from the head's matmul
    alone (inputs that require gradients do not make it compute them)."""
    x, weight, targets = _inputs()
    with torch.no_grad(), _Matmuls() as matmuls:
        loss = fused_linear_cross_entropy_sum(x, weight, targets)
    with torch.no_grad():
        expected = F.cross_entropy(
            (x @ weight.t()).flatten(0, 1), targets.flatten(), reduction="sum"
        )
    assert not loss.requires_grad
    assert matmuls.count == 1, matmuls.count  # one chunk's logits; with gradients four matmuls
    assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()


# ----------------------------------------------------- in training, beside activation checkpointing
SELECTIVE = ["memory.activation_checkpointing=selective", "memory.ac_every=0"]
JOBS = {
    "reference": [],
    "fused": ["train.loss_impl=fused"],
    "all_matmuls": [*SELECTIVE, "memory.ac_policy=all_matmuls"],
    "alternate_matmuls": [*SELECTIVE, "memory.ac_policy=alternate_matmuls"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two ranks (FSDP over dp_shard=2), 4 steps each, in one process group: the chunked loss
    without checkpointing (the reference), the fused loss, and each op-level checkpointing policy
    (full checkpointing's curve: test_memory_precision)."""
    root = tmp_path_factory.mktemp("loss_and_policies")
    args = [*FAST, "train.steps=4", "parallel.dp_shard=2", "checkpoint.enabled=false"]
    results = train_in_one_group(
        [(root / name, [*args, *extra]) for name, extra in JOBS.items()], nproc=2
    )
    return dict(zip(JOBS, results))


def _assert_same_curve(run, reference, tolerance):
    assert len(run.metrics) == len(reference.metrics) == 4
    for a, b in zip(reference.metrics, run.metrics):
        assert (
            abs(a["loss"] - b["loss"]) < tolerance
            and abs(a["grad_norm"] - b["grad_norm"]) < tolerance
        ), (a, b)


def test_fused_run_follows_the_chunked_curve(runs):
    """The fused loss inside the model's forward, from FSDP's gathered head weight: the chunked
    loss's curve and gradient norms."""
    _assert_same_curve(runs["fused"], runs["reference"], 1e-5)
    assert "loss_impl: fused" in (runs["fused"].run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("policy", ["all_matmuls", "alternate_matmuls"])
def test_checkpointing_policies_keep_the_curve(runs, policy):
    """Only what is kept for backward differs (test_memory_precision measures it), not the
    numbers."""
    _assert_same_curve(runs[policy], runs["reference"], 1e-6)
