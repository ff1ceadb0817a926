"""TorchTPU's `torch_tpu._internal.sync`: run what is pending, optionally wait for it.

`synchronize(tensors=None, wait=True)`: DeferAndFuse's recorded ops run now
(a materialization point, as `torch.tpu.synchronize`); with `wait`, return
only when the device has computed `tensors` (every tpu buffer if None).
"""
from __future__ import annotations

import torch

__all__ = ["synchronize"]


def synchronize(tensors=None, wait: bool = True) -> None:
    from torch_tpu.runtime import storage

    if tensors is not None:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"synchronize expects tensors, got {type(t).__name__}")
    storage.materialize("synchronize")
    if not wait:
        return
    if tensors is None:
        import torch_tpu.device as device_module

        for index in range(device_module.device_count()):
            device_module.synchronize(index)
        return
    for t in tensors:
        if t.device.type != "tpu":
            continue
        entry = storage.buffers.get(storage.storage_address(t))
        if entry is not None and hasattr(entry[0], "block_until_ready"):
            entry[0].block_until_ready()
