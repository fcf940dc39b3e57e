"""Expert parallel for Hugging Face mixture-of-experts models: transformers' experts modules under
composer3d's all-to-all dispatch.

transformers 5 keeps a MoE layer's routed experts in one module with fused weights (``gate_up_proj``
[experts, 2·hidden, dim], ``down_proj`` [experts, dim, hidden]), whose forward takes the tokens and
the router's choices; the module's class lets the forward be swapped by name (``ExpertsInterface``,
chosen by ``config._experts_implementation``). Under expert parallel (``parallel.experts``) the
fused weights are sharded by expert over the ``ep`` ranks and the forward registered here sends each
token's rows to the rank holding its expert and back (``models.moe.mix_routed``, the native MoE's
dispatch), where the experts compute as transformers' do (``_apply_gate``: the activation of the
gate half times the up half).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from composer3d.config.schema import ModelConfig
from composer3d.models.hf.config import load_hf_config, tiny_replica
from composer3d.models.moe import grouped_mm_fits, local, mix_routed, per_expert, recorded_forward

# the name this forward is registered under in transformers
EXPERT_PARALLEL = "composer3d_expert_parallel"

# What transformers' ``use_experts_implementation`` sets on every experts module it decorates, in
# each version the pins allow (5.17 sets only these; 5.24 adds ``_is_expert_parallel``,
# ``is_concatenated``, ``has_post_expert_norm``).
_EXPERTS_MARKS = ("has_gate", "has_bias", "is_transposed")
# The weight layout composer3d's expert parallel runs. A key a version does not set has this value
# there: 5.17's experts are all concatenated [gate; up] and none has a post-expert norm.
_RUNNABLE_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}


def hf_expert_modules(model: nn.Module) -> list[nn.Module]:
    """transformers' routed-experts modules of ``model``: the classes its
    ``use_experts_implementation`` decorates."""
    return [m for m in model.modules() if all(hasattr(m, mark) for mark in _EXPERTS_MARKS)]


def inactive_params(model: nn.Module) -> int:
    """Parameters of transformers' routed experts a token does not go through: (experts − top_k) of
    every MoE layer's, whole. FLOPs per token count the active parameters only
    (``models.moe.inactive_expert_params``)."""
    inactive = 0
    for module in hf_expert_modules(model):
        experts = module.num_experts
        per_expert = sum(p.numel() for p in module.parameters(recurse=False)) // experts
        inactive += per_expert * (experts - module.config.num_experts_per_tok)
    return inactive


def expert_parallel_support(cfg: ModelConfig) -> tuple[int, str | None]:
    """(routed experts of each MoE layer, 0 for a dense model; why composer3d's expert parallel
    cannot run them, None where it can), from a tiny replica of ``model.path``'s config built on
    meta."""
    from transformers import AutoModelForCausalLM

    config = load_hf_config(cfg.path)
    with torch.device("meta"):
        return experts_support(
            AutoModelForCausalLM.from_config(tiny_replica(config)), config.model_type
        )


def experts_support(model: nn.Module, model_type: str) -> tuple[int, str | None]:
    """``expert_parallel_support`` of a built ``model``."""
    modules = hf_expert_modules(model)
    if not modules:
        return 0, None
    for module in modules:
        names = {name for name, _ in module.named_parameters(recurse=False)}
        odd = {
            key: getattr(module, key, value)
            for key, value in _RUNNABLE_LAYOUT.items()
            if getattr(module, key, value) != value
        }
        if odd or names != {"gate_up_proj", "down_proj"}:
            return module.gate_up_proj.shape[0] if "gate_up_proj" in names else 0, (
                f"{type(module).__name__} ({model_type}) has weights {sorted(names)} and "
                f"{odd or 'the usual layout'}; composer3d's expert parallel runs experts with a "
                "fused gate_up_proj and a down_proj, no biases, not transposed"
            )
    return modules[0].gate_up_proj.shape[0], None


def count_routing(modules: list[nn.Module], device: torch.device) -> None:
    """Give each of transformers' experts modules the per-expert count of the tokens routed to it in
    training forwards (``routed_tokens``, the native MoE layer's own; ``expert_load`` reduces and
    reads it), taken from the router's choices the module is called with, so it counts what
    transformers' router chose under any layout."""
    for module in modules:
        module.register_buffer(
            "routed_tokens", torch.zeros(module.num_experts, device=device), persistent=False
        )
        # off while a pipeline stage infers its shapes (``moe.routing_unrecorded``)
        module.recording = True
        module.register_forward_pre_hook(_count_routed_tokens, with_kwargs=True)


def _count_routed_tokens(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if not recorded_forward(module):
        return
    # (hidden_states, top_k_index, weights)
    chosen = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
    with torch.no_grad():
        module.routed_tokens.add_(
            per_expert(chosen.flatten(), module.num_experts).to(module.routed_tokens)
        )


def use_expert_parallel(model: nn.Module, ep_group) -> list[nn.Module]:
    """Route ``model``'s transformers experts through composer3d's all-to-all over ``ep_group``;
    their fused weights must already hold this rank's experts (dim 0). Returns the experts
    modules."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERT_PARALLEL, _expert_parallel_forward)
    modules = hf_expert_modules(model)
    for module in modules:
        module.ep_group = ep_group
        module.config._experts_implementation = EXPERT_PARALLEL
    return modules


def _expert_parallel_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward signature: tokens (tokens × dim), the router's choices and
    mixing weights."""
    return mix_routed(
        hidden_states,
        top_k_weights,
        top_k_index,
        self.gate_up_proj.shape[0],
        lambda rows, counts: _local_experts(self, rows, counts),
        self.ep_group,
    )


def _local_experts(module: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows sorted by this rank's experts, ``counts[e]`` for its expert e, through those experts:
    one grouped GEMM per projection where the device runs it (as the native experts), else a loop
    over the experts."""
    gate_up, down = (
        local(module.gate_up_proj).to(rows.dtype),
        local(module.down_proj).to(rows.dtype),
    )
    if grouped_mm_fits(rows, gate_up) and grouped_mm_fits(rows, down.transpose(-2, -1)):
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = module._apply_gate(F.grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets))
        return F.grouped_mm(hidden, down.transpose(-2, -1), offs=offsets)
    outputs = [
        F.linear(module._apply_gate(F.linear(x, gate_up[e])), down[e])
        for e, x in enumerate(torch.split(rows, counts.tolist()))
    ]  # a host sync: the loop needs the counts
    return torch.cat(outputs) if outputs else rows.new_zeros(0, down.shape[1])
