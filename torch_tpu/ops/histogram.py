"""Histograms: histc, histogram, histogramdd (bin counts are static: no synchronisation).

The data's range (when no range is given) is computed inside the program;
only the number of bins shapes the result.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from torch_tpu.ops import checks
from torch_tpu.ops.checks import checked
from torch_tpu.ops.registry import aten, lowers


def _isnan(v):
    return jnp.isnan(v) if jnp.issubdtype(v.dtype, jnp.inexact) else jnp.zeros(v.shape, jnp.bool_)


@lowers(aten.histc.default, static_scalars=True)
@checked
def histc(x, bins=100, min=0, max=0):
    a = x.reshape(-1)
    if min != max and not (math.isfinite(min) and math.isfinite(max)):  # a given range: raised at the call
        raise RuntimeError(f"torch.histc: range of [{min:g}, {max:g}] is not finite")
    lo = jnp.asarray(min, a.dtype)
    hi = jnp.asarray(max, a.dtype)
    if min == max:  # PyTorch: the data's own range (values, not shapes: stays in the program)
        lo, hi = jnp.min(a), jnp.max(a)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    checks.require(jnp.isfinite(lo) & jnp.isfinite(hi), checks.HISTC_RANGE, checks.float_bits(lo),
                   size=checks.float_bits(hi))
    width = (hi - lo).astype(a.dtype)
    position = ((a - lo) / width * bins).astype(jnp.int64)  # PyTorch's formula, same rounding
    position = jnp.where(a == hi, bins - 1, position)
    inside = (a >= lo) & (a <= hi) & ~_isnan(a)
    return jnp.zeros((bins,), a.dtype).at[jnp.where(inside, position, bins)].add(
        jnp.ones_like(a), mode="drop")


def _linspace(start, end, steps, dtype):
    """PyTorch's linspace: the first half stepped from start, the second half back from end."""
    i = jnp.arange(steps, dtype=dtype)
    step = (end - start) / max(steps - 1, 1)
    return jnp.where(i < steps // 2, start + step * i, end - step * (steps - 1 - i)).astype(dtype)


def _outer_edges(column, range_pair):
    """(leftmost, rightmost) edges of one dimension: the given range or the data's, widened if empty."""
    if range_pair is not None:
        lo, hi = jnp.asarray(range_pair[0], column.dtype), jnp.asarray(range_pair[1], column.dtype)
    elif column.shape[0] == 0:
        lo, hi = jnp.asarray(0, column.dtype), jnp.asarray(1, column.dtype)
    else:
        lo, hi = jnp.min(column), jnp.max(column)
    same = lo == hi
    return jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)


def _points(x):
    """x as (N, D): the last dimension holds the coordinates (1-D input: D = 1)."""
    return x.reshape(-1, 1) if x.ndim <= 1 else x.reshape(-1, x.shape[-1])


def _ranges(range_list, dims):
    if range_list is None:
        return [None] * dims
    return [(range_list[2 * d], range_list[2 * d + 1]) for d in range(dims)]


def _bin_edges(points, bins, range_list):
    return [
        _linspace(*_outer_edges(points[:, d], r), bins[d] + 1, points.dtype)
        for d, r in enumerate(_ranges(range_list, points.shape[1]))
    ]


def _histogramdd(points, edges, weight, density):
    """Counts (or weight sums) of points in the bins given by per-dimension edges."""
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros(points.shape[0], jnp.int64)
    inside = jnp.ones(points.shape[0], jnp.bool_)
    for d, e in enumerate(edges):
        value = points[:, d]
        position = jnp.searchsorted(e, value, side="right") - 1
        position = jnp.where(value == e[-1], shape[d] - 1, position)  # the last edge closes the last bin
        inside &= (value >= e[0]) & (value <= e[-1]) & ~_isnan(value)
        flat = flat * shape[d] + jnp.clip(position, 0, shape[d] - 1)
    w = jnp.ones(points.shape[0], points.dtype) if weight is None else weight.reshape(-1).astype(points.dtype)
    size = 1
    for s in shape:
        size *= s
    hist = jnp.zeros((size,), points.dtype).at[jnp.where(inside, flat, size)].add(w, mode="drop").reshape(shape)
    if density:
        volume = jnp.ones((), points.dtype)
        for d, e in enumerate(edges):
            widths = (e[1:] - e[:-1]).reshape((1,) * d + (-1,) + (1,) * (len(edges) - d - 1))
            volume = volume * widths
        hist = hist / (jnp.sum(hist) * volume)
    return hist


@lowers(aten.histogram.bin_ct)
def histogram_bin_ct(x, bins=100, range=None, weight=None, density=False):
    points = _points(x.reshape(-1))
    edges = _bin_edges(points, [bins], range)
    return _histogramdd(points, edges, weight, density), edges[0]


@lowers(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, weight=None, density=False):
    return _histogramdd(_points(x.reshape(-1)), [bins.astype(x.dtype)], weight, density), bins


@lowers(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, range=None, weight=None, density=False):
    return _bin_edges(_points(x), bins, range)


@lowers(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(x, bins, range=None, weight=None, density=False):
    points = _points(x)
    return _histogramdd(points, _bin_edges(points, bins, range), weight, density)


@lowers(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, weight=None, density=False):
    return _histogramdd(_points(x), [b.astype(x.dtype) for b in bins], weight, density)
