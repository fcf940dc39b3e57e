"""Activation offload (memory.activation_offload): what autograd saves per block goes through a host
copy and comes back equal, the next block's prefetched; the training curve is the one-process curve
without offload, with activation checkpointing off and full, on one process, FSDP 2 and FSDP 2 × TP
2 (SP), and across a resume; a Hugging Face model's layers, checkpointed and offloaded, keep its
curve. Its composition with compile and op-level selective checkpointing (and that switch's effect
in a run) is in test_memory_precision.py."""

import contextlib

import pytest
import torch
from harness import FAST, train_in_one_group

from composer3d.memory.activation_checkpointing import apply_activation_checkpointing
from composer3d.memory.activation_offload import MIN_OFFLOAD_BYTES, apply_activation_offload
from composer3d.models.llama import TransformerBlock, rope_tables

STEPS = ["train.steps=10"]
OFFLOAD = ["memory.activation_offload=true"]
AC = {"ac_none": [], "ac_full": ["memory.activation_checkpointing=full"]}
LAYOUTS = {
    1: [],
    2: ["parallel.dp_shard=2"],
    4: ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
}
TOLERANCE = {1: 1e-5, 2: 1e-4, 4: 1e-4}
DIM, SEQ, BATCH = 64, 64, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per world size one process group: offload with checkpointing off and full; on 1 process the
    reference without offload too; on 2 a resume from the checkpoint offload wrote at step 5, with
    offload on."""
    from hf_models import make_model

    root = tmp_path_factory.mktemp("offload")
    hf = [
        *FAST,
        *STEPS,
        "model=hf",
        f"model.path={make_model(root / 'hf_llama', 'llama')}",
        "train.seq_len=32",
        "data.max_tokens=30000",
        "checkpoint.enabled=false",
    ]
    out = {}
    for world, layout in LAYOUTS.items():
        jobs = {
            f"{name}_{world}": [*FAST, *STEPS, *layout, *OFFLOAD, *ac] for name, ac in AC.items()
        }
        if world == 1:  # and a Hugging Face model's decoder layers, checkpointed and offloaded
            jobs = {
                "reference": [*FAST, *STEPS],
                **jobs,
                "hf_reference": hf,
                "hf_ac_full": [*hf, *OFFLOAD, *AC["ac_full"]],
            }
        if world == 2:
            jobs["ac_none_2"] += ["checkpoint.interval=5", "checkpoint.keep_last=0"]
            step5 = root / "ac_none_2" / "checkpoints" / "step-00000005"
            jobs["resumed_2"] = [*FAST, *STEPS, *layout, *OFFLOAD, f"checkpoint.resume={step5}"]
        out.update(
            zip(
                jobs,
                train_in_one_group(
                    [(root / name, args) for name, args in jobs.items()], nproc=world
                ),
            )
        )
    return out


@pytest.mark.parametrize("world", list(LAYOUTS))
@pytest.mark.parametrize("ac", list(AC))
def test_offload_keeps_the_one_process_curve(runs, world, ac):
    reference, run = runs["reference"].losses, runs[f"{ac}_{world}"].losses
    assert len(reference) == len(run) == 10
    diffs = [abs(a - b) for a, b in zip(reference, run)]
    assert max(diffs) < TOLERANCE[world], diffs


def test_offload_of_hugging_face_layers_keeps_their_curve(runs):
    reference, run = runs["hf_reference"].losses, runs["hf_ac_full"].losses
    assert len(reference) == len(run) == 10
    assert max(abs(a - b) for a, b in zip(reference, run)) < 1e-5, (reference, run)


def test_offload_resumes_on_the_straight_curve(runs):
    resumed = runs["resumed_2"].metrics
    assert [m["step"] for m in resumed] == list(range(6, 11))
    diffs = [abs(a - m["loss"]) for a, m in zip(runs["reference"].losses[5:], resumed)]
    assert max(diffs) < 1e-4, diffs


def _blocks(n: int) -> torch.nn.Module:
    """``n`` native blocks, and the RoPE tables as the model's buffers (as the native model holds
    them)."""
    torch.manual_seed(1)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict(
        {str(i): TransformerBlock(DIM, 4, 4, 4 * DIM, 1e-5) for i in range(n)}
    )
    cos, sin = rope_tables(DIM // 4, SEQ, 10000.0)
    model.register_buffer("cos", cos)
    model.register_buffer("sin", sin)
    return model


def _step(model, x, hooks=()):
    """Forward (the blocks under saved-tensor ``hooks``, if given) and backward through every block;
    the input's gradient and the parameters' gradients."""
    x = x.detach().requires_grad_()
    h = x
    with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext():
        for block in model.layers.values():
            h = block(h, model.cos, model.sin, None)
    h.square().sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def _saved_activation_bytes(model, x) -> int:
    """What autograd saves in the blocks' forward, each tensor once, without parameters (and views
    of them), buffers and tensors under the threshold: the bytes offload must move."""
    total, seen = 0, set()

    def pack(t):
        storages = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}
        nbytes = t.numel() * t.element_size()
        if (
            id(t) not in seen
            and t.untyped_storage().data_ptr() not in storages
            and nbytes >= MIN_OFFLOAD_BYTES
        ):
            seen.add(id(t))
            nonlocal total
            total += nbytes
        return t

    _step(model, x, (pack, lambda t: t))
    return total


def test_offload_moves_saved_activations_and_brings_them_back_equal():
    """Eager, no checkpointing: every saved activation went through a host copy (bytes as counted
    independently), came back as a new tensor equal to the original, the gradients are bit-equal to
    no offload, and when a block's backward begins that block and the one before it (prefetched) are
    on the device, not those before."""
    x = torch.randn(BATCH, SEQ, DIM)
    plain = _blocks(3)
    expected = _saved_activation_bytes(plain, x)
    for p in plain.parameters():
        p.grad = None
    reference = _step(plain, x)

    model = _blocks(3)
    offload = apply_activation_offload(model, torch.device("cpu"))
    originals, mismatches, brought_back_when_a_block_begins = {}, [], {}
    pack, unpack = offload._pack, offload._unpack

    def recording_pack(group, t):
        packed = pack(group, t)
        if packed is not t:
            originals[id(packed)] = (t, t.detach().clone(), packed.host)
        return packed

    def recording_unpack(packed):
        out = unpack(packed)
        if id(packed) in originals:
            original, value, host = originals[id(packed)]
            brought_back_when_a_block_begins.setdefault(
                id(packed.group), offload.counters.bytes_brought_back
            )
            if (
                out.untyped_storage().data_ptr()
                in (original.untyped_storage().data_ptr(), host.data_ptr())
                or not torch.equal(out, value)
                or out.stride() != original.stride()
            ):
                mismatches.append(tuple(out.shape))
        return out

    offload._pack, offload._unpack = recording_pack, recording_unpack
    grads = _step(model, x)

    counters = offload.counters
    assert expected > 0 and counters.bytes_offloaded == expected, (counters, expected)
    # parameters stayed
    assert counters.tensors_offloaded == len(originals) > 0 and counters.tensors_kept > 0
    assert not mismatches, mismatches
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))
    # the third block's backward begins with the third and second blocks (the same bytes each) on
    # the device, not the first; the second's begins with the first prefetched too
    third, second, first = brought_back_when_a_block_begins.values()
    assert third == 2 * expected // 3 and second >= expected, (third, second, expected)
    assert counters.bytes_brought_back >= counters.bytes_offloaded


def test_offload_under_full_checkpointing_moves_the_block_inputs():
    """Full checkpointing keeps each block's input: offload moves exactly those (not the recomputed
    activations, not the RoPE buffers every block is given), and the gradients equal checkpointing
    without offload."""
    x = torch.randn(BATCH, SEQ, DIM)
    plain = _blocks(2)
    apply_activation_checkpointing(plain, "full", 0)
    reference = _step(plain, x)
    model = _blocks(2)
    apply_activation_checkpointing(model, "full", 0)
    offload = apply_activation_offload(model, torch.device("cpu"))
    grads = _step(model, x)
    assert offload.counters.tensors_offloaded == 2
    assert (
        offload.counters.bytes_offloaded == offload.counters.bytes_brought_back == 2 * x.numel() * 4
    )
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))


def test_offload_applies_inside_compiled_blocks_without_graph_breaks():
    """Compiled blocks under op-level selective checkpointing: the hooks, entered around the
    compiled call, see what the compiled graph saves (the policy's matmul and attention outputs:
    more than the inputs full checkpointing keeps), with no graph break, no recompilation at the
    next step, and the same gradients."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(BATCH, SEQ, DIM)

    def compiled(offloaded):
        model = _blocks(2)
        apply_activation_checkpointing(model, "selective", 0)
        for block in model.layers.values():
            block.compile(backend="aot_eager")
        offload = apply_activation_offload(model, torch.device("cpu")) if offloaded else None
        _step(model, x)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for p in model.parameters():
            p.grad = None
        grads = _step(model, x)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompilation
        return grads, offload

    reference, _ = compiled(False)
    grads, offload = compiled(True)
    assert not torch._dynamo.utils.counters["graph_break"], torch._dynamo.utils.counters[
        "graph_break"
    ]
    inputs_per_step = 2 * x.numel() * 4
    assert offload.counters.bytes_offloaded > 2 * 2 * inputs_per_step, offload.counters  # two steps
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(reference, grads))


