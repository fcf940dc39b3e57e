"""float8 training through torchao: Linear layers become Float8Linear, picked by a filter.

Converted before tensor parallel, because torchao's float8 TP styles (Float8ColwiseParallel, …)
shard Float8Linear modules; FSDP then all-gathers the weights in float8 when the recipe allows
(tensorwise). The output head stays in high precision (the loss is sensitive to it), and layers
whose dims are not multiples of 16 (what float8 matmuls need) are skipped and logged.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn as nn

log = logging.getLogger("composer3d")


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in ("output", "lm_head"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(
    model: nn.Module, recipe: str, device: torch.device, fsdp_float8_all_gather: bool
) -> list[str]:
    """Swap eligible Linear layers for torchao's Float8Linear; returns the converted names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    # No float8 matmul kernels on the CPU: torchao emulates them (same rounding, high-precision
    # matmul).
    config = dataclasses.replace(
        config,
        emulate=device.type == "cpu",
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather and recipe == "tensorwise",
    )
    linears = {fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    converted = sorted(fqn for fqn in linears if float8_eligible(model.get_submodule(fqn), fqn))
    skipped = sorted(linears - set(converted))
    convert_to_float8_training(model, config=config, module_filter_fn=float8_eligible)
    log.info(
        "float8 (%s): %d linear layers converted; kept in high precision: %s",
        recipe,
        len(converted),
        ", ".join(skipped) or "none",
    )
    return converted
