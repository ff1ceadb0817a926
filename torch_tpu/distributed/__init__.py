"""torch.distributed on "tpu": the "tpu_dist" process group (docs/distributed.md).

`import torch_tpu` registers the backend under "tpu_dist" for device "tpu", so
`dist.init_process_group("tpu_dist")` (or with no backend, on a tpu process)
gives a process group whose collectives are XLA collective programs over a
mesh of every process's device. Registration is light: JAX and the process
group's module load when a group is created.
"""
from __future__ import annotations

import sys as _sys

import torch.distributed as _dist

from torch_tpu.distributed.spmd import SpmdMismatchError, spmd_safe
from torch_tpu.topology import set_tpu_launch_env, topology_aware_mesh  # noqa: F401  (TorchTPU's names, docs/compat.md)

BACKEND = "tpu_dist"


def _create(backend_opts, pg_options=None):
    from torch_tpu.distributed.process_group import create_process_group

    return create_process_group(backend_opts, pg_options)


def register() -> None:
    """Register "tpu_dist" with torch.distributed (idempotent)."""
    if not _dist.is_available():
        return
    if BACKEND.upper() in getattr(_dist.Backend, "_plugins", {}):
        return
    _dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["tpu"])


def __getattr__(name):
    if name in ("ProcessGroupTPU", "Work", "CollectiveTimeoutError", "fallback_stats", "stats"):
        from torch_tpu.distributed import process_group

        return getattr(process_group, name)
    raise AttributeError(name)


register()


def _expose_on_device_module() -> None:
    """torch.tpu.spmd_safe and torch.tpu.distributed, as the modelled API names them."""
    from torch_tpu import device as _device

    _device.spmd_safe = spmd_safe
    _device.distributed = _sys.modules[__name__]


_expose_on_device_module()
