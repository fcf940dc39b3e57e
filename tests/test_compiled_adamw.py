"""optim.implementation=compiled: AdamW's update of every parameter as one torch.compile graph,
checked against torch's own AdamW, on its own and in training runs on sharded (FSDP × TP), sliced
(ZeRO-1) and resumed state."""

import pytest
import torch
import torch.nn as nn
from harness import FAST, train_in_one_group
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from composer3d.optim import compiled_adamw
from composer3d.optim.build import numbered_block, numbered_blocks, with_configured_kernels
from composer3d.optim.compiled_adamw import MAX_GRAPHS, CompiledAdamW
from composer3d.training.grad import divides_in_step

CPU = torch.device("cpu")
SHAPES = [(48, 16), (16, 16), (16,), (40, 16), (16,)]


def _params(seed=0, device=CPU):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=generator).to(device)) for s in SHAPES]


def _groups(params):  # as build_optimizer makes them: decay on matrices only
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)


def _graphs() -> int:
    return len(_debug_get_cache_entry_list(compiled_adamw._update.__code__))


NEEDS_ACCELERATOR = pytest.mark.accelerator


@pytest.mark.parametrize("on_accelerator", [False, pytest.param(True, marks=NEEDS_ACCELERATOR)])
def test_compiled_adamw_steps_as_torch_adamw_in_one_graph_reading_the_clip_without_storing_it(
    on_accelerator,
):
    torch._dynamo.reset()
    device = torch.accelerator.current_accelerator() if on_accelerator else CPU
    compiled_params, reference_params = _params(device=device), _params(device=device)
    compiled = CompiledAdamW(_groups(compiled_params), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    reference = torch.optim.AdamW(
        _groups(reference_params), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False, fused=False
    )  # torch's loop over parameters: the plain update
    schedules = [_schedule(compiled), _schedule(reference)]
    assert divides_in_step(compiled), "the clip is handed to the step"
    generator = torch.Generator().manual_seed(1)
    for step in range(5):  # the first step compiles: its tracing runs the ops on fake tensors
        grads = [torch.randn(s, generator=generator).to(device) for s in SHAPES]
        # the clip's factor, a different one each step
        divisor = torch.tensor(1.0 + step, device=device)
        for c, r, g in zip(compiled_params, reference_params, grads):
            c.grad, r.grad = g.clone(), g / divisor
        compiled.grad_scale = divisor
        # the host's calls
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled.step()
        reference.step()
        for schedule in schedules:
            schedule.step()  # a new learning rate each step: a graph input, not a constant
        ops = {event.key for event in prof.key_averages()}
        assert "Torch-Compiled Region" in " ".join(ops), sorted(ops)
        assert (
            step == 0
            or not {"aten::_fused_adamw_", "aten::_foreach_addcdiv_", "aten::_foreach_lerp_"} & ops
        ), sorted(ops)
        for c, g in zip(compiled_params, grads):
            assert torch.equal(c.grad, g), "the divided gradient is not stored back"
        for c, r in zip(compiled_params, reference_params):
            torch.testing.assert_close(c, r, rtol=1e-6, atol=1e-7)
    assert _graphs() == 1, "one graph for both groups and every learning rate"
    for c, r in zip(compiled_params, reference_params):
        state, expected = compiled.state[c], reference.state[r]
        assert set(state) == set(expected) and state["step"].device == c.device
        assert float(state["step"]) == float(expected["step"]) == 5
        torch.testing.assert_close(
            state["exp_avg_sq"], expected["exp_avg_sq"], rtol=1e-6, atol=1e-9
        )


def test_compiled_adamw_continues_torch_adamw_state_and_the_other_way():
    """A checkpoint's state moves between implementations, each keeping its own kernels and step
    counts' place."""
    generator = torch.Generator().manual_seed(2)
    steps = [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(4)]

    def run(first, second):
        params = _params()
        optimizer = first(_groups(params))
        for i, grads in enumerate(steps):
            if i == 2:  # a checkpoint: the state dict into a new optimizer of the other kind
                saved = optimizer.state_dict()
                optimizer = second(_groups(params))
                optimizer.load_state_dict(with_configured_kernels(optimizer, saved))
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
        return params, optimizer

    def loop(groups):
        return torch.optim.AdamW(groups, lr=1e-2, foreach=False, fused=False)

    def compiled(groups):
        return CompiledAdamW(groups, lr=1e-2)

    straight, _ = run(loop, loop)
    for first, second in ((loop, compiled), (compiled, loop)):
        params, optimizer = run(first, second)
        for p, q in zip(params, straight):
            # an ulp of O(1) weights; steps are ~1e-2
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        assert all(float(s["step"]) == 4 for s in optimizer.state.values())
        assert all(not g["capturable"] for g in optimizer.param_groups) == (second is loop)


def test_a_step_with_gradients_on_other_parameters_runs_eagerly_with_the_same_update(caplog):
    """The graph is made for the parameters that had gradients at the first step; a graph per set
    would reach torch.compile's recompile limit, a hard error under fullgraph (a dozen sets here).
    Other sets step eagerly."""
    torch._dynamo.reset()
    compiled_params, reference_params = _params(), _params()
    compiled = CompiledAdamW(_groups(compiled_params), lr=1e-2)
    reference = torch.optim.AdamW(_groups(reference_params), lr=1e-2, foreach=False, fused=False)
    generator = torch.Generator().manual_seed(3)
    fused_steps = 0
    for step in range(12):
        for i, (c, r) in enumerate(zip(compiled_params, reference_params)):
            grad = (
                torch.randn(c.shape, generator=generator)
                if step % 3 == 0 or (i + step) % 2
                else None
            )
            c.grad, r.grad = grad, None if grad is None else grad / 2
        compiled.grad_scale = torch.tensor(2.0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled.step()
        fused_steps += "aten::_fused_adamw_" in {event.key for event in prof.key_averages()}
        reference.step()
    for c, r in zip(compiled_params, reference_params):
        torch.testing.assert_close(c, r, rtol=1e-6, atol=1e-6)
        assert float(compiled.state[c]["step"]) == float(reference.state[r]["step"]) < 12
    assert fused_steps == 8, (
        "the steps with another set of gradients (not every third) run the fused kernel"
    )
    assert _graphs() == 1 and "run torch's fused AdamW eagerly" in caplog.text


def _blocks(shapes_per_block, blocks, seed=4):
    """A model's parameters as named_parameters gives them: an embedding, numbered blocks, a final
    norm."""
    generator = torch.Generator().manual_seed(seed)
    names = [
        "embedding.weight",
        *(f"layers.{b}.p{i}" for b in range(blocks) for i in range(len(shapes_per_block))),
        "norm.weight",
    ]
    shapes = [(24, 16), *shapes_per_block * blocks, (16,)]
    return names, [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


@pytest.mark.parametrize(
    "layer_shapes, blocks, graphs",
    [
        (
            [(16, 16), (40, 16), (16,)],
            6,
            2,
        ),  # every block one shape: one graph for them, one for the rest
        ([(16, 16), (16,)], 1, 2),
    ],
)
def test_compiled_adamw_steps_each_block_as_one_call_of_a_graph_per_shape(
    layer_shapes, blocks, graphs
):
    """Chunked by optim.numbered_block, blocks of one shape share a graph: the compile costs a
    block's tensors, not the model's. The same update as torch's AdamW."""
    torch._dynamo.reset()
    names, compiled_params = _blocks(layer_shapes, blocks)
    _, reference_params = _blocks(layer_shapes, blocks)
    compiled = CompiledAdamW(
        _groups(compiled_params), block_of=numbered_blocks(names, compiled_params), lr=1e-2
    )
    reference = torch.optim.AdamW(_groups(reference_params), lr=1e-2, foreach=False, fused=False)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        for c, r in zip(compiled_params, reference_params):
            c.grad = torch.randn(c.shape, generator=generator)
            r.grad = c.grad / 3
        compiled.grad_scale = torch.tensor(3.0)
        compiled.step()
        reference.step()
    assert len(compiled._chunks) == blocks + 1 and _graphs() == graphs
    for c, r in zip(compiled_params, reference_params):
        torch.testing.assert_close(c, r, rtol=1e-6, atol=1e-6)


def test_blocks_of_more_shapes_than_graphs_allowed_step_in_one_graph():
    torch._dynamo.reset()
    names, params = _blocks([(16, 16)], 1)
    shapes = [(8 + i, 16) for i in range(MAX_GRAPHS + 1)]  # a block of a shape of its own each
    params += [nn.Parameter(torch.randn(s)) for s in shapes]
    names += [f"layers.{1 + i}.w" for i in range(len(shapes))]
    compiled = CompiledAdamW(_groups(params), block_of=numbered_blocks(names, params), lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    compiled.step()
    assert len(compiled._chunks) == 1 and _graphs() == 1


def test_numbered_block_names_the_block_a_parameter_is_in():
    assert numbered_block("layers.3.attention.wq.weight") == "layers.3"
    assert numbered_block("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert numbered_block("_orig_mod.layers.0.moe.experts.w1") == "_orig_mod.layers.0"
    assert (
        numbered_block("tok_embeddings.weight") is None and numbered_block("output.weight") is None
    )


def test_compiled_adamw_refuses_what_it_does_not_step():
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="amsgrad"):
        CompiledAdamW(params, lr=1e-2, amsgrad=True).step()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four ranks, one group of jobs: FSDP × TP (+ SP) with torch's loop AdamW and with the compiled
    one (each checkpointing at step 3), each resumed from the other's checkpoint, and ZeRO-1's
    slices stepped compiled."""
    root = tmp_path_factory.mktemp("compiled_adamw")
    fsdp_tp = [
        *FAST,
        "train.steps=6",
        "checkpoint.interval=3",
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ]
    resume = "checkpoint.resume={}/checkpoints/step-00000003"
    jobs = {
        "loop": [*fsdp_tp, "optim.implementation=for_loop"],
        "compiled": [*fsdp_tp, "optim.implementation=compiled"],
        "loop_then_compiled": [
            *fsdp_tp,
            "optim.implementation=compiled",
            resume.format(root / "loop"),
        ],
        "compiled_then_fused": [
            *fsdp_tp,
            "optim.implementation=fused",
            resume.format(root / "compiled"),
        ],
        "zero1": [
            *FAST,
            "train.steps=6",
            "parallel.dp_shard=4",
            "parallel.zero_stage=1",
            "optim.implementation=compiled",
            "checkpoint.enabled=false",
        ],
    }
    results = train_in_one_group(
        [(root / name, args) for name, args in jobs.items()], nproc=4, probe_effects=True
    )
    return dict(zip(jobs, results))


def test_compiled_adamw_trains_sharded_and_sliced_parameters_as_torch_adamw(runs):
    reference = runs["loop"].losses
    assert len(reference) == 6
    for name in ("compiled", "zero1"):
        assert [e["optimizer_class"] for e in runs[name].effects] == ["CompiledAdamW"] * 4
        # tiny's 2 blocks a call each, the embedding, final norm and head one more
        assert [e["optimizer_chunks"] for e in runs[name].effects] == [3] * 4, name
        diffs = [abs(a - b) for a, b in zip(reference, runs[name].losses)]
        assert len(diffs) == 6 and max(diffs) < 1e-4, (name, diffs)
    assert [e["optimizer_class"] for e in runs["loop"].effects] == ["AdamW"] * 4

    # each rank keeps the moments of its own shards, as torch's AdamW keeps them
    def held(run, rank):
        return sorted(
            (s["param"], s["key"], s["numel"], s["dtype"])
            for s in run.effects[rank]["optimizer_state"]
        )

    for rank in range(4):
        assert held(runs["compiled"], rank) == held(runs["loop"], rank)
    moments = sum(s["numel"] for s in runs["compiled"].effects[0]["optimizer_state"])
    # both moments of every parameter would be 2 × num_params; a 2 × 2 layout keeps about a quarter
    # of them
    assert 0 < moments <= runs["compiled"].run_info["num_params"], (
        "a shard of the moments, not all of them"
    )


def test_compiled_adamw_resumes_the_other_implementations_checkpoint(runs):
    for resumed, source in (("loop_then_compiled", "loop"), ("compiled_then_fused", "compiled")):
        assert [m["step"] for m in runs[resumed].metrics] == [4, 5, 6]
        diffs = [abs(a - b) for a, b in zip(runs[source].losses[3:], runs[resumed].losses)]
        assert max(diffs) < 1e-5, (resumed, diffs)
