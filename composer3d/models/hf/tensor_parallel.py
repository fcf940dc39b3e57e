"""Tensor parallel for Hugging Face models: the model's own ``base_model_tp_plan``, translated in
``TP_STYLES`` (the one table), or for an architecture laid out like Llama that ships none, the Llama
family's plan (checked against the layer's modules here and numerically before launch:
``forward_check``); the embedding, final norm, head (vocab-parallel, loss on the shards) and
sequence-parallel norms are ours.

A mixture-of-experts block (the module holding transformers' experts: router, routed and shared
experts) is not split: every tp rank holds it whole and runs it on the whole sequence, so its
attention is tensor parallel and its experts are not (transformers' ``packed_colwise`` expert plans
would split the fused gate/up weights into slices that no DTensor placement describes, and the
checkpoint would no longer reshard across layouts). Its compute is repeated on the tp ranks; expert
parallel is what divides it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from composer3d.errors import ConfigError
from composer3d.models.hf.config import load_hf_config
from composer3d.models.hf.experts import hf_expert_modules

if TYPE_CHECKING:
    from composer3d.models.hf.model import HFCausalLM


def tp_split_sizes(m) -> list[tuple[str, int]]:
    sizes = [
        ("num_attention_heads", m.n_heads),
        ("num_key_value_heads", m.n_kv_heads or m.n_heads),
        ("vocab_size", m.vocab_size),
    ]
    if m.ffn_hidden_dim:
        sizes.append(("intermediate_size", m.ffn_hidden_dim))
    return sizes


# The plan of transformers' Llama family, for architectures laid out like it that ship no
# base_model_tp_plan: attention heads and MLP columns split over the tp ranks, each block's output
# projection reduced.
LLAMA_LAYOUT_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def _derived_plan_problem(layers) -> str | None:
    """Why the Llama-layout plan would not split ``layers`` correctly, else None. It splits only the
    planned projections, so every other parameter must sit where the residual stream is whole: in
    the layer's own norms. A per-head norm, gate or mixing weight inside attention or the MLP would
    see a slice of the heads and need a style of its own (a plan in transformers)."""
    planned = {pattern[len(_LAYER_PREFIX) :] for pattern in LLAMA_LAYOUT_TP_PLAN}
    for layer in layers:
        missing = planned - dict(layer.named_modules()).keys()
        if missing:
            return f"its decoder layers lack {sorted(missing)}"
        for name, _ in layer.named_parameters():
            module_name = name.rpartition(".")[0]
            module = layer.get_submodule(module_name)
            if module_name in planned:
                if not isinstance(module, nn.Linear):
                    return f"its {module_name} is a {type(module).__name__}, not a Linear"
            elif "." in module_name or "norm" not in type(module).__name__.lower():
                return f"its decoder layers hold {name}, which that plan would not split"
    return None


def plan_is_derived(config) -> bool:
    return not getattr(config, "base_model_tp_plan", None)


def tp_plan(config) -> dict[str, str]:
    """transformers' plan of the model, else the Llama-layout plan (tensor_parallel_problem says
    whether it fits)."""
    return getattr(config, "base_model_tp_plan", None) or LLAMA_LAYOUT_TP_PLAN


def tensor_parallel_problem(m) -> str | None:
    """Why this model cannot run tensor parallel (no plan, or a style the table does not know), else
    None."""
    config = load_hf_config(m.path)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        problem = _derived_plan_problem(_meta_layers(config))
        if problem:
            return (
                f"{config.model_type} defines no tensor-parallel plan (base_model_tp_plan) in "
                "transformers, and composer3d's plan for the Llama layout does not fit it: "
                f"{problem}. It trains with FSDP and pipeline parallel"
            )
        return None
    moe_layer = _moe_layer(_meta_layers(config))
    for pattern, style in plan.items():
        if style not in TP_STYLES and not _inside_moe_block(pattern, moe_layer):
            return (
                f"module {pattern} of {config.model_type} asks for tensor-parallel style "
                f"{style!r}, which composer3d does not translate (known: {sorted(TP_STYLES)})"
            )
    return None


def _meta_layers(config) -> nn.ModuleList:
    """The decoder layers of ``config``'s model on the meta device (their module structure, no
    memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).model.layers


def _moe_layer(layers) -> nn.Module | None:
    """A decoder layer of ``layers`` that holds transformers' experts, if any."""
    return next((layer for layer in layers if hf_expert_modules(layer)), None)


def _inside_moe_block(pattern: str, moe_layer: nn.Module | None) -> bool:
    """Whether plan entry ``pattern`` names a module or parameter inside a mixture-of-experts block
    (which is left whole under tp). Dense layers' entries (``mlp.gate_proj`` of Qwen3-MoE's dense
    layers) name nothing there."""
    if moe_layer is None or not pattern.startswith(_LAYER_PREFIX):
        return False
    path = pattern[len(_LAYER_PREFIX) :]
    block = next(name for name, child in moe_layer.named_children() if hf_expert_modules(child))
    if not path.startswith(block + "."):
        return False
    owner, _, leaf = path.rpartition(".")
    try:
        return hasattr(moe_layer.get_submodule(owner), leaf)
    except AttributeError:
        return False


