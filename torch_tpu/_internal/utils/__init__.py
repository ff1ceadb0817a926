"""TorchTPU's torch_tpu._internal.utils: `hardware.get_tpu_device_name` (docs/compat.md)."""
