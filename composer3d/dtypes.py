"""The floating-point dtypes a config may name (precision.*, checkpoint.export_dtype, the
converter's --dtype)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
