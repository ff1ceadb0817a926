"""Pooling: max (with indices), average, adaptive average/max, max-unpool, and their backward.

The 1d forms are CompositeImplicitAutograd in PyTorch (they unsqueeze to 2d),
so 2d and 3d are lowered. Indices are flat positions in each (N, C) plane,
like PyTorch's, so the backward is a scatter-add of the gradient at them.
Linear pools (average) get their backward as the transpose of the forward.
"""
from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torch_tpu.ops.registry import aten, lowers, register
from torch_tpu.runtime import dtypes


def _expand(values, nd, default=None):
    values = tuple(values) if values is not None else ()
    if not values:
        return default
    return values * nd if len(values) == 1 else values


def _params(kernel, stride, padding, dilation, nd):
    kernel = _expand(kernel, nd)
    return kernel, _expand(stride, nd, kernel), _expand(padding, nd, (0,) * nd), _expand(dilation, nd, (1,) * nd)


def _out_size(n, k, s, p, d, ceil_mode):
    """PyTorch's pooling_output_shape."""
    out = (n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _plane_strides(sizes):
    return [math.prod(sizes[i + 1:]) for i in range(len(sizes))]


def _scatter_planes(grad, indices, plane_shape):
    """Add grad (..., *out) into zeros (..., *plane_shape) at flat plane indices."""
    nd = len(plane_shape)
    lead = grad.shape[:grad.ndim - nd]
    b = math.prod(lead)
    g = grad.reshape(b, math.prod(grad.shape[len(lead):]))  # (no -1: b may be 0)
    i = indices.reshape(g.shape)
    out = jnp.zeros((b, math.prod(plane_shape)), g.dtype).at[jnp.arange(b)[:, None], i].add(g)
    return out.reshape(*lead, *plane_shape)


# ---------------------------------------------------------------- max pool
def _max_pool(x, kernel, stride, padding, dilation, ceil_mode):
    nd = len(kernel)
    lead = x.ndim - nd
    sizes = x.shape[lead:]
    outs = [_out_size(n, k, s, p, d, ceil_mode) for n, k, s, p, d in zip(sizes, kernel, stride, padding, dilation)]
    highs = [max((o - 1) * s + d * (k - 1) + 1 - n - p, 0)
             for o, s, d, k, n, p in zip(outs, stride, dilation, kernel, sizes, padding)]
    widths = [(0, 0, 0)] * lead + [(p, h, 0) for p, h in zip(padding, highs)]
    xp = lax.pad(x, jnp.asarray(_lowest(x.dtype), x.dtype), widths)
    # One strided slice per kernel offset, stacked last: (..., *out, prod(kernel)).
    parts = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        starts = [o * d for o, d in zip(offsets, dilation)]
        limits = [st + (o - 1) * s + 1 for st, o, s in zip(starts, outs, stride)]
        parts.append(lax.slice(xp, [0] * lead + starts, list(x.shape[:lead]) + limits, [1] * lead + list(stride)))
    windows = jnp.stack(parts, axis=-1)
    best = jnp.argmax(windows, axis=-1)
    values = jnp.take_along_axis(windows, best[..., None], axis=-1)[..., 0]
    # The flat plane index of each window's maximum.
    index = jnp.zeros(best.shape, jnp.int64)
    for dim, (k, s, p, d, stride_in_plane) in enumerate(zip(kernel, stride, padding, dilation, _plane_strides(sizes))):
        offset = (best // math.prod(kernel[dim + 1:])) % k
        position = lax.broadcasted_iota(jnp.int64, best.shape, lead + dim) * s - p + offset * d
        index = index + position * stride_in_plane
    return values, index


def max_pool_with_indices(nd, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, *_params(kernel_size, stride, _ints(padding), _ints(dilation), nd), ceil_mode)


def max_pool_with_indices_backward(nd, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_planes(grad, indices, x.shape[x.ndim - nd:])


def _ints(v):
    return (v,) if isinstance(v, int) else v


# ---------------------------------------------------------------- average pool
def _avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    nd = len(kernel)
    lead = x.ndim - nd
    sizes = x.shape[lead:]
    outs = [_out_size(n, k, s, p, 1, ceil_mode) for n, k, s, p in zip(sizes, kernel, stride, padding)]
    highs = [max((o - 1) * s + k - n - p, 0) for o, s, k, n, p in zip(outs, stride, kernel, sizes, padding)]
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    sums = lax.reduce_window(x.astype(acc), np.zeros((), acc), lax.add, (1,) * lead + tuple(kernel),
                             (1,) * lead + tuple(stride), [(0, 0)] * lead + [(p, h) for p, h in zip(padding, highs)])
    sums = sums[(Ellipsis,) + tuple(slice(0, o) for o in outs)]
    if divisor_override:
        return sums / divisor_override
    divisor = np.ones((), np.int64)
    for n, k, s, p, o in zip(sizes, kernel, stride, padding, outs):
        starts = np.arange(o) * s - p
        ends = np.minimum(starts + k, n + p)
        count = ends - starts if count_include_pad else np.minimum(ends, n) - np.maximum(starts, 0)
        divisor = np.multiply.outer(divisor, count)
    return sums / jnp.asarray(divisor, acc)


def avg_pool(nd, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None):
    kernel, stride, padding, _ = _params(kernel_size, stride, _ints(padding), (1,), nd)
    return _avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)


def avg_pool_backward(nd, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel, stride, padding, _ = _params(kernel_size, stride, _ints(padding), (1,), nd)
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    forward = functools.partial(_avg_pool, kernel=kernel, stride=stride, padding=padding, ceil_mode=ceil_mode,
                                count_include_pad=count_include_pad, divisor_override=divisor_override)
    return jax.vjp(forward, jnp.zeros(x.shape, acc))[1](grad.astype(acc))[0]


# ---------------------------------------------------------------- adaptive pools
def _adaptive_bins(n, o):
    """(o, kmax) input positions of each output bin (clamped) and their validity.

    Bin i is [floor(i*n/o), ceil((i+1)*n/o)), as in PyTorch."""
    starts = (np.arange(o) * n) // o
    ends = -((-(np.arange(o) + 1) * n) // o)
    kmax = int(np.max(ends - starts)) if o else 1
    index = starts[:, None] + np.arange(kmax)[None, :]
    return np.minimum(index, n - 1), index < ends[:, None]


def _adaptive_windows(x, output_size, fill):
    """(..., *out, K) windows of each adaptive bin (padding entries = fill), and the per-dim bins."""
    nd = len(output_size)
    lead = x.ndim - nd
    bins = [_adaptive_bins(n, o) for n, o in zip(x.shape[lead:], output_size)]
    w = x
    for dim, (index, _) in enumerate(bins):
        # Axis lead + 2*dim holds this dim's input; replace it with (out, k).
        w = jnp.take(w, jnp.asarray(index.reshape(-1)), axis=lead + 2 * dim)
        w = w.reshape(w.shape[:lead + 2 * dim] + index.shape + w.shape[lead + 2 * dim + 1:])
    order = list(range(lead)) + [lead + 2 * i for i in range(nd)] + [lead + 2 * i + 1 for i in range(nd)]
    w = jnp.transpose(w, order)
    w = w.reshape(w.shape[:lead + nd] + (math.prod(index.shape[1] for index, _ in bins),))
    valid = bins[0][1]
    for _, v in bins[1:]:
        valid = valid[..., None, None] & v
    valid = np.transpose(valid, [2 * i for i in range(nd)] + [2 * i + 1 for i in range(nd)]).reshape(
        tuple(output_size) + (w.shape[-1],))  # (no -1: an output size may be 0)
    return jnp.where(jnp.asarray(valid), w, jnp.asarray(fill, x.dtype)), bins


def _floating_only(kind, x, output_size):
    # ATen's adaptive pools dispatch floating types only, on CPU and CUDA alike
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise dtypes.not_implemented(f"adaptive_{kind}_pool{len(output_size)}d", dtypes.to_torch(x.dtype))


@lowers(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool(x, output_size):
    _floating_only("avg", x, output_size)
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    windows, bins = _adaptive_windows(x.astype(acc), tuple(output_size), 0)
    count = np.ones((), np.int64)
    for _, valid in bins:
        count = np.multiply.outer(count, valid.sum(axis=1))
    return jnp.sum(windows, axis=-1) / jnp.asarray(count, acc)


def adaptive_avg_pool_backward(nd, grad, x):
    for dim in range(1, grad.ndim):  # ATen's shape check (CPU and CUDA); the batch dim may be empty
        if grad.shape[dim] == 0:
            raise RuntimeError(
                f"adaptive_avg_pool{nd}d_backward(): Expected grad_output to have non-zero size for non-batch "
                f"dimensions, but grad_output has sizes {list(grad.shape)} with dimension {dim} being empty")
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    output_size = grad.shape[grad.ndim - nd:]
    return jax.vjp(lambda a: adaptive_avg_pool(a, output_size), jnp.zeros(x.shape, acc))[1](grad.astype(acc))[0]


@lowers(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(x, output_size):
    output_size = tuple(output_size)
    _floating_only("max", x, output_size)
    nd = len(output_size)
    lead = x.ndim - nd
    windows, bins = _adaptive_windows(x, output_size, _lowest(x.dtype))
    best = jnp.argmax(windows, axis=-1)
    values = jnp.take_along_axis(windows, best[..., None], axis=-1)[..., 0]
    kmax = [index.shape[1] for index, _ in bins]
    index = jnp.zeros(best.shape, jnp.int64)
    for dim, ((positions, _), stride_in_plane) in enumerate(zip(bins, _plane_strides(x.shape[lead:]))):
        k = (best // math.prod(kmax[dim + 1:])) % kmax[dim]
        o = lax.broadcasted_iota(jnp.int64, best.shape, lead + dim)
        index = index + jnp.asarray(positions)[o, k] * stride_in_plane
    return values, index


def adaptive_max_pool_backward(nd, grad, x, indices):
    return _scatter_planes(grad, indices, x.shape[x.ndim - nd:])


# ---------------------------------------------------------------- max unpool
@lowers(aten.max_unpool2d.default)
def max_unpool2d(x, indices, output_size):
    return _unpool(x, indices, tuple(output_size))


@lowers(aten.max_unpool3d.default)
def max_unpool3d(x, indices, output_size, stride, padding):
    return _unpool(x, indices, tuple(output_size))


def _unpool(x, indices, output_size):
    # NOTE(torch-vs-xla): with duplicate indices PyTorch's CPU loop keeps the last write; XLA's scatter picks any.
    nd = len(output_size)
    lead = x.shape[:x.ndim - nd]
    b = math.prod(lead)
    out = jnp.zeros((b, math.prod(output_size)), x.dtype)
    plane = math.prod(x.shape[len(lead):])  # (no -1 in the reshapes: b may be 0)
    out = out.at[jnp.arange(b)[:, None], indices.reshape(b, plane)].set(x.reshape(b, plane))
    return out.reshape(*lead, *output_size)


for _nd in (2, 3):
    _ops = {
        f"max_pool{_nd}d_with_indices": max_pool_with_indices,
        f"max_pool{_nd}d_with_indices_backward": max_pool_with_indices_backward,
        f"avg_pool{_nd}d": avg_pool,
        f"avg_pool{_nd}d_backward": avg_pool_backward,
        f"_adaptive_avg_pool{_nd}d_backward": adaptive_avg_pool_backward,
        f"adaptive_max_pool{_nd}d_backward": adaptive_max_pool_backward,
    }
    for _name, _fn in _ops.items():
        register(getattr(aten, _name).default, functools.partial(_fn, _nd))


# ---------------------------------------------------------------- fractional max pool
def _fractional_starts(samples, n, o, k):
    """PyTorch's generate_intervals: pseudo-random window starts from a sample in [0, 1), per plane."""
    if o <= 1:
        return jnp.full(samples.shape + (o,), n - k, jnp.int64)
    alpha = jnp.asarray(n - k, samples.dtype) / jnp.asarray(o - 1, samples.dtype)
    i = jnp.arange(o - 1, dtype=samples.dtype)
    starts = ((i + samples[..., None]) * alpha).astype(jnp.int64) - (samples * alpha).astype(jnp.int64)[..., None]
    return jnp.concatenate([starts, jnp.full(samples.shape + (1,), n - k, jnp.int64)], axis=-1)


def fractional_max_pool(nd, x, kernel_size, output_size, random_samples):
    batched = x.ndim == nd + 2
    x4 = x if batched else x[None]
    n, c = x4.shape[:2]
    sizes = x4.shape[2:]
    kernel = _expand(kernel_size, nd)
    output_size = _expand(output_size, nd)
    samples = random_samples[:n].reshape(n, c, nd).astype(x.dtype)  # ATen reads the first N batches
    # The samples are ordered W, H for 2d and T, H, W for 3d (PyTorch's kernels).
    order = (1, 0) if nd == 2 else (0, 1, 2)
    flat = jnp.zeros((n, c) + tuple(output_size) + tuple(kernel), jnp.int64)
    for dim, (size, o, k) in enumerate(zip(sizes, output_size, kernel)):
        positions = _fractional_starts(samples[..., order[dim]], size, o, k)[..., None] + jnp.arange(k)  # (N, C, o, k)
        shape = [n, c] + [1] * (2 * nd)
        shape[2 + dim], shape[2 + nd + dim] = o, k
        flat = flat + positions.reshape(shape) * math.prod(sizes[dim + 1:])
    flat = flat.reshape(n, c, math.prod(output_size), math.prod(kernel))
    windows = jnp.take_along_axis(x4.reshape(n, c, math.prod(sizes)), flat.reshape(n, c, math.prod(flat.shape[2:])),
                                  axis=2).reshape(flat.shape)
    best = jnp.argmax(windows, axis=-1)[..., None]
    values = jnp.take_along_axis(windows, best, axis=-1)[..., 0].reshape((n, c) + tuple(output_size))
    index = jnp.take_along_axis(flat, best, axis=-1)[..., 0].reshape((n, c) + tuple(output_size))
    return (values, index) if batched else (values[0], index[0])


def fractional_max_pool_backward(nd, grad, x, kernel_size, output_size, indices):
    return _scatter_planes(grad, indices, x.shape[x.ndim - nd:])


for _nd in (2, 3):
    register(getattr(aten, f"fractional_max_pool{_nd}d").default, functools.partial(fractional_max_pool, _nd))
    register(getattr(aten, f"fractional_max_pool{_nd}d_backward").default,
             functools.partial(fractional_max_pool_backward, _nd))
