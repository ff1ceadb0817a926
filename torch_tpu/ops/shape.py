"""Ops that move values without computing on them: copy, clone, cat, stack, flip, pad...

(Pure metadata views never get here: they reuse PyTorch's CPU kernels on
tpu tensors. These ops produce new storages.)
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes


@lowers(aten.copy.default)
def copy(x, src, non_blocking=False):
    return jnp.broadcast_to(dtypes.cast(src, x.dtype), x.shape)


@lowers(aten.clone.default)
def clone(x, memory_format=None):
    return x


@lowers(aten.cat.default)
def cat(tensors, dim=0):
    # PyTorch skips legacy 1-D empty tensors in cat.
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return tensors[0]
    dtype = jnp.result_type(*parts)
    return jnp.concatenate([p.astype(dtype) for p in parts], axis=dim)


@lowers(aten.stack.default)
def stack(tensors, dim=0):
    dtype = jnp.result_type(*tensors)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=dim)


@lowers(aten.flip.default)
def flip(x, dims):
    # A 0-dim tensor takes dim 0 or -1 (PyTorch wraps it as one dimension); nothing to reverse.
    return jnp.flip(x, axis=tuple(dims)) if dims and x.ndim else x


@lowers(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), axis=tuple(dims))


@lowers(aten.repeat.default)
def repeat(x, repeats):
    repeats = tuple(repeats)
    x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@lowers(aten.tril.default)
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowers(aten.triu.default)
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lowers(aten.constant_pad_nd.default, static_scalars=True)
def constant_pad_nd(x, pad, value=0):
    pad = list(pad)
    widths = [(0, 0, 0)] * (x.ndim - len(pad) // 2)
    for i in reversed(range(len(pad) // 2)):
        widths.append((pad[2 * i], pad[2 * i + 1], 0))
    # lax.pad takes negative widths (cropping), like PyTorch.
    from jax import lax

    return lax.pad(x, jnp.asarray(value).astype(x.dtype), widths)


@lowers(aten.expand_copy.default)
def expand_copy(x, size, implicit=False):
    size = tuple(x.shape[i - (len(size) - x.ndim)] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, size)


@lowers(aten.permute_copy.default)
def permute_copy(x, dims):
    return jnp.transpose(x, tuple(d % max(x.ndim, 1) for d in dims))


@lowers(aten.view_copy.default)
def view_copy(x, size):
    return x.reshape(tuple(size))


@lowers(aten.alias_copy.default, aten.lift_fresh_copy.default)
def alias_copy(x):
    return x


# ---------------------------------------------------------------- scatters into views (and the backward of views)
# Lowered directly (PyTorch would decompose each into zeros + a scatter: two programs); these
# are what autograd runs for every x[i], x[a:b] and x.diagonal() in a model.
def _slice_index(size, start, end, step):
    start = 0 if start is None else start
    end = size if end is None else end
    start, end, _ = slice(start, end, step).indices(size)  # PyTorch clamps like Python slicing
    return slice(start, max(end, start), step)


def _at_dim(ndim, dim, index):
    return (slice(None),) * (dim % ndim) + (index,)


@lowers(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    dim = dim % x.ndim
    return x.at[_at_dim(x.ndim, dim, index % x.shape[dim])].set(src.astype(x.dtype))


@lowers(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    dim = dim % x.ndim
    return x.at[_at_dim(x.ndim, dim, _slice_index(x.shape[dim], start, end, step))].set(src.astype(x.dtype))


def _diagonal_index(shape, offset, dim1, dim2):
    """Index arrays (one per dim) addressing x.diagonal(offset, dim1, dim2), diagonal last like PyTorch."""
    ndim = len(shape)
    dim1, dim2 = dim1 % ndim, dim2 % ndim
    rows = shape[dim1] if offset >= 0 else shape[dim1] + offset
    cols = shape[dim2] - offset if offset >= 0 else shape[dim2]
    n = max(min(rows, cols), 0)
    k = jnp.arange(n)
    i, j = (k, k + offset) if offset >= 0 else (k - offset, k)
    others = [d for d in range(ndim) if d not in (dim1, dim2)]
    index = [None] * ndim
    batch = [shape[d] for d in others]
    for position, d in enumerate(others):
        index[d] = jnp.arange(shape[d]).reshape([-1 if q == position else 1 for q in range(len(others))] + [1])
    index[dim1] = i.reshape([1] * len(others) + [n])
    index[dim2] = j.reshape([1] * len(others) + [n])
    return tuple(jnp.broadcast_to(ix, batch + [n]) for ix in index)


@lowers(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    return x.at[_diagonal_index(x.shape, offset, dim1, dim2)].set(src.astype(x.dtype))


@lowers(aten.select_backward.default)
def select_backward(grad, input_sizes, dim, index):
    return select_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, index)


@lowers(aten.slice_backward.default)
def slice_backward(grad, input_sizes, dim, start, end, step):
    return slice_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, start, end, step)


@lowers(aten.diagonal_backward.default)
def diagonal_backward(grad, input_sizes, offset, dim1, dim2):
    return diagonal_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, offset, dim1, dim2)


@lowers(aten.unfold_backward.default)
def unfold_backward(grad, input_sizes, dim, size, step):
    """Sum each window's gradient back into the positions it was read from."""
    ndim = len(input_sizes)
    dim = dim % ndim if ndim else 0
    out = jnp.zeros(tuple(input_sizes), grad.dtype)
    if ndim == 0:
        return out + jnp.sum(grad)
    windows = grad.shape[dim]
    # grad: input dims with `dim` replaced by the window count, plus a trailing window axis of `size`.
    position = (jnp.arange(windows)[:, None] * step + jnp.arange(size)[None, :])  # (windows, size)
    moved = jnp.moveaxis(grad, (dim, grad.ndim - 1), (0, 1))  # (windows, size, other dims...)
    target = jnp.moveaxis(out, dim, 0)
    target = target.at[position.reshape(-1)].add(moved.reshape((-1,) + moved.shape[2:]))
    return jnp.moveaxis(target, 0, dim)
