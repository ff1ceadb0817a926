"""PyTorch-style errors for failures that XLA reports in its own words."""
from __future__ import annotations

import torch


def translate_runtime_error(err: Exception, where: str) -> Exception:
    """An XLA runtime error as the exception a CUDA user would see."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return torch.OutOfMemoryError(f"TPU out of memory while running {where}: {text.splitlines()[0]}")
    return RuntimeError(f"tpu runtime error in {where}: {text}")
