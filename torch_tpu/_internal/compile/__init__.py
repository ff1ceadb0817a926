"""TorchTPU's torch_tpu._internal.compile: `_backend.TpuBackend` (docs/compat.md)."""
