"""Ops that move values without computing on them: copy, clone, cat, stack, flip, pad...

(Pure metadata views never get here: they reuse PyTorch's CPU kernels on
tpu tensors. These ops produce new storages.)
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers


@lowers(aten.copy.default)
def copy(x, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(x.dtype), x.shape)


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
    return jnp.flip(x, axis=tuple(dims)) if dims else x


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
