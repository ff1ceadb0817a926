"""Collective programs: jitted shard_maps over a mesh of the group's devices.

Every collective is one XLA program over a 1-D mesh (axis "r") holding one
device per rank of the group, in group-rank order. Each process passes its
local flat buffers; inside the shard_map a block is that rank's buffer, and
`lax` collectives (psum, all_gather, psum_scatter, all_to_all, ppermute) move
the data: on TPU/GPU over the interconnect, on CPU through XLA's gloo
collectives. Programs are cached by (collective, mesh, shapes, dtypes,
parameters): the second call of a collective launches a compiled executable.

Owns: the pure JAX side of each collective and its program cache.
Does not own: tensors, storages or waiting (process_group.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "r"

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


def _unsigned(dtype):
    """The unsigned integer type of the same width (bit-exact moves through an integer psum)."""
    size = jnp.dtype(dtype).itemsize
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size]


def _as_bits(x):
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x, _unsigned(x.dtype))


def _from_bits(bits, dtype):
    if dtype == jnp.bool_:
        return bits != 0
    return lax.bitcast_convert_type(bits, dtype)


def _one_from(x, src: int):
    """Every rank gets rank `src`'s x, bit for bit: a psum of the bits where other ranks add zeros."""
    bits = _as_bits(x)
    mine = lax.axis_index(AXIS) == src
    return _from_bits(lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), AXIS), x.dtype)


def _premul(x, op: str):
    """PREMUL_SUM ("premul_sum*<factor>"): every rank's value times the factor, then a sum."""
    if not op.startswith("premul_sum*"):
        return x, op
    return (x * jnp.asarray(float(op.split("*", 1)[1]), x.dtype)), "sum"


def _reduce(x, op: str, size: int):
    x, op = _premul(x, op)
    dtype = x.dtype
    if dtype == jnp.bool_:  # PyTorch reduces bools as logical or (sum/max) / and (product/min)
        as_int = x.astype(jnp.int32)
        if op in ("sum", "max", "avg"):
            return lax.pmax(as_int, AXIS) != 0
        return lax.pmin(as_int, AXIS) != 0
    low = dtype in (jnp.bfloat16, jnp.float16)
    if op in ("sum", "avg"):
        # bf16/f16 added in float32 (each rank's value rounded once, the sum once).
        y = lax.psum(x.astype(jnp.float32) if low else x, AXIS)
        if op == "avg":
            y = y / size
        return y.astype(dtype)
    if op == "max":
        return lax.pmax(x, AXIS)
    if op == "min":
        return lax.pmin(x, AXIS)
    if op == "product":
        gathered = lax.all_gather(x.astype(jnp.float32) if low else x, AXIS)
        return jnp.prod(gathered, axis=0).astype(dtype)
    raise ValueError(op)


def _block_fn(kind: str, params: tuple, size: int):
    """The per-rank function of a collective over flat blocks (a tuple in, a tuple out)."""
    if kind == "all_reduce":
        (op,) = params
        return lambda *xs: tuple(_reduce(x, op, size) for x in xs)
    if kind == "broadcast":
        (src,) = params
        return lambda *xs: tuple(_one_from(x, src) for x in xs)
    if kind == "all_gather":  # each input (n,) -> (size * n,), rank-major
        return lambda *xs: tuple(lax.all_gather(x, AXIS, tiled=True) for x in xs)
    if kind == "reduce_scatter":  # each input (size * m,) -> (m,): this rank's chunk of the reduction
        (op,) = params

        def reduce_scatter(*xs):
            outs = []
            for x in xs:
                x, op_ = _premul(x, op)
                if op_ == "sum" and x.dtype not in (jnp.bool_, jnp.bfloat16, jnp.float16):
                    outs.append(lax.psum_scatter(x, AXIS, tiled=True))
                    continue
                if op_ in ("sum", "avg") and x.dtype in (jnp.bfloat16, jnp.float16):
                    y = lax.psum_scatter(x.astype(jnp.float32), AXIS, tiled=True)
                    outs.append((y / size if op_ == "avg" else y).astype(x.dtype))
                    continue
                if op_ == "avg":
                    outs.append(lax.psum_scatter(x, AXIS, tiled=True) / size)
                    continue
                m = x.shape[0] // size
                whole = _reduce(x, op_, size)
                outs.append(lax.dynamic_slice(whole, (lax.axis_index(AXIS) * m,), (m,)))
            return tuple(outs)

        return reduce_scatter
    if kind == "scatter":  # src's (size * m,) -> chunk r on rank r
        (src,) = params

        def scatter(*xs):
            outs = []
            for x in xs:
                bits = _as_bits(x)
                mine = lax.axis_index(AXIS) == src
                chunk = lax.psum_scatter(jnp.where(mine, bits, jnp.zeros_like(bits)), AXIS, tiled=True)
                outs.append(_from_bits(chunk, x.dtype))
            return tuple(outs)

        return scatter
    if kind == "all_to_all":  # (size * m,): chunk j goes to rank j; out chunk j came from rank j
        def all_to_all(*xs):
            outs = []
            for x in xs:
                y = lax.all_to_all(x.reshape(size, -1), AXIS, 0, 0, tiled=True)
                outs.append(y.reshape(-1))
            return tuple(outs)

        return all_to_all
    if kind == "permute":  # point-to-point over the pair: mesh position a's block to position b
        (a, b) = params
        return lambda *xs: tuple(lax.ppermute(x, AXIS, [(a, b)]) for x in xs)
    raise ValueError(f"unknown collective {kind!r}")


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
        body = _block_fn(kind, params, m.size)
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
