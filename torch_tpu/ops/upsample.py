"""Interpolation (F.interpolate / nn.Upsample): nearest, nearest-exact, (bi/tri)linear, bicubic, antialiased; backward.

Every mode is separable: along each spatial dim, output position i reads a
few input positions (taps) with fixed weights. Taps and weights depend only on
sizes, scales and align_corners (static), so they are computed on the host
with PyTorch's own formulas and arithmetic precision (float32 for float32
inputs), and the program is a gather plus a weighted sum per dim. The backward
is the transpose of that linear map (a scatter-add).

The `.vec` overloads (what F.interpolate calls) are CompositeImplicitAutograd:
they compute output sizes and call the overloads lowered here.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from torch_tpu.ops.registry import aten, register
from torch_tpu.runtime import dtypes

_CUBIC_A = -0.75  # PyTorch's bicubic (as OpenCV); the antialiased filter uses Keys' -0.5


def _scale(n_in, n_out, align_corners, scale, dt):
    """area_pixel_compute_scale: input units per output unit."""
    if align_corners:
        return dt(n_in - 1) / dt(n_out - 1) if n_out > 1 else dt(0)
    return dt(1.0 / scale) if scale is not None and scale > 0 else dt(n_in) / dt(n_out)


def _nearest_taps(n_in, n_out, scale, exact, dt):
    i = np.arange(n_out)
    if not exact and n_out == n_in:
        index = i
    elif not exact and n_out == 2 * n_in:
        index = i >> 1
    else:
        s = np.float32(1.0 / scale) if scale is not None and scale > 0 else np.float32(n_in) / np.float32(n_out)
        position = (i.astype(np.float32) + np.float32(0.5)) * s if exact else i.astype(np.float32) * s
        index = np.minimum(np.floor(position).astype(np.int64), n_in - 1)
    return index[:, None], None


def _linear_taps(n_in, n_out, align_corners, scale, dt):
    s = _scale(n_in, n_out, align_corners, scale, dt)
    i = np.arange(n_out).astype(dt)
    real = s * i if align_corners else np.maximum(s * (i + dt(0.5)) - dt(0.5), dt(0))
    index = np.minimum(np.floor(real).astype(np.int64), n_in - 1)
    lam = np.clip(real - index.astype(dt), dt(0), dt(1))
    upper = index + (index < n_in - 1)
    return np.stack([index, upper], 1), np.stack([dt(1) - lam, lam], 1)


def _cubic1(x, a):
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _cubic2(x, a):
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def _cubic_taps(n_in, n_out, align_corners, scale, dt):
    s = _scale(n_in, n_out, align_corners, scale, dt)
    i = np.arange(n_out).astype(dt)
    real = s * i if align_corners else s * (i + dt(0.5)) - dt(0.5)
    floor = np.floor(real)
    t = real - floor
    a = dt(_CUBIC_A)
    weights = np.stack([_cubic2(t + 1, a), _cubic1(t, a), _cubic1(1 - t, a), _cubic2(2 - t, a)], 1).astype(dt)
    index = np.clip(floor.astype(np.int64)[:, None] - 1 + np.arange(4)[None, :], 0, n_in - 1)
    return index, weights


def _aa_filter(kind, x):
    x = np.abs(x)
    if kind == "linear":
        return np.where(x < 1, 1 - x, 0)
    a = -0.5
    return np.where(x < 1, _cubic1(x, a), np.where(x < 2, _cubic2(x, a), 0))


def _aa_taps(kind, n_in, n_out, align_corners, scale, dt):
    """Antialiased taps (PIL-style): the filter widens by the scale when downsampling."""
    s = _scale(n_in, n_out, align_corners, scale, dt)
    interp = 2 if kind == "linear" else 4
    support = dt(interp * 0.5) * s if s >= 1 else dt(interp * 0.5)
    max_taps = int(math.ceil(support)) * 2 + 1
    inv = dt(1) / s if s >= 1 else dt(1)
    index = np.zeros((n_out, max_taps), np.int64)
    weights = np.zeros((n_out, max_taps), dt)
    for i in range(n_out):
        center = s * dt(i + 0.5)
        lo = max(int(center - support + dt(0.5)), 0)
        size = min(max(min(int(center + support + dt(0.5)), n_in) - lo, 0), max_taps)
        j = np.arange(size)
        w = _aa_filter(kind, (j + lo - center + dt(0.5)) * inv).astype(dt)
        total = w.sum(dtype=dt)
        if total != 0:
            w = w / total
        index[i, :size] = lo + j
        weights[i, :size] = w
    return index, weights


def _interpolate(x, taps, acc):
    """Apply per-dim (index (out, T), weights (out, T) or None) to the last len(taps) dims, last dim first."""
    lead = x.ndim - len(taps)
    for dim in reversed(range(len(taps))):
        axis = lead + dim
        index, weights = taps[dim]
        gathered = jnp.take(x, jnp.asarray(index.reshape(-1)), axis=axis)
        gathered = gathered.reshape(x.shape[:axis] + index.shape + x.shape[axis + 1:])
        if weights is None:
            x = jnp.squeeze(gathered, axis + 1)
        else:
            w = jnp.asarray(weights, acc).reshape(weights.shape + (1,) * (x.ndim - axis - 1))
            x = jnp.sum(gathered.astype(acc) * w, axis=axis + 1)
    return x


def _dtypes(x):
    acc = x.dtype if x.dtype in (jnp.float32, jnp.float64) else jnp.float32
    return acc, (np.float64 if acc == jnp.float64 else np.float32)


# ATen's CPU kernels: floating types, and uint8 (images) for nearest and the 2-d bilinear/bicubic modes,
# computed in float and rounded back into [0, 255]. Other dtypes raise its dispatch error.
_KERNEL_NAMES = {"nearest": "compute_indices_weights_nearest", "nearest-exact": "compute_indices_weights_nearest",
                 "linear": "compute_indices_weights_linear", "cubic": "compute_indices_weights_cubic",
                 "aa-linear": "compute_index_ranges_weights", "aa-cubic": "compute_index_ranges_weights"}
_KERNEL_NAMES_2D = {"nearest": "upsample_nearest2d_channels_last", "nearest-exact": "upsample_nearest2d_channels_last",
                    "linear": "upsample_bilinear2d_channels_last"}


def _check_dtype(mode, nd, dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return
    if dtype == jnp.uint8 and (mode in ("nearest", "nearest-exact") or nd == 2):
        return
    name = (_KERNEL_NAMES_2D.get(mode) if nd == 2 else None) or _KERNEL_NAMES[mode]
    raise dtypes.not_implemented(name, dtypes.to_torch(dtype))


def _taps_for(mode, sizes_in, sizes_out, align_corners, scales, dt):
    taps = []
    for n_in, n_out, scale in zip(sizes_in, sizes_out, scales):
        if mode in ("nearest", "nearest-exact"):
            taps.append(_nearest_taps(n_in, n_out, scale, mode == "nearest-exact", dt))
        elif mode == "linear":
            taps.append(_linear_taps(n_in, n_out, align_corners, scale, dt))
        elif mode == "cubic":
            taps.append(_cubic_taps(n_in, n_out, align_corners, scale, dt))
        else:  # "aa-linear" / "aa-cubic"
            taps.append(_aa_taps(mode[3:], n_in, n_out, align_corners, scale, dt))
    return taps


def _forward(mode, nd, x, output_size, align_corners, scales):
    _check_dtype(mode, nd, x.dtype)
    acc, dt = _dtypes(x)
    taps = _taps_for(mode, x.shape[x.ndim - nd:], tuple(output_size), align_corners, scales, dt)
    out = _interpolate(x, taps, acc)
    if x.dtype == jnp.uint8 and out.dtype != jnp.uint8:  # a weighted mode: round to the nearest byte
        return jnp.clip(jnp.round(out), 0, 255).astype(jnp.uint8)
    return out


def _backward(mode, nd, grad, output_size, input_size, align_corners, scales):
    acc, _ = _dtypes(grad)
    forward = functools.partial(_forward, mode, nd, output_size=output_size, align_corners=align_corners,
                                scales=scales)
    return jax.vjp(forward, jnp.zeros(tuple(input_size), acc))[1](grad.astype(acc))[0]


def _nearest(mode, nd):
    def forward(x, output_size, *scales):
        return _forward(mode, nd, x, output_size, False, _scales(scales, nd))

    def backward(grad, output_size, input_size, *scales):
        return _backward(mode, nd, grad, output_size, input_size, False, _scales(scales, nd))

    return forward, backward


def _interpolating(mode, nd):
    def forward(x, output_size, align_corners, *scales):
        return _forward(mode, nd, x, output_size, align_corners, _scales(scales, nd))

    def backward(grad, output_size, input_size, align_corners, *scales):
        return _backward(mode, nd, grad, output_size, input_size, align_corners, _scales(scales, nd))

    return forward, backward


def _scales(scales, nd):
    return tuple(scales) + (None,) * (nd - len(scales))


_OPS = {
    "upsample_nearest1d": (_nearest, "nearest", 1),
    "upsample_nearest2d": (_nearest, "nearest", 2),
    "upsample_nearest3d": (_nearest, "nearest", 3),
    "_upsample_nearest_exact1d": (_nearest, "nearest-exact", 1),
    "_upsample_nearest_exact2d": (_nearest, "nearest-exact", 2),
    "_upsample_nearest_exact3d": (_nearest, "nearest-exact", 3),
    "upsample_linear1d": (_interpolating, "linear", 1),
    "upsample_bilinear2d": (_interpolating, "linear", 2),
    "upsample_trilinear3d": (_interpolating, "linear", 3),
    "upsample_bicubic2d": (_interpolating, "cubic", 2),
    "_upsample_bilinear2d_aa": (_interpolating, "aa-linear", 2),
    "_upsample_bicubic2d_aa": (_interpolating, "aa-cubic", 2),
}

for _name, (_make, _mode, _nd) in _OPS.items():
    _forward_fn, _backward_fn = _make(_mode, _nd)
    register(getattr(aten, _name).default, _forward_fn)
    register(getattr(aten, _name + "_backward").default, _backward_fn)
