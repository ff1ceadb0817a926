"""Reductions and scans: sum, mean, prod, max/min, arg-max/min, var/std, any/all, cumsum, norms.

NOTE(torch-vs-xla): PyTorch accumulates float16/bfloat16 reductions in
float32 and integer/bool sums in int64; we do the same explicitly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes


def _axes(x, dim):
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return None
    if isinstance(dim, int):
        dim = (dim,)
    if x.ndim == 0:
        return None
    return tuple(d % x.ndim for d in dim)


def _acc(x, dtype=None):
    """Cast to the accumulation dtype PyTorch would use."""
    if dtype is not None:
        return x.astype(dtypes.to_jax(dtype))
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.int64)
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return x.astype(jnp.float32)
    return x


@lowers(aten.sum.dim_IntList)
def sum_dim(x, dim=None, keepdim=False, dtype=None):
    return jnp.sum(_acc(x, dtype), axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.sum.default)
def sum_all(x, dtype=None):
    return jnp.sum(_acc(x, dtype))


@lowers(aten.mean.dim)
def mean_dim(x, dim=None, keepdim=False, dtype=None):
    return jnp.mean(_acc(x, dtype), axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.mean.default)
def mean_all(x, dtype=None):
    return jnp.mean(_acc(x, dtype))


@lowers(aten.prod.dim_int)
def prod_dim(x, dim, keepdim=False, dtype=None):
    return jnp.prod(_acc(x, dtype), axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.prod.default)
def prod_all(x, dtype=None):
    return jnp.prod(_acc(x, dtype))


@lowers(aten.amax.default)
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.amin.default)
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.max.default)
def max_all(x):
    return jnp.max(x)


@lowers(aten.min.default)
def min_all(x):
    return jnp.min(x)


def _arg_reduce(fn, x, dim, keepdim):
    if dim is None:
        return fn(x.reshape(-1)).reshape((1,) * x.ndim if keepdim else ())
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    return fn(x, axis=dim % x.ndim, keepdims=keepdim)


@lowers(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    return jnp.max(x, axis=dim, keepdims=keepdim), _arg_reduce(jnp.argmax, x, dim, keepdim)


@lowers(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    return jnp.min(x, axis=dim, keepdims=keepdim), _arg_reduce(jnp.argmin, x, dim, keepdim)


@lowers(aten.argmax.default)
def argmax(x, dim=None, keepdim=False):
    return _arg_reduce(jnp.argmax, x, dim, keepdim)


@lowers(aten.argmin.default)
def argmin(x, dim=None, keepdim=False):
    return _arg_reduce(jnp.argmin, x, dim, keepdim)


def _correction(correction, unbiased=True):
    if correction is None:
        return 1 if unbiased else 0
    return correction


@lowers(aten.var.correction)
def var(x, dim=None, correction=None, keepdim=False):
    return jnp.var(_acc(x), axis=_axes(x, dim), ddof=_correction(correction), keepdims=keepdim)


@lowers(aten.std.correction)
def std(x, dim=None, correction=None, keepdim=False):
    return jnp.std(_acc(x), axis=_axes(x, dim), ddof=_correction(correction), keepdims=keepdim)


@lowers(aten.var_mean.correction)
def var_mean(x, dim=None, correction=None, keepdim=False):
    a = _acc(x)
    axes = _axes(x, dim)
    return jnp.var(a, axis=axes, ddof=_correction(correction), keepdims=keepdim), jnp.mean(a, axis=axes, keepdims=keepdim)


@lowers(aten.std_mean.correction)
def std_mean(x, dim=None, correction=None, keepdim=False):
    a = _acc(x)
    axes = _axes(x, dim)
    return jnp.std(a, axis=axes, ddof=_correction(correction), keepdims=keepdim), jnp.mean(a, axis=axes, keepdims=keepdim)


@lowers(aten.any.default)
def any_all(x):
    return jnp.any(x)


@lowers(aten.any.dim, aten.any.dims)
def any_dim(x, dim=None, keepdim=False):
    return jnp.any(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.all.default)
def all_all(x):
    return jnp.all(x)


@lowers(aten.all.dim, aten.all.dims)
def all_dim(x, dim=None, keepdim=False):
    return jnp.all(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.logsumexp.default)
def logsumexp(x, dim, keepdim=False):
    a = x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.inexact) else _acc(x)
    return jax.nn.logsumexp(a, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.cumsum.default)
def cumsum(x, dim, dtype=None):
    if x.ndim == 0:
        return _acc(x, dtype)
    return jnp.cumsum(_acc(x, dtype), axis=dim)


@lowers(aten.cumprod.default)
def cumprod(x, dim, dtype=None):
    if x.ndim == 0:
        return _acc(x, dtype)
    return jnp.cumprod(_acc(x, dtype), axis=dim)


@lowers(aten.linalg_vector_norm.default, static_scalars=True)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    a = jnp.abs(_acc(x, dtype))
    axes = _axes(x, dim)
    if ord == float("inf"):
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    return jnp.sum(a**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


@lowers(aten.count_nonzero.dim_IntList)
def count_nonzero(x, dim):
    return jnp.sum(x != 0, axis=_axes(x, dim)).astype(jnp.int64)
