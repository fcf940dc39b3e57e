"""Parameter-efficient fine-tuning: LoRA adapters around the targeted linears of each block,
everything else frozen.

Applied after the pipeline split and before tensor parallel, which then splits each adapter with its
base linear (``tensor_parallel_styles``); FSDP wraps frozen and trainable parameters in the same
units and reduce-scatters only the gradients that exist, those of the adapters (and of
``peft.modules_to_save``). QLoRA stores the base weights in NF4 (``models.lora.NF4Linear``).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from composer3d.config.peft_schema import PeftConfig
from composer3d.config.schema import ModelConfig
from composer3d.errors import ConfigError
from composer3d.models.interface import has_submodule
from composer3d.peft.lora import BASE, NF4_BLOCK, LoRALinear, quantize_base


def matches(name: str, patterns) -> bool:
    """PEFT's rule: a module is targeted when its name is a pattern or ends with ``.pattern``; shell
    wildcards (``*``, ``?``) match across dots."""
    return any(name == p or name.endswith(f".{p}") or fnmatchcase(name, p) for p in patterns)


def targets(model: nn.Module, patterns) -> list[tuple[str, nn.Linear]]:
    """The linears of the model's blocks that ``patterns`` name."""
    return [
        (f"layers.{i}.{name}", module)
        for i, block in model.layers.items()
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear) and matches(f"layers.{i}.{name}", patterns)
    ]


def adapter_params(model: nn.Module, cfg: PeftConfig) -> int:
    """The parameters of the adapters ``apply_peft`` adds, counted on the whole model before any
    split."""
    return sum(
        cfg.rank * (linear.in_features + linear.out_features)
        for _, linear in targets(model, cfg.target_modules)
    )


def saved_params(model: nn.Module, cfg: PeftConfig) -> dict[int, nn.Parameter]:
    """The parameters of the modules ``peft.modules_to_save`` trains whole, by id (a shared one
    once)."""
    return {
        id(p): p
        for name, module in model.named_modules()
        if name and matches(name, cfg.modules_to_save)
        for p in module.parameters()
    }


def trainable_params(model: nn.Module, cfg: PeftConfig) -> int:
    """What ``apply_peft`` leaves trainable, counted on the whole model before any split
    (run.json)."""
    return adapter_params(model, cfg) + sum(p.numel() for p in saved_params(model, cfg).values())


def check_targets(model: nn.Module, cfg: PeftConfig, shards: int) -> None:
    """Before launch, on the whole model (on meta): the patterns name some linear; QLoRA's NF4
    blocks fit each weight and each rank's rows of it (``shards``: the ranks FSDP splits it
    over)."""
    found = targets(model, cfg.target_modules)
    if not found:
        raise ConfigError(
            f"peft.target_modules: {list(cfg.target_modules)} names no linear layer of the model's "
            "blocks. Name their projections, e.g. [wq, wk, wv, wo, w1, w2, w3] (native) or "
            "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj] (Hugging Face)"
        )
    if cfg.method != "qlora":
        return
    for name, linear in found:
        numel, rows = linear.weight.numel(), linear.out_features
        if numel % (NF4_BLOCK * shards) or rows % shards:
            raise ConfigError(
                f"peft.method: qlora quantizes {name} ({rows}x{linear.in_features}) in NF4 blocks "
                f"of {NF4_BLOCK} values, whole blocks on each of the {shards} ranks FSDP shards it "
                f"over; {numel} values do not split so. Leave {name.rpartition('.')[2]} out of "
                "peft.target_modules, or use peft=lora"
            )


def check_init_from(model: nn.Module, cfg: PeftConfig, model_cfg: ModelConfig) -> None:
    """Before launch, on the whole model (on meta): ``peft.init_from``'s tensors are exactly the
    adapters of the targeted linears and the modules_to_save, in their shapes, under PEFT's keys."""
    from composer3d.peft.adapter_files import adapter_shapes, hf_weight_names, peft_key

    names = hf_weight_names(model_cfg)
    expected = {}
    for name, linear in targets(model, cfg.target_modules):
        expected[peft_key(f"{name}.lora_A.weight", names)] = (cfg.rank, linear.in_features)
        expected[peft_key(f"{name}.lora_B.weight", names)] = (linear.out_features, cfg.rank)
    for name, module in model.named_modules():
        if name and matches(name, cfg.modules_to_save):
            expected.update(
                {
                    peft_key(f"{name}.{p}", names): tuple(t.shape)
                    for p, t in module.named_parameters()
                }
            )
    found = adapter_shapes(cfg.init_from)
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing or extra or wrong:
        problems = [
            f"{what} {keys[:3]}"
            for what, keys in (
                ("lacks", missing),
                ("has, beyond this run's targets", extra),
                ("has in other shapes", wrong),
            )
            if keys
        ]
        raise ConfigError(
            f"peft.init_from: {cfg.init_from} {'; '.join(problems)}. Set peft.target_modules and "
            "peft.modules_to_save as the adapter was trained (its adapter_config.json names them)"
        )


