"""Low-precision compute over fp32 parameters where FSDP does not run (TP-only, PP-only, ZeRO-1 layouts; one device
with ``precision.cast=autocast``, compiled runs' default there).

FSDP's mixed-precision policy casts the gathered parameters; with no data-parallel dim there is nothing to gather,
so the roots' forwards run under ``torch.autocast`` instead: matmuls and attention in bf16/fp16, parameters,
gradients and optimizer state in fp32 (what torchtitan does on one device). Numerically close to FSDP's policy,
not identical: autocast keeps the residual stream, norms and softmax-like ops in fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from composer3d.dtypes import DTYPES


def autocast_forward(roots: list[nn.Module], param_dtype: str, device: torch.device) -> None:
    """Run each root module's forward under autocast to ``param_dtype`` (nothing to do for float32)."""
    if param_dtype == "float32":
        return
    for root in roots:
        root.forward = torch.autocast(device.type, dtype=DTYPES[param_dtype])(root.forward)


def auto_cast(accelerator: bool, world_size: int, compiled: bool, zero_stage: int, peft_method: str) -> str:
    """What ``precision.cast=auto`` resolves to, by measurement (H200, 1B Llama, seq 8192, selective AC; README).
    Eager on one accelerator, params: 43.0k tok/s against autocast's 41.5k (one cast of each weight a step instead
    of one per forward and recomputation, and none of each activation). Compiled, autocast: 48.3k against 47.5k and
    2.1 GiB less (Inductor fuses the activations' casts, and FSDP's one-rank copies, which params ran through then,
    cost more than the weights' casts left; ``cast_once`` since leaves them out, not yet measured on a GPU). Where params cannot run, autocast: ZeRO-1 (no FSDP) and QLoRA (refused with params by the checks).
    The trainer (``training.precision``) and the planner resolve it here alike."""
    eager_alone = world_size == 1 and not compiled
    return "params" if accelerator and eager_alone and zero_stage != 1 and peft_method != "qlora" else "autocast"

