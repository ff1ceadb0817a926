"""TorchTPU's `torch_tpu._internal.utils.hardware`: the device's name and count (over torch.tpu)."""
from __future__ import annotations

__all__ = ["get_tpu_device_name", "get_tpu_device_count"]


def get_tpu_device_name(device=None) -> str:
    """The device's name: its XLA device kind ("TPU v5 lite", ...; "XLA:CPU (cpu)" on the CPU platform)."""
    from torch_tpu import device as device_module

    return device_module.get_device_name(device)


def get_tpu_device_count() -> int:
    """The number of devices behind "tpu" (TorchTPU counts TPU chips on the PCI bus; here any XLA platform's)."""
    from torch_tpu import device as device_module

    return device_module.device_count()
