"""Reflection and replication padding (F.pad modes "reflect" and "replicate") and their backward.

Constant padding is `constant_pad_nd` (ops/shape.py); circular padding is
CompositeImplicitAutograd in PyTorch (slices and cat). Each padded dim is a
gather with host-computed source positions; the backward is its transpose.
Negative padding crops, as in PyTorch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from torch_tpu.ops.registry import aten, register


def _sources(n, before, after, mode):
    position = np.arange(-before, n + after)
    if mode == "reflect":
        position = (n - 1) - np.abs((n - 1) - np.abs(position))
    return np.clip(position, 0, n - 1)


def _pad(mode, nd, x, padding):
    # padding is (left, right) pairs starting from the last dim.
    for dim in range(nd):
        axis = x.ndim - 1 - dim
        before, after = padding[2 * dim], padding[2 * dim + 1]
        x = jnp.take(x, jnp.asarray(_sources(x.shape[axis], before, after, mode)), axis=axis)
    return x


def _pad_backward(mode, nd, grad, x, padding):
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    forward = functools.partial(_pad, mode, nd, padding=padding)
    return jax.vjp(forward, jnp.zeros(x.shape, acc))[1](grad.astype(acc))[0]


for _mode, _prefix in (("reflect", "reflection"), ("replicate", "replication")):
    for _nd in (1, 2, 3):
        register(getattr(aten, f"{_prefix}_pad{_nd}d").default, functools.partial(_pad, _mode, _nd))
        register(getattr(aten, f"{_prefix}_pad{_nd}d_backward").default, functools.partial(_pad_backward, _mode, _nd))
