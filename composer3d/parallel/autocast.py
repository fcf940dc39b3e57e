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
