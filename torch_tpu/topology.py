"""Where ranks sit on the device topology, and the launch environment of a multi-host job.

Owns: `topology_aware_mesh` (the ranks of a device mesh, laid out in the
devices' physical order) and `set_tpu_launch_env` (torchrun-style variables
derived from a TPU VM's environment). TorchTPU exposes both as
`torch.tpu.distributed.*` (torch_tpu/_internal/distributed). Does not own
process groups or collectives (torch_tpu/distributed, issue 15).
"""
from __future__ import annotations

import math
import os

import torch

__all__ = ["topology_aware_mesh", "set_tpu_launch_env"]


def _local_position():
    """(slice index, physical coordinates, core) of this process's current device; coordinates are () where the
    platform has none (CPU, GPU): then the device id orders."""
    from torch_tpu import device as device_module

    d = device_module._runtime().devices[device_module.current_device()]
    coords = tuple(getattr(d, "coords", None) or ())
    return (getattr(d, "slice_index", 0) or 0, tuple(reversed(coords)), getattr(d, "core_on_chip", 0) or 0, d.id)


def _ranks_in_topology_order(world: int) -> list[int]:
    import torch.distributed as dist

    if world == 1:
        return [0]
    positions = [None] * world
    dist.all_gather_object(positions, _local_position())
    return sorted(range(world), key=lambda rank: (*positions[rank], rank))


def topology_aware_mesh(mesh_shape, *, dcn_mesh_shape=None, allow_split_physical_axes: bool = False,
                        contiguous_submeshes: bool = False) -> torch.Tensor:
    """An int64 tensor of global ranks shaped like the mesh, for `DeviceMesh("tpu", mesh=...)`.

    Ranks are laid out in the order of their devices on the topology (slice,
    then physical coordinates; on CPU and GPU, device order). Each mesh axis is
    `dcn_mesh_shape[i]` slices of `mesh_shape[i]` devices (JAX's convention:
    the slow, cross-slice part outside). `allow_split_physical_axes` and
    `contiguous_submeshes` are accepted for TorchTPU's signature; with the
    devices in physical order, every axis is already contiguous.
    """
    import torch.distributed as dist

    mesh_shape = tuple(int(n) for n in mesh_shape)
    dcn = tuple(int(n) for n in dcn_mesh_shape) if dcn_mesh_shape is not None else (1,) * len(mesh_shape)
    if not mesh_shape or any(n < 1 for n in mesh_shape + dcn):
        raise ValueError(f"mesh_shape and dcn_mesh_shape must be positive sizes, got {mesh_shape} and {dcn}")
    if len(dcn) != len(mesh_shape):
        raise ValueError(f"dcn_mesh_shape {dcn} must have as many axes as mesh_shape {mesh_shape}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    shape = tuple(a * b for a, b in zip(dcn, mesh_shape))
    if math.prod(shape) != world:
        raise ValueError(f"a mesh of shape {shape} has {math.prod(shape)} ranks, but the world size is {world}")
    order = torch.tensor(_ranks_in_topology_order(world), dtype=torch.int64)
    n = len(shape)
    grid = order.reshape(*dcn, *mesh_shape)  # slices outside, the devices of one slice inside
    interleaved = [axis for i in range(n) for axis in (i, n + i)]
    return grid.permute(interleaved).reshape(shape).contiguous()


def set_tpu_launch_env(*, nnodes: int | None = None, nproc_per_node: int | None = None) -> dict:
    """Set the torchrun/env:// variables of a multi-host job that are not set yet; return those it set.

    From a TPU VM's environment: TPU_WORKER_HOSTNAMES (comma-separated hosts,
    the first one is the master), JOB_COMPLETION_INDEX or TPU_WORKER_ID (this
    host's rank), TORCH_TPU_BASE_PORT (the master port) and
    TORCH_TPU_DEVICES_PER_HOST (processes per host). Sets NNODES, NODE_RANK,
    MASTER_ADDR, MASTER_PORT and WORLD_SIZE where they follow; existing values
    are never overwritten, so calling it twice changes nothing.
    """
    from torch_tpu.config import config

    hosts = [h.strip() for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if nnodes is None:
        nnodes = len(hosts) or 1
    if nproc_per_node is None:
        nproc_per_node = config.devices_per_host
    for name, value in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    wanted = {"NNODES": str(nnodes)}
    node_rank = os.environ.get("JOB_COMPLETION_INDEX") or os.environ.get("TPU_WORKER_ID")
    if nnodes > 1:
        if node_rank is None:
            raise RuntimeError("set_tpu_launch_env: a multi-host job needs JOB_COMPLETION_INDEX or TPU_WORKER_ID "
                               "(this host's rank)")
        if not hosts:
            raise RuntimeError("set_tpu_launch_env: a multi-host job needs TPU_WORKER_HOSTNAMES")
        wanted.update(NODE_RANK=node_rank, MASTER_ADDR=hosts[0], MASTER_PORT=str(config.base_port))
    else:
        wanted.update(NODE_RANK="0", MASTER_ADDR="localhost", MASTER_PORT=str(config.base_port))
    if nproc_per_node is not None:
        wanted["WORLD_SIZE"] = str(nnodes * nproc_per_node)
    changed = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(changed)
    return changed
