"""Linear algebra products: mm, bmm, addmm, baddbmm, addbmm, addmv, addr, dot, vdot, mv, _int_mm,
_weight_int8pack_mm, distances (cdist, pdist and their backward) and cross products.

Float32 products follow the float32 matmul precision (precision.py): the
key of every program that makes one includes it. Factorizations and solvers
live in factorization.py.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from torch_tpu import precision
from torch_tpu.ops.registry import aten, lowers


def _matmul(a, b, accumulator=False):
    """a @ b with PyTorch's accumulation (float32 for low-precision floats) and the precision policy."""
    return precision.matmul(a, b, accumulator=accumulator)


@lowers(aten.mm.default, precision=True)
def mm(a, b):
    return _matmul(a, b)


@lowers(aten.bmm.default, precision=True)
def bmm(a, b):
    return _matmul(a, b)


@lowers(aten.dot.default, precision=True)
def dot(a, b):
    return _matmul(a, b)


@lowers(aten.vdot.default, precision=True)
def vdot(a, b):
    return _matmul(jnp.conj(a), b)  # conj is the identity on real dtypes


@lowers(aten.mv.default, precision=True)
def mv(a, v):
    return _matmul(a, v)


@lowers(aten.addmm.default, precision=True)
def addmm(x, a, b, beta=1, alpha=1):
    return _scaled(x, _matmul(a, b, accumulator=True), beta, alpha)


@lowers(aten.baddbmm.default, precision=True)
def baddbmm(x, a, b, beta=1, alpha=1):
    return _scaled(x, _matmul(a, b, accumulator=True), beta, alpha)


@lowers(aten.addmv.default, precision=True)
def addmv(x, a, v, beta=1, alpha=1):
    return _scaled(x, _matmul(a, v, accumulator=True), beta, alpha)


@lowers(aten.addr.default, precision=True)
def addr(x, v1, v2, beta=1, alpha=1):
    dtype = jnp.result_type(x.dtype, v1.dtype, v2.dtype)  # PyTorch promotes the three tensors
    if dtype == jnp.bool_:  # ATen's bool rule: (x and beta) or (v1 outer-and v2 and alpha)
        return (x & (jnp.asarray(beta) != 0)) | ((v1[:, None] & v2[None, :]) & (jnp.asarray(alpha) != 0))
    wide = jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype
    product = v1.astype(wide)[:, None] * v2.astype(wide)[None, :]
    return _scaled(x, product, beta, alpha)


@lowers(aten.addbmm.default, precision=True)
def addbmm(x, a, b, beta=1, alpha=1):
    return _scaled(x, jnp.sum(_matmul(a, b, accumulator=True), axis=0), beta, alpha)