class _GatherSequence(ParallelStyle):
    """Sequence parallel: all-gather a sequence-sharded residual stream on entry to attention or the
    MLP; a mixture-of-experts block, which runs whole on every rank (its output not reduce-scattered
    by a row-parallel projection), hands back this rank's slice of the sequence (whose gradient the
    backward all-gathers).

    transformers passes the hidden states positionally to some modules and as ``hidden_states=`` to
    others, so this takes either (``PrepareModuleInput`` needs to know which)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, DTensor):
                t = DTensor.from_local(t, device_mesh, [Shard(1)], run_check=False)
            return t.redistribute(placements=[Replicate()]).to_local()

        def hook(_module, args, kwargs):
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            else:
                args = (gather(args[0]), *args[1:])
            return args, kwargs

        def own_slice(_module, _args, output):
            # some blocks also return router logits
            whole = output[0] if isinstance(output, tuple) else output
            mine = (
                DTensor.from_local(whole, device_mesh, [Replicate()], run_check=False)
                .redistribute(placements=[Shard(1)])
                .to_local()
            )
            return (mine, *output[1:]) if isinstance(output, tuple) else mine

        module.register_forward_pre_hook(hook, with_kwargs=True)
        if hf_expert_modules(module):
            module.register_forward_hook(own_slice)
        return module


# Head counts and widths some attention modules keep as attributes and reshape by (StableLM's
# ``view(b, s, self.num_heads, d)``); transformers' newer modules reshape by -1. Under the derived
# plan each rank holds 1/tp of the heads, so these become the local counts (torchtitan does the same
# for its own attention).
_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "hidden_size")


def use_local_head_counts(attention: nn.Module, ranks: int) -> None:
    for name in _HEAD_ATTRIBUTES:
        value = getattr(attention, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, name, value // ranks)


class _LocalHeads(ParallelStyle):
    """The derived plan's attention block: local head counts (``use_local_head_counts``), then
    ``then`` (the sequence-parallel gather) if any."""

    def __init__(self, then: ParallelStyle | None = None):
        super().__init__()
        self.then = then

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        use_local_head_counts(module, device_mesh.size())
        return self.then._apply(module, device_mesh) if self.then is not None else module


def _styles(float8: bool):
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel
    return ColwiseParallel, RowwiseParallel


# transformers' style name → our DTensor style, given (residual layout, float8). Style names differ
# across transformers versions (colwise_rep / colwise_gather_output, …); all spellings land here.
TP_STYLES: dict[str, Callable[[Any, bool], ParallelStyle | None]] = {
    "colwise": lambda residual, f8: _styles(f8)[0](),
    "rowwise": lambda residual, f8: _styles(f8)[1](output_layouts=residual),
    # Fused projections (Phi-3's qkv_proj, gate_up_proj) are sliced by global sizes: full output on
    # every rank.
    "colwise_gather_output": lambda residual, f8: _styles(f8)[0](output_layouts=Replicate()),
    "colwise_rep": lambda residual, f8: _styles(f8)[0](output_layouts=Replicate()),
    "rowwise_split_input": lambda residual, f8: _styles(f8)[1](
        input_layouts=Replicate(), output_layouts=residual
    ),
    "rowwise_rep": lambda residual, f8: _styles(f8)[1](
        input_layouts=Replicate(), output_layouts=residual
    ),
    # Per-head norms (Qwen3's q_norm/k_norm) see only this rank's heads: replicated weights whose
    # gradients are summed over the tp group — what a replicated DTensor parameter fed a
    # head-sharded input does.
    "replicated_with_grad_allreduce": lambda residual, f8: SequenceParallel(
        sequence_dim=2, use_local_output=True
    ),
    "sequence_parallel": lambda residual, f8: SequenceParallel(use_local_output=True),
    "embedding_rowwise": lambda residual, f8: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=residual
    ),
    "replicate": lambda residual, f8: None,
    "local": lambda residual, f8: None,
}

_LAYER_PREFIX = "layers.*."


def tensor_parallel_plan(
    model: HFCausalLM, sequence_parallel: bool, float8: bool = False
) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(root plan, per-layer plan) from the model's ``base_model_tp_plan``.

    Ours on top of transformers' plan: a vocab-parallel embedding, a head whose logits stay
    vocab-sharded (the loss runs on the shards: ``composer3d.training.loss``), and with sequence
    parallel every norm on the residual stream (the decoder layer's own norm children and the final
    norm) on a slice of the sequence, with attention and MLP inputs all-gathered on entry (their
    row-parallel outputs are reduce-scattered back by the plan).
    """
    plan = tp_plan(model.config)
    residual = Shard(1) if sequence_parallel else Replicate()
    block: dict[str, ParallelStyle] = {}
    root: dict[str, ParallelStyle] = {}
    moe_layer = _moe_layer(model.layers.values())
    for pattern, name in plan.items():
        if _inside_moe_block(pattern, moe_layer):  # left whole: see the module docstring
            continue
        if name not in TP_STYLES:
            raise ConfigError(
                f"parallel.tp: module {pattern} asks for tensor-parallel style {name!r}, which "
                f"composer3d does not translate (known: {sorted(TP_STYLES)}). Use parallel.tp=1"
            )
        style = TP_STYLES[name](residual, float8)
        if style is None:
            continue
        if pattern.startswith(_LAYER_PREFIX):
            block[pattern[len(_LAYER_PREFIX) :]] = style
        elif pattern not in ("embed_tokens", "norm"):
            root[f"model.{pattern}"] = style
    root["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    root["lm_head"] = ColwiseParallel(
        input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
    )
    if sequence_parallel:
        root["model.norm"] = SequenceParallel(use_local_output=True)
        layer = next(iter(model.layers.values()))
        for child_name, child in layer.named_children():
            if "norm" in type(child).__name__.lower():
                block[child_name] = SequenceParallel(use_local_output=True)
            elif any(key.startswith(child_name + ".") for key in block) or hf_expert_modules(child):
                # attention, MLP: they hold the planned projections
                block[child_name] = _GatherSequence()
    if plan_is_derived(model.config):
        block["self_attn"] = _LocalHeads(then=block.get("self_attn"))
    return root, block
