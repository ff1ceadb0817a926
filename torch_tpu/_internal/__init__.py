"""Modules named like the TorchTPU wheel's `torch_tpu._internal` (faces other projects import)."""
