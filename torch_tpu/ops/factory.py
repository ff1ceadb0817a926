"""Values with no tensor inputs: fill, zero, arange, linspace, eye, full.

PyTorch builds factories as `empty` + an in-place fill or an out= op, so most
of these are the functional ops those derive from.
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes


@lowers(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    return jnp.full(x.shape, jnp.asarray(value).astype(x.dtype))


@lowers(aten.zero.default)
def zero(x):
    return jnp.zeros(x.shape, x.dtype)


@lowers(aten.full.default)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value)


@lowers(aten.arange.start_out, aten.range.out, static_scalars=True)
def arange_out(start, end, step, out):
    # `out` has the result's numel; its shape is the caller's when that numel was already right (ATen).
    n = out.size
    # PyTorch computes start + i*step in the accumulate type, then casts.
    wide = jnp.float64 if jnp.issubdtype(out.dtype, jnp.floating) else jnp.int64
    values = jnp.asarray(start, wide) + jnp.arange(n, dtype=wide) * jnp.asarray(step, wide)
    return values.astype(out.dtype).reshape(out.shape)


@lowers(aten.linspace.out, static_scalars=True)
def linspace_out(start, end, steps, out):
    if steps == 1:
        return jnp.full(out.shape, start).astype(out.dtype)
    if jnp.issubdtype(out.dtype, jnp.inexact):
        # PyTorch's CPU kernel: start/end rounded to the result dtype, the step in its opmath type
        # (float32 for bfloat16/float16/float32; complex in complex), each value rounded once.
        if jnp.issubdtype(out.dtype, jnp.complexfloating):
            wide = out.dtype
        else:
            wide = jnp.float64 if out.dtype == jnp.float64 else jnp.float32
        start, end = (jnp.asarray(v, out.dtype).astype(wide) for v in (start, end))
    else:
        wide = jnp.float64
        start, end = jnp.asarray(start, wide), jnp.asarray(end, wide)
    step = (end - start) / jnp.asarray(steps - 1, wide)
    i = jnp.arange(steps, dtype=wide)
    # PyTorch fills the first half forwards from start and the second half backwards from end.
    half = steps // 2
    values = jnp.where(i < half, start + step * i, end - step * (steps - 1 - i))
    if jnp.issubdtype(out.dtype, jnp.integer):
        values = jnp.trunc(values)
    return values.astype(out.dtype).reshape(out.shape)  # out's own shape, as arange_out


@lowers(aten.eye.m_out)
def eye_out(n, m, out):
    return jnp.eye(n, m, dtype=out.dtype)


@lowers(aten.eye.out)
def eye_square_out(n, out):
    return jnp.eye(n, dtype=out.dtype)


@lowers(aten.scalar_tensor.default)
def scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s, dtypes.to_jax(dtype) if dtype is not None else jnp.float32)


@lowers(aten._efficientzerotensor.default)
def efficientzerotensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    # NOTE(torch-vs-xla): PyTorch's ZeroTensor is a lazy zero; ours is stored zeros (same values).
    return jnp.zeros(tuple(size), dtypes.to_jax(dtype) if dtype is not None else jnp.float32)
