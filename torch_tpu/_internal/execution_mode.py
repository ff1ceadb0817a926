"""TorchTPU's `torch_tpu._internal.execution_mode`: the eager mode as a module property (over modes.py).

`torch_tpu._internal.execution_mode.eager_mode` reads and sets the same mode as
`torch.tpu.eager_mode` and `torch_tpu.set_execution_mode`; `enable_cpu_fallback`
is our TORCH_TPU_FALLBACK (True: run unlowered ops on CPU with a warning, False: raise).
"""
from __future__ import annotations

import sys
import types

from torch_tpu.config import config
from torch_tpu.tpu_api import EagerMode, _set_eager_mode_global, get_eager_mode, set_eager_mode

__all__ = ["EagerMode", "set_eager_mode", "eager_mode", "enable_cpu_fallback"]


class _ExecutionModeModule(types.ModuleType):
    @property
    def eager_mode(self) -> EagerMode:
        return get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        _set_eager_mode_global(mode)

    @property
    def enable_cpu_fallback(self) -> bool:
        return config.fallback != "error"

    @enable_cpu_fallback.setter
    def enable_cpu_fallback(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"enable_cpu_fallback must be a bool, got {type(value).__name__}")
        if value != (config.fallback != "error"):
            config.fallback = "warn" if value else "error"

    def __dir__(self):
        return sorted(set(super().__dir__()) | {"eager_mode", "enable_cpu_fallback"})


sys.modules[__name__].__class__ = _ExecutionModeModule