def apply_peft(model: nn.Module, cfg: PeftConfig) -> None:
    """Wrap the targeted linears in ``LoRALinear`` (QLoRA: with NF4 base weights) and freeze every
    parameter but the adapters and the modules ``cfg.modules_to_save`` names. ``cfg``: the run's
    ``peft`` section."""
    found = targets(model, cfg.target_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    for name, linear in found:
        parent, _, child = name.rpartition(".")
        layer = LoRALinear(linear, cfg.rank, cfg.alpha, cfg.dropout)
        if cfg.method == "qlora":
            quantize_base(layer)
        model.get_submodule(parent).register_module(child, layer)
    for name, module in model.named_modules():
        if name and matches(name, cfg.modules_to_save):
            module.requires_grad_(True)


def tensor_parallel_styles(
    block: nn.Module, plan: dict[str, ParallelStyle]
) -> dict[str, ParallelStyle]:
    """The block's TP plan with each wrapped linear's style moved onto its base, and its adapter
    split to match.

    Column-parallel base: ``lora_A`` is replicated (it sees the same whole input on every tp rank)
    and ``lora_B`` is column-parallel like the base, its output sharded the same way. Row-parallel
    base: ``lora_A`` is row-parallel like the base (its small rank-wide output reduced to the base's
    output layout) and ``lora_B`` is replicated — under sequence parallel as a ``SequenceParallel``
    module on the rank's share of the sequence, so its gradient sums over the tp ranks. Replicated
    adapters are replicated DTensors, never plain tensors: the optimizer steps each parameter group
    as one kind.
    """
    styles = {}
    for name, style in plan.items():
        module = (
            block.get_submodule(name) if "*" not in name and has_submodule(block, name) else None
        )
        if not isinstance(module, LoRALinear):
            styles[name] = style
            continue
        styles[f"{name}.{BASE}"] = style
        if isinstance(style, ColwiseParallel) and style.input_layouts[0] == Replicate():
            styles[f"{name}.lora_A"] = Replicated()
            styles[f"{name}.lora_B"] = ColwiseParallel(
                output_layouts=style.output_layouts[0], use_local_output=style.use_local_output
            )
        elif isinstance(style, RowwiseParallel):
            output = style.output_layouts[0]
            styles[f"{name}.lora_A"] = RowwiseParallel(
                input_layouts=style.input_layouts[0],
                output_layouts=output,
                use_local_output=style.use_local_output,
            )
            # a replicated DTensor either way, like the parameters beside it in the optimizer's
            # groups
            styles[f"{name}.lora_B"] = (
                SequenceParallel(sequence_dim=output.dim, use_local_output=style.use_local_output)
                if isinstance(output, Shard)
                else Replicated()
            )
        else:
            raise ConfigError(
                f"peft.target_modules: {name} is split by {type(style).__name__} from "
                f"{style.input_layouts}, which LoRA does not follow (column-parallel linears of a "
                "whole input, row-parallel ones). Leave it out of peft.target_modules"
            )
    return styles


class Replicated(ParallelStyle):
    """Parameters whole on every tp rank (replicated DTensors, as FSDP then shards them over the
    data-parallel dims alongside TP's), fed the whole input as a replicated DTensor: the input may
    arrive as one (sequence parallel's gathered block input) or as a plain tensor. The output is the
    local tensor, as the base's is."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            input_fn=_replicated_input,
            output_fn=lambda module, output, mesh: output.to_local(),
        )


def _replicated_input(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
    x = inputs[0]
    if isinstance(x, DTensor):
        return (x.redistribute(device_mesh, [Replicate()]), *inputs[1:])
    return (DTensor.from_local(x, device_mesh, [Replicate()], run_check=False), *inputs[1:])
