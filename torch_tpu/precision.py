"""The float32 matmul precision policy on "tpu"."""
from __future__ import annotations

import torch


def matmul_precision() -> str:
    """The precision float32 matmuls run at now: "highest", "high" or "medium"."""
    return torch.get_float32_matmul_precision()
