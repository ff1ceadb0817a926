"""F.grid_sample: sampling an input at grid coordinates (2d and 3d), and its backward.

Modes: bilinear/trilinear, nearest, bicubic (2d); padding zeros, border,
reflection; align_corners. Coordinates follow PyTorch's
grid_sampler_compute_source_index; out-of-range taps read zero. The backward
(input and grid gradients) is the transpose of this function (jax.vjp); the
clip/reflect steps give the same piecewise derivatives as PyTorch's kernels
(nearest sampling has a zero grid gradient in both).
"""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2
_CUBIC_A = -0.75


def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(coord, size):
    return jnp.clip(coord, 0, size - 1)


def _reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad_coordinates(coord, size, padding_mode, align_corners):
    if padding_mode == _BORDER:
        return _clip(coord, size)
    if padding_mode == _REFLECTION:
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
        return _clip(coord, size)
    return coord


def _read(flat_input, sizes, taps):
    """Values at integer tap coordinates (one (N, P) array per spatial dim, outermost first); zero outside."""
    inside = jnp.ones(taps[0].shape, bool)
    index = jnp.zeros(taps[0].shape, jnp.int32)
    for tap, size, stride in zip(taps, sizes, [math.prod(sizes[i + 1:]) for i in range(len(sizes))]):
        inside = inside & (tap >= 0) & (tap <= size - 1)
        index = index + jnp.clip(tap, 0, size - 1).astype(jnp.int32) * stride
    values = jnp.take_along_axis(flat_input, index[:, None, :], axis=2)  # (N, C, P)
    return jnp.where(inside[:, None, :], values, 0)


def _cubic_weights(t):
    a = _CUBIC_A
    w0 = ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a
    w1 = ((a + 2) * t - (a + 3)) * t * t + 1
    w2 = ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1
    w3 = ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a
    return (w0, w1, w2, w3)


def _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners):
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    nd = len(sizes)
    out_shape = grid.shape[1:-1]
    flat = x.reshape(n, c, -1)
    g = grid.reshape(n, -1, nd)
    # grid[..., 0] indexes the last (W) dim: reverse to outermost-first.
    raw = [_unnormalize(g[..., nd - 1 - d], sizes[d], align_corners) for d in range(nd)]
    if interpolation_mode == _BICUBIC:
        floors = [jnp.floor(r) for r in raw]
        weights = [_cubic_weights(r - f) for r, f in zip(raw, floors)]
        out = 0
        for offsets in itertools.product(range(4), repeat=nd):
            taps = [_pad_coordinates(f - 1 + o, size, padding_mode, align_corners)
                    for f, o, size in zip(floors, offsets, sizes)]
            w = math.prod(weights[d][o] for d, o in enumerate(offsets))
            out = out + _read(flat, sizes, taps) * w[:, None, :]
        return out.reshape((n, c) + out_shape)
    coords = [_pad_coordinates(r, size, padding_mode, align_corners) for r, size in zip(raw, sizes)]
    if interpolation_mode == _NEAREST:
        return _read(flat, sizes, [jnp.round(co) for co in coords]).reshape((n, c) + out_shape)
    lows = [jnp.floor(co) for co in coords]
    out = 0
    for corner in itertools.product((0, 1), repeat=nd):
        taps = [low + bit for low, bit in zip(lows, corner)]
        w = math.prod(jnp.where(bit, co - low, low + 1 - co) for co, low, bit in zip(coords, lows, corner))
        out = out + _read(flat, sizes, taps) * w[:, None, :]
    return out.reshape((n, c) + out_shape)


def _acc(x):
    return jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype


@lowers(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    if not jnp.issubdtype(x.dtype, jnp.floating):  # ATen's kernels dispatch floating types only
        raise dtypes.not_implemented(f"grid_sampler_{x.ndim - 2}d_tpu", dtypes.to_torch(x.dtype))
    acc = _acc(x)
    return _grid_sample(x.astype(acc), grid.astype(acc), interpolation_mode, padding_mode, align_corners)


@lowers(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    acc = _acc(x)
    _, vjp = jax.vjp(lambda a, g: _grid_sample(a, g, interpolation_mode, padding_mode, align_corners),
                     x.astype(acc), grid.astype(acc))
    grad_input, grad_grid = vjp(grad.astype(acc))
    return (grad_input if output_mask[0] else None), grad_grid