@pytest.mark.accelerator
def test_offload_lowers_device_memory_held_between_forward_and_backward():
    """On an accelerator: the device memory the forward leaves for backward falls with offload
    (pinned host buffers, side-stream copies), and the gradients stay equal."""
    device = torch.accelerator.current_accelerator()
    x = torch.randn(4, 1024, 512, device=device)

    def held(offloaded):
        torch.manual_seed(1)
        blocks = [TransformerBlock(512, 8, 8, 2048, 1e-5).to(device) for _ in range(8)]
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        cos, sin = rope_tables(64, 1024, 10000.0)
        model.register_buffer("cos", cos.to(device))
        model.register_buffer("sin", sin.to(device))
        offload = apply_activation_offload(model, device) if offloaded else None
        inp = x.detach().requires_grad_()
        torch.accelerator.synchronize()
        before = torch.accelerator.memory_allocated(device)
        h = inp
        for block in model.layers.values():
            h = block(h, model.cos, model.sin, None)
        loss = h.square().sum()
        torch.accelerator.synchronize()
        kept = torch.accelerator.memory_allocated(device) - before
        # the last block's host copies are in pinned (page-locked) memory, as async copies need
        if offloaded:
            last = [ref() for ref in offload._last().saved]
            assert last and all(
                s.host.is_pinned() and s.host.device.type == "cpu" for s in last if s is not None
            )
        loss.backward()
        return kept, [inp.grad, *(p.grad for p in model.parameters())], offload

    plain, reference, _ = held(False)
    _, rerun, _ = held(False)
    offloaded, grads, offload = held(True)
    assert offload.counters.bytes_offloaded > 0.8 * plain, (offload.counters, plain)
    assert offloaded < 0.4 * plain, (offloaded, plain)

    # An accelerator's attention backward is not bit-reproducible (atomic adds): the gradients must
    # differ from the plain run's by no more than a second plain run does (a wrong tensor restored
    # would be off by its whole size).
    def relative(a, b):
        return (a - b).abs().max().item() / b.abs().max().item()

    noise = max(relative(again, ref) for again, ref in zip(rerun, reference))
    assert noise < 1e-3, noise
    assert all(relative(got, ref) <= 4 * noise + 1e-6 for got, ref in zip(grads, reference)), noise