# ---------------------------------------------------------------- integer and weight-only quantized products
@lowers(aten._int_mm.default)
def int_mm(a, b):
    """int8 (or uint8) x int8 summed in int32 (torchao's dynamic int8 quantization)."""
    if a.dtype == jnp.uint8:  # the unsigned values as they are: a wider signed operand
        a = a.astype(jnp.int16)
    return lax.dot_general(a, b.astype(a.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)


def _int8pack_meta(x, w, scales):
    """CPU's check of the scales' dtype, which PyTorch's meta kernel leaves out."""
    import torch

    from torch_tpu.runtime.dtypes import scalar_type_name

    torch._check(scales.dtype == x.dtype,
                 lambda: f"expected scalar type {scalar_type_name(x.dtype)} but found {scalar_type_name(scales.dtype)}")
    return aten._weight_int8pack_mm.default(x, w, scales)


@lowers(aten._weight_int8pack_mm.default, precision=True, meta=_int8pack_meta)
def weight_int8pack_mm(x, w, scales):
    """x @ w.T * scales for an int8 weight [N, K] with one scale per output column (torchao's int8 weight-only
    quantization): the weight widened to x's dtype, summed in float32, scaled, rounded once."""
    out = _matmul(x, _mT(w.astype(x.dtype)), accumulator=True)
    return (out * scales.astype(out.dtype)).astype(x.dtype)


def _scaled(x, product, beta, alpha):
    # NOTE(torch-vs-xla): low-precision products arrive in their float32 accumulator: PyTorch adds
    # beta * x before rounding to bfloat16/float16 once (the program casts the result back).
    product = product * jnp.asarray(alpha).astype(product.dtype)
    beta = jnp.asarray(beta).astype(product.dtype)
    # NOTE(torch-vs-xla): with beta == 0 PyTorch ignores x entirely (its NaNs do not propagate).
    return jnp.where(beta == 0, jnp.zeros((), product.dtype), x.astype(product.dtype) * beta) + product


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


# ---------------------------------------------------------------- distances
def _use_mm(p, compute_mode, rows1, rows2):
    # PyTorch's rule: the matmul form of the euclidean distance for p == 2 when it pays.
    if p != 2:
        return False
    if compute_mode == 1:
        return True
    return compute_mode in (None, 0) and (rows1 > 25 or rows2 > 25)


@lowers(aten._cdist_forward.default, precision=True, static_scalars=True)
def cdist_forward(x1, x2, p, compute_mode=None):
    if _use_mm(p, compute_mode, x1.shape[-2], x2.shape[-2]):
        square1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
        square2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
        product = _matmul(x1, _mT(x2))
        return jnp.sqrt(jnp.maximum(square1 - 2 * product + _mT(square2), 0))
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(x1.dtype)
    if p == math.inf:
        return jnp.max(diff, axis=-1, initial=0)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    return jnp.sum(diff**p, axis=-1) ** (1 / p)


@lowers(aten._cdist_backward.default, static_scalars=True)
def cdist_backward(grad, x1, x2, p, dist):
    if x1.size == 0 or x2.size == 0:  # PyTorch's kernel returns zeros shaped like x1 (no batch broadcast)
        return jnp.zeros(x1.shape, x1.dtype)
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    g = grad[..., None]
    d = dist[..., None]
    nonzero = d != 0
    safe = jnp.where(nonzero, d, 1)
    if p == 0:
        term = jnp.zeros_like(diff)
    elif p == 1:
        term = g * jnp.sign(diff)
    elif p == 2:
        term = jnp.where(nonzero, g * diff / safe, 0)
    elif p == math.inf:
        term = g * jnp.sign(diff) * (jnp.abs(diff) == d)
    elif p < 2:
        term = jnp.where(nonzero & (diff != 0), g * jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1), 0)
    else:
        term = jnp.where(nonzero, g * diff * jnp.abs(diff) ** (p - 2) / safe ** (p - 1), 0)
    return jnp.sum(term, axis=-2)


@functools.cache
def _pairs(n):
    import numpy as np

    return tuple(np.triu_indices(n, 1))


@lowers(aten._pdist_forward.default, static_scalars=True)
def pdist_forward(x, p=2.0):
    n = x.shape[0]
    if n < 2:
        return jnp.zeros((0,), x.dtype)
    full = cdist_forward(x, x, p, 2)  # compute_mode 2: never the matmul form (exact zeros on the diagonal)
    i, j = _pairs(n)
    return full[i, j]


@lowers(aten._pdist_backward.default, static_scalars=True)
def pdist_backward(grad, x, p, pdist):
    n = x.shape[0]
    if n < 2:
        return jnp.zeros_like(x)
    i, j = _pairs(n)
    g = jnp.zeros((n, n), grad.dtype).at[i, j].set(grad).at[j, i].set(grad)
    d = jnp.zeros((n, n), pdist.dtype).at[i, j].set(pdist).at[j, i].set(pdist)
    return cdist_backward(g, x, x, p, d)


@lowers(aten.linalg_cross.default)  # (no promote=: it would hand us bfloat16 already widened)
def linalg_cross(a, b, dim=-1):
    common = jnp.result_type(a, b)
    a, b = jnp.broadcast_arrays(a.astype(common), b.astype(common))
    dim = dim % a.ndim
    # PyTorch's CPU kernel rounds each product to the (low-precision) dtype before subtracting:
    # compute in float32 with explicit roundings (XLA would otherwise keep excess precision).
    r = functools.partial(_rounded, like=a.dtype)
    if a.dtype in (jnp.bfloat16, jnp.float16):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    a0, a1, a2 = (lax.index_in_dim(a, i, dim) for i in range(3))
    b0, b1, b2 = (lax.index_in_dim(b, i, dim) for i in range(3))
    return jnp.concatenate(
        [r(r(a1 * b2) - r(a2 * b1)), r(r(a2 * b0) - r(a0 * b2)), r(r(a0 * b1) - r(a1 * b0))], axis=dim)


def _rounded(x, like):
    if like == jnp.bfloat16:
        return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    if like == jnp.float16:
        return lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)
    return x
