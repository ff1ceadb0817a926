"""Indexing: index, index_put, gather, scatter, index_select/add/copy/reduce, take/put,
masked_scatter, sort, topk, searchsorted/bucketize.

Boolean masks reach `index`/`index_put` already turned into index tensors
(ops/dynamic.py), except `x[mask] = scalar`, which needs no size and is a select here.

NOTE(torch-vs-xla): XLA clamps gathers and drops out-of-range scatters, where
PyTorch raises. The lowerings state PyTorch's bounds (ops/checks.py): a bad
index raises PyTorch's error at the next materialization point.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torch_tpu.ops import checks
from torch_tpu.ops.checks import checked
from torch_tpu.ops.registry import Promote, aten, lowers
from torch_tpu.runtime import errors


def _index_tuple(indices):
    return tuple(slice(None) if i is None else i for i in indices)


def _check_indices(x, indices):
    """Advanced indices in [-size, size) of the dims they index (PyTorch's IndexError)."""
    dim = 0
    for i in indices:
        if i is None:
            dim += 1
            continue
        if i.dtype == jnp.bool_:
            dim += i.ndim
            continue
        checks.require_index(i, x.shape[dim], checks.INDEX_BOUNDS, dim, negative=True)
        dim += 1


@lowers(aten.index.Tensor)
@checked
def index(x, indices):
    _check_indices(x, indices)
    return x[_index_tuple(indices)]


@lowers(aten._unsafe_index.Tensor)
def unsafe_index(x, indices):
    return x[_index_tuple(indices)]


@lowers(aten.index_put.default, aten._index_put_impl.default)
@checked
def index_put(x, indices, values, accumulate=False, unsafe=False):
    _check_indices(x, indices)
    return unsafe_index_put(x, indices, values, accumulate)


@lowers(aten._unsafe_index_put.default)
def unsafe_index_put(x, indices, values, accumulate=False):
    values = values.astype(x.dtype)
    masks = [(p, i) for p, i in enumerate(indices) if i is not None and i.dtype == jnp.bool_]
    if masks:  # `x[mask] = scalar` (the only boolean case that reaches a lowering): a select
        (position, mask), = masks
        mask = mask.reshape((1,) * position + mask.shape + (1,) * (x.ndim - position - mask.ndim))
        value = values.reshape(())
        added = (x | value) if x.dtype == jnp.bool_ else x + value
        return jnp.where(mask, added if accumulate else value, x)
    ref = x.at[_index_tuple(indices)]
    if accumulate:
        return ref.max(values) if x.dtype == jnp.bool_ else ref.add(values)  # bool: logical or
    return ref.set(values)


@lowers(aten.masked_scatter.default)
@checked
def masked_scatter(x, mask, source):
    """Masked positions of x take source's elements in order (no size needed: a running count).

    x and mask broadcast against each other (the out-of-place op's result has their joint shape).
    """
    if mask.dtype != jnp.bool_:  # PyTorch's CPU kernel raises its own error (eager/cpu_errors.py)
        raise TypeError(f"masked_scatter: mask of dtype {mask.dtype}")
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    x = jnp.broadcast_to(x, shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    src = source.reshape(-1)
    checks.require(jnp.sum(flat_mask, dtype=jnp.int64) <= src.shape[0], checks.MASKED_SCATTER_SOURCE)
    if src.shape[0] == 0:
        return x
    position = jnp.clip(jnp.cumsum(flat_mask.astype(jnp.int64)) - 1, 0, src.shape[0] - 1)
    return jnp.where(flat_mask, src[position].astype(x.dtype), x.reshape(-1)).reshape(x.shape)


@lowers(aten.take.default)
@checked
def take(x, index):
    flat = x.reshape(-1)
    checks.require_index(index, flat.shape[0], checks.TAKE, negative=True)
    return flat[jnp.where(index < 0, index + flat.shape[0], index)]


def _put_host_check(x, index, source, accumulate=False):
    if not accumulate:  # duplicate indices leave which value wins unspecified (ATen alerts on every device)
        errors.alert_not_deterministic("put_")


@lowers(aten.put.default, host_check=_put_host_check)
@checked
def put(x, index, source, accumulate=False):
    flat = x.reshape(-1)
    checks.require_index(index, flat.shape[0], checks.TAKE, negative=True)
    index = jnp.where(index < 0, index + flat.shape[0], index).reshape(-1)
    ref = flat.at[index]
    values = source.reshape(-1).astype(x.dtype)
    if accumulate:
        return (ref.max(values) if x.dtype == jnp.bool_ else ref.add(values)).reshape(x.shape)
    return ref.set(values).reshape(x.shape)


@lowers(aten.index_select.default)
@checked
def index_select(x, dim, index):
    checks.require_index(index, x.shape[dim] if x.ndim else 1, checks.INDEX_IN_SELF)
    if x.ndim == 0:
        return jnp.take(x.reshape(1), index.reshape(-1), axis=0).reshape(())
    return jnp.take(x, index.reshape(-1), axis=dim)


def _full_index(index, dim):
    """Index arrays selecting `index` along `dim` and the identity along the other dims."""
    grids = []
    for d in range(index.ndim):
        grids.append(index if d == dim else lax.broadcasted_iota(jnp.int64, index.shape, d))
    return tuple(grids)


@lowers(aten.gather.default)
@checked
def gather(x, dim, index, sparse_grad=False):
    if index.size == 0:  # PyTorch skips the rank check for an empty index: nothing is read
        return jnp.zeros(index.shape, x.dtype)
    _check_dim_index(x, dim, index)
    if x.ndim == 0:
        return jnp.broadcast_to(x, index.shape)
    if index.ndim == 0:  # a 0-d index of a 1-element 1-d input: ATen reads that element
        return x.reshape(-1)[index]
    dim = dim % x.ndim
    return x[_full_index(index, dim)]


def _check_dim_index(x, dim, index):
    """gather/scatter indices in [0, size) of `dim` (PyTorch's RuntimeError)."""
    dim = dim % max(x.ndim, 1)
    checks.require_index(index, x.shape[dim] if x.ndim else 1, checks.GATHER_BOUNDS, dim)


def _scatter(x, dim, index, src, reduce=None):
    if index.size == 0:  # nothing written (PyTorch skips the rank check for an empty index)
        return x
    if x.ndim == 0:
        x1 = x.reshape(1)
        return _scatter(x1, 0, index.reshape(-1), jnp.asarray(src).reshape(-1)[:1] if jnp.ndim(src) else src, reduce).reshape(())
    dim = dim % x.ndim
    idx = _full_index(index, dim)
    if jnp.ndim(src) == 0:
        values = jnp.broadcast_to(jnp.asarray(src).astype(x.dtype), index.shape)
    else:
        values = src[tuple(slice(0, s) for s in index.shape)].astype(x.dtype)
    ref = x.at[idx]
    if reduce is None:
        return ref.set(values)
    if reduce in ("add", "sum"):
        return ref.max(values) if x.dtype == jnp.bool_ else ref.add(values)  # bool: logical or
    if reduce in ("multiply", "prod"):
        return ref.min(values) if x.dtype == jnp.bool_ else ref.multiply(values)  # bool: logical and
    if reduce == "amax":
        return ref.max(values)
    if reduce == "amin":
        return ref.min(values)
    raise NotImplementedError(f"scatter reduce={reduce!r}")


@lowers(aten.scatter.src, aten.scatter.value)
@checked
def scatter(x, dim, index, src):
    _check_dim_index(x, dim, index)
    return _scatter(x, dim, index, src)


@lowers(aten.scatter.reduce, aten.scatter.value_reduce)
@checked
def scatter_reduce_legacy(x, dim, index, src, reduce):
    _check_dim_index(x, dim, index)
    return _scatter(x, dim, index, src, reduce)


@lowers(aten.scatter_add.default)
@checked
def scatter_add(x, dim, index, src):
    _check_dim_index(x, dim, index)
    return _scatter(x, dim, index, src, "add")


@lowers(aten.scatter_reduce.two)
@checked
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    _check_dim_index(x, dim, index)
    if reduce == "mean":
        total = _scatter(x if include_self else jnp.zeros_like(x), dim, index, src, "add")
        ones = jnp.ones(index.shape, x.dtype)
        count = _scatter(jnp.ones_like(x) if include_self else jnp.zeros_like(x), dim, index, ones, "add")
        count = jnp.maximum(count, 1)
        out = total / count if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.floor_divide(total, count)
        if not include_self:  # untouched positions keep their value
            touched = _scatter(jnp.zeros(x.shape, jnp.bool_), dim, index, True)
            out = jnp.where(touched, out, x)
        return out.astype(x.dtype)
    if not include_self:
        # Positions that receive a value start from the reduction's identity.
        touched = _scatter(jnp.zeros(x.shape, jnp.bool_), dim, index, True)
        identity = {"sum": lambda: 0, "prod": lambda: 1, "amax": lambda: _lowest(x.dtype),
                    "amin": lambda: _highest(x.dtype)}[reduce]()
        x = jnp.where(touched, jnp.asarray(identity, x.dtype), x)
    return _scatter(x, dim, index, src, reduce)


def _lowest(dtype):
    if dtype == jnp.bool_:
        return False
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _highest(dtype):
    if dtype == jnp.bool_:
        return True
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


@lowers(aten.index_add.default)
@checked
def index_add(x, dim, index, source, alpha=1):
    # PyTorch's CPU kernel: a 1-D (or 0-D) self raises IndexError, others a RuntimeError naming the dim.
    code = checks.INDEX_IN_SELF if x.ndim <= 1 else checks.GATHER_BOUNDS
    checks.require_index(index, x.shape[dim % x.ndim] if x.ndim else 1, code, dim % max(x.ndim, 1))
    if x.ndim == 0:
        return x + jnp.sum(source) * alpha
    dim = dim % x.ndim
    idx = (slice(None),) * dim + (index,)
    if x.dtype == jnp.bool_:
        return x.at[idx].max(source.astype(jnp.bool_) & (jnp.asarray(alpha) != 0))
    return x.at[idx].add((source * alpha).astype(x.dtype))


@lowers(aten.index_copy.default)
@checked
def index_copy(x, dim, index, source):
    checks.require_index(index, x.shape[dim % x.ndim] if x.ndim else 1, checks.INDEX_COPY, dim % max(x.ndim, 1))
    if x.ndim == 0:
        return source.reshape(())
    dim = dim % x.ndim
    index = index.reshape(-1)  # a 0-dim index selects one slice, which the source still has (PyTorch)
    source = source.reshape(x.shape[:dim] + index.shape + x.shape[dim + 1:])
    return x.at[(slice(None),) * dim + (index,)].set(source.astype(x.dtype))


@lowers(aten.index_reduce.default)
@checked
def index_reduce(x, dim, index, source, reduce, include_self=True):
    checks.require_index(index, x.shape[dim % x.ndim] if x.ndim else 1, checks.INDEX_IN_SELF)
    if x.ndim == 0:
        x, source, squeeze = x.reshape(1), source.reshape(1), True
    else:
        squeeze = False
    dim = dim % x.ndim
    where = (slice(None),) * dim + (index,)
    source = source.astype(x.dtype)
    touched = jnp.zeros(x.shape, jnp.bool_).at[where].set(True)
    if reduce == "mean":
        start = x if include_self else jnp.zeros_like(x)
        total = start.at[where].add(source)
        count = (jnp.ones_like(x) if include_self else jnp.zeros_like(x)).at[where].add(jnp.ones_like(source))
        count = jnp.maximum(count, 1)
        out = total / count if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.floor_divide(total, count)
    else:
        if not include_self:
            identity = {"prod": 1, "amax": _lowest(x.dtype), "amin": _highest(x.dtype)}[reduce]
            x = jnp.where(touched, jnp.asarray(identity, x.dtype), x)
        ref = x.at[where]
        out = {"prod": ref.multiply, "amax": ref.max, "amin": ref.min}[reduce](source)
    out = jnp.where(touched, out, x) if not include_self else out
    return out.reshape(()) if squeeze else out


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
@checked
def index_fill(x, dim, index, value):
    if jnp.iscomplexobj(value) and not jnp.iscomplexobj(x):
        raise RuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not supported")
    checks.require_index(index, x.shape[dim % x.ndim] if x.ndim else 1, checks.INDEX_BOUNDS, dim % max(x.ndim, 1), negative=True)
    if x.ndim == 0:
        return jnp.asarray(value).astype(x.dtype)
    dim = dim % x.ndim
    return x.at[(slice(None),) * dim + (index,)].set(jnp.asarray(value).astype(x.dtype))


# ---------------------------------------------------------------- sorting
@lowers(aten.sort.stable)
def sort_stable(x, stable=None, dim=-1, descending=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    order = jnp.argsort(x, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(x, order, axis=dim), order.astype(jnp.int64)


@lowers(aten.sort.default)
def sort(x, dim=-1, descending=False):
    return sort_stable(x, True, dim, descending)


@lowers(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    moved = jnp.moveaxis(x, dim, -1)
    order = jnp.argsort(moved, axis=-1, stable=True, descending=largest)[..., :k]
    values = jnp.take_along_axis(moved, order, axis=-1)
    return jnp.moveaxis(values, -1, dim), jnp.moveaxis(order, -1, dim).astype(jnp.int64)


# ---------------------------------------------------------------- binary search
def _searchsorted(sequence, values, side):
    if sequence.ndim <= 1:
        return jnp.searchsorted(sequence.reshape(-1), values, side=side)
    rows = sequence.reshape(-1, sequence.shape[-1])
    found = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(rows, values.reshape(rows.shape[0], -1))
    return found.reshape(values.shape)


def _side(right, side):
    return side if side is not None else ("right" if right else "left")


@lowers(aten.searchsorted.Tensor, aten.searchsorted.Scalar, promote=Promote.DEFAULT,
        promote_args=("sorted_sequence", "self"))
@checked
def searchsorted(sequence, values, out_int32=False, right=False, side=None, sorter=None):
    if sorter is not None:
        size = sequence.shape[-1] if sequence.ndim else 1
        checks.require((sorter >= 0) & (sorter < size), checks.SORTER_RANGE)
        sequence = jnp.take_along_axis(sequence, sorter, axis=-1)
    out = _searchsorted(sequence, jnp.asarray(values), _side(right, side))
    return out.astype(jnp.int32 if out_int32 else jnp.int64)


@lowers(aten.bucketize.Tensor, aten.bucketize.Scalar, promote=Promote.DEFAULT, promote_args=("self", "boundaries"))
def bucketize(values, boundaries, out_int32=False, right=False):
    out = jnp.searchsorted(boundaries, jnp.asarray(values), side="right" if right else "left")
    return out.astype(jnp.int32 if out_int32 else jnp.int64)
