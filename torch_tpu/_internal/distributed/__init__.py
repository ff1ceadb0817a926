"""TorchTPU's `torch_tpu._internal.distributed`: the names of `torch.tpu.distributed` (torch_tpu.distributed)."""
from __future__ import annotations

from torch_tpu.distributed import set_tpu_launch_env, spmd_safe, topology_aware_mesh

__all__ = ["topology_aware_mesh", "set_tpu_launch_env", "spmd_safe"]
