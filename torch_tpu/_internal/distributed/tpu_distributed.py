"""TorchTPU's `torch_tpu._internal.distributed.tpu_distributed.global_device_id()`."""
from __future__ import annotations

__all__ = ["global_device_id"]


def global_device_id() -> int:
    """The global id of this process's current tpu device: its XLA device id (unique across the job)."""
    from torch_tpu import device as device_module

    return device_module._runtime().devices[device_module.current_device()].id
