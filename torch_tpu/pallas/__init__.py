"""Custom kernels: bind JAX/Pallas functions as PyTorch operators on tpu tensors (`torch.tpu.pallas`).

`jax_op` (pallas/op.py) is the binding; pallas/interpret.py decides where Pallas
kernels run in interpret mode; `get_pallas_mesh` gives the device mesh a
distributed kernel's `shard_map` runs over. See docs/kernels.md.
"""
from __future__ import annotations

from torch_tpu.pallas.op import JaxOp, jax_op

__all__ = ["JaxOp", "jax_op", "get_pallas_mesh"]


def get_pallas_mesh(axis_names, mesh_shape=None, process_group=None):
    """A `jax.sharding.Mesh` over the devices a kernel launched from this process runs on.

    One process drives one tpu device here (its current device); with several processes
    (`jax.distributed`, the tpu_dist process group) the mesh spans every process's device,
    ordered by process index, so mesh position i is rank i. `mesh_shape` defaults to all
    devices along the first axis.
    """
    import jax
    import numpy as np

    from torch_tpu.runtime import platform

    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if process_group is not None or jax.process_count() > 1:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    else:
        import torch

        devices = [platform.get().devices[torch.tpu.current_device()]]
    if mesh_shape is None:
        mesh_shape = (len(devices),) + (1,) * (len(axis_names) - 1)
    mesh_shape = tuple(mesh_shape)
    if len(mesh_shape) != len(axis_names):
        raise ValueError(f"get_pallas_mesh: {len(axis_names)} axis names but a mesh shape of rank {len(mesh_shape)}")
    if int(np.prod(mesh_shape)) != len(devices):
        raise ValueError(f"get_pallas_mesh: a mesh of shape {mesh_shape} needs {int(np.prod(mesh_shape))} devices, "
                         f"{len(devices)} take part")
    return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(mesh_shape), axis_names)
