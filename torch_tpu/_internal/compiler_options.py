"""TorchTPU's `torch.tpu.compiler`: XLA compile options for a block (over torch_tpu.xla_options).

`with torch.tpu.compiler.custom_compiler_options({"xla_optimization_level": "O1"}):`
compiles every program of the block (Strict ops, DeferAndFuse graphs) with the
options; nested blocks merge, the inner value wins; the options are part of
each program's key, so a program compiled with others is never reused.
"""
from __future__ import annotations

from torch_tpu import xla_options
from torch_tpu.tpu_api import forbid_in_compile

__all__ = ["custom_compiler_options"]


def custom_compiler_options(options: dict):
    """Context manager: XLA `options` (names as XLA's, O0-O3 for the two levels) for the block."""
    forbid_in_compile("torch.tpu.compiler.custom_compiler_options")
    return xla_options.use(options)
