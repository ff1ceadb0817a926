"""Collective programs: jitted shard_maps over a mesh of the group's devices.

Every collective is one XLA program over a 1-D mesh (axis "r") holding one
device per rank of the group, in group-rank order. Each process passes its
local flat buffers; inside the shard_map a block is that rank's buffer, and
`lax` collectives (psum, all_gather, psum_scatter, all_to_all, ppermute) move
the data: on TPU/GPU over the interconnect, on CPU through XLA's gloo
collectives. Programs are cached by (collective, mesh, shapes, dtypes,
parameters): the second call of a collective launches a compiled executable.

Owns: the collectives' programs and their cache. Does not own: the per-rank
function of each collective (pure JAX, shared with the functional collectives'
lowerings: ops/_collective.py), tensors, storages or waiting (process_group.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from torch_tpu.ops._collective import AXIS, block_fn

_programs: dict = {}
_meshes: dict = {}
stats = {"programs_compiled": 0, "launches": 0}


def mesh(devices: tuple) -> Mesh:
    found = _meshes.get(devices)
    if found is None:
        found = _meshes[devices] = Mesh(np.array(devices, dtype=object), (AXIS,))
    return found


def global_array(local, m: Mesh):
    """This rank's flat block as its shard of the group's (size * n,) array."""
    n = local.shape[0]
    return jax.make_array_from_single_device_arrays((n * m.size,), _sharding(m), [local])


def _sharding(m: Mesh) -> NamedSharding:
    found = _shardings.get(m)
    if found is None:
        found = _shardings[m] = NamedSharding(m, P(AXIS))
    return found


_shardings: dict = {}


def local_block(array):
    """This process's shard of a program's result (one device per process)."""
    return array.addressable_data(0)


class _Launch:
    """A compiled collective and what its calls need: the jitted program and each input's global shape."""

    __slots__ = ("program", "sharding", "shapes")

    def __init__(self, program, sharding, shapes):
        self.program, self.sharding, self.shapes = program, sharding, shapes


def run(kind: str, devices: tuple, locals_: list, params: tuple = ()) -> list:
    """Launch collective `kind` over `devices` on this rank's flat blocks; this rank's flat results."""
    key = (kind, devices, params, *[(x.shape, x.dtype) for x in locals_])
    launch = _programs.get(key)
    if launch is None:
        m = mesh(devices)
        body = block_fn(kind, params, m.size)
        specs = tuple(P(AXIS) for _ in locals_)
        program = jax.jit(
            jax.shard_map(body, mesh=m, in_specs=specs, out_specs=specs, check_vma=False)
        )
        launch = _programs[key] = _Launch(program, _sharding(m), [(x.shape[0] * m.size,) for x in locals_])
        stats["programs_compiled"] += 1
    stats["launches"] += 1
    # One device per process: the global array of each input is this rank's buffer as its one shard.
    make, sharding = jax.make_array_from_single_device_arrays, launch.sharding
    results = launch.program(*[make(shape, sharding, [x]) for shape, x in zip(launch.shapes, locals_)])
    return [r.addressable_data(0) for r in results]


@functools.lru_cache(maxsize=None)
def _zeros_fn(n: int, dtype, device):
    return jax.jit(lambda: jnp.zeros((n,), dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))


def zeros(n: int, dtype, device):
    """A flat zero block on this rank's device (a participant with nothing to send)."""
    return _zeros_fn(n, jnp.dtype(dtype), device)()
