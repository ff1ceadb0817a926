"""Fourier transforms: the three ATen FFT primitives every `torch.fft` function reduces to.

`_fft_r2c` (real -> complex, optionally one-sided), `_fft_c2c` and `_fft_c2r`
(one-sided complex -> real). PyTorch's Python-level `torch.fft.*` functions
(fft, rfft2, ihfftn, stft, ...) and their backward formulas decompose into
these, so lowering the three covers the family. `normalization` is PyTorch's
fft_norm_mode: 0 = none, 1 = 1/sqrt(n), 2 = 1/n, applied to the transform as
given (the caller picks which direction is scaled).

NOTE(torch-vs-xla): XLA transforms at most 3 dimensions at a time; jnp.fft
splits larger transforms. TPUs compute complex64 FFTs in float32.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers


def _scale(x, sizes, normalization):
    n = math.prod(sizes)
    if normalization == 0 or n == 0:
        return x
    factor = 1 / math.sqrt(n) if normalization == 1 else 1 / n
    return x * jnp.asarray(factor, x.real.dtype)


def _complex(x):
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return x
    return x.astype(jnp.complex128 if x.dtype == jnp.float64 else jnp.complex64)


@lowers(aten._fft_r2c.default)
def fft_r2c(x, dim, normalization, onesided):
    dim = tuple(d % x.ndim for d in dim)
    sizes = [x.shape[d] for d in dim]
    if onesided:
        out = jnp.fft.rfftn(x, axes=dim)
    else:
        out = jnp.fft.fftn(_complex(x), axes=dim)
    return _scale(out, sizes, normalization)


@lowers(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    if not dim:
        return x
    dim = tuple(d % x.ndim for d in dim)
    sizes = [x.shape[d] for d in dim]
    # norm="forward" makes the inverse unnormalised: the scale is applied here, once.
    out = jnp.fft.fftn(x, axes=dim) if forward else jnp.fft.ifftn(x, axes=dim, norm="forward")
    return _scale(out, sizes, normalization)


@lowers(aten._fft_c2r.default)
def fft_c2r(x, dim, normalization, last_dim_size):
    dim = tuple(d % x.ndim for d in dim)
    sizes = [x.shape[d] for d in dim[:-1]] + [last_dim_size]
    # PyTorch ignores the imaginary parts that a Hermitian input makes redundant; so does irfftn.
    out = jnp.fft.irfftn(x, s=sizes, axes=dim, norm="forward")
    return _scale(out, sizes, normalization)
