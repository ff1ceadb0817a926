"""Matrix products: mm, bmm, addmm, baddbmm, dot, mv.

Float32 products follow the float32 matmul precision (precision.py): the
key of every program here includes it.
"""
from __future__ import annotations

import jax.numpy as jnp

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


@lowers(aten.addbmm.default, precision=True)
def addbmm(x, a, b, beta=1, alpha=1):
    return _scaled(x, jnp.sum(_matmul(a, b, accumulator=True), axis=0), beta, alpha)


def _scaled(x, product, beta, alpha):
    # NOTE(torch-vs-xla): low-precision products arrive in their float32 accumulator: PyTorch adds
    # beta * x before rounding to bfloat16/float16 once (the program casts the result back).
    product = product * jnp.asarray(alpha).astype(product.dtype)
    beta = jnp.asarray(beta).astype(product.dtype)
    # NOTE(torch-vs-xla): with beta == 0 PyTorch ignores x entirely (its NaNs do not propagate).
    return jnp.where(beta == 0, jnp.zeros((), product.dtype), x.astype(product.dtype) * beta) + product
