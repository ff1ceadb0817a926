"""PyTorch-style errors for failures that XLA reports in its own words."""
from __future__ import annotations

import torch


def translate_runtime_error(err: Exception, where: str) -> Exception:
    """An XLA runtime error as the exception a CUDA user would see."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return torch.OutOfMemoryError(f"TPU out of memory while running {where}: {text.splitlines()[0]}")
    return RuntimeError(f"tpu runtime error in {where}: {text}")


def alert_not_deterministic(caller: str) -> None:
    """ATen's alertNotDeterministic (no Python binding): raise, or warn under warn_only, in deterministic mode."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    if torch.is_deterministic_algorithms_warn_only_enabled():
        import warnings

        warnings.warn(f"{caller} does not have a deterministic implementation, but you set "
                      "'torch.use_deterministic_algorithms(True, warn_only=True)'. You can file an issue at "
                      "https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic "
                      "support for this operation.", stacklevel=2)
        return
    raise RuntimeError(f"{caller} does not have a deterministic implementation, but you set "
                       "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
                       "operation, or you can use the 'warn_only=True' option, if that's acceptable for your "
                       "application. You can also file an issue at https://github.com/pytorch/pytorch/issues to "
                       "help us prioritize adding deterministic support for this operation.")
