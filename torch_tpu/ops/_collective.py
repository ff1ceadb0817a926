"""The per-rank functions of collectives over a mesh axis, on flat blocks: pure JAX.

One vocabulary for both users: the process group's collective programs
(distributed/programs.py: a shard_map over the group's mesh) and the lowerings
of the functional collectives inside torch.compile graphs (ops/collectives.py).
Axis "r" holds one position per group rank, in group-rank order.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

AXIS = "r"


def unsigned(dtype):
    """The unsigned integer type of the same width (bit-exact moves through an integer psum)."""
    size = jnp.dtype(dtype).itemsize
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size]


def as_bits(x):
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x, unsigned(x.dtype))


def from_bits(bits, dtype):
    if dtype == jnp.bool_:
        return bits != 0
    return lax.bitcast_convert_type(bits, dtype)


def one_from(x, src: int):
    """Every rank gets rank `src`'s x, bit for bit: a psum of the bits where other ranks add zeros."""
    bits = as_bits(x)
    mine = lax.axis_index(AXIS) == src
    return from_bits(lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), AXIS), x.dtype)


def premul(x, op: str):
    """PREMUL_SUM ("premul_sum*<factor>"): every rank's value times the factor, then a sum."""
    if not op.startswith("premul_sum*"):
        return x, op
    return (x * jnp.asarray(float(op.split("*", 1)[1]), x.dtype)), "sum"


def reduce(x, op: str, size: int):
    x, op = premul(x, op)
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


def block_fn(kind: str, params: tuple, size: int):
    """The per-rank function of a collective over flat blocks (a tuple in, a tuple out)."""
    if kind == "all_reduce":
        (op,) = params
        return lambda *xs: tuple(reduce(x, op, size) for x in xs)
    if kind == "broadcast":
        (src,) = params
        return lambda *xs: tuple(one_from(x, src) for x in xs)
    if kind == "all_gather":  # each input (n,) -> (size * n,), rank-major
        return lambda *xs: tuple(lax.all_gather(x, AXIS, tiled=True) for x in xs)
    if kind == "reduce_scatter":  # each input (size * m,) -> (m,): this rank's chunk of the reduction
        (op,) = params

        def reduce_scatter(*xs):
            outs = []
            for x in xs:
                x, op_ = premul(x, op)
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
                whole = reduce(x, op_, size)
                outs.append(lax.dynamic_slice(whole, (lax.axis_index(AXIS) * m,), (m,)))
            return tuple(outs)

        return reduce_scatter
    if kind == "scatter":  # src's (size * m,) -> chunk r on rank r
        (src,) = params

        def scatter(*xs):
            outs = []
            for x in xs:
                bits = as_bits(x)
                mine = lax.axis_index(AXIS) == src
                chunk = lax.psum_scatter(jnp.where(mine, bits, jnp.zeros_like(bits)), AXIS, tiled=True)
                outs.append(from_bits(chunk, x.dtype))
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
