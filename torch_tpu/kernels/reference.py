"""Plain-JAX references of the bundled kernels: the semantics the kernels are tested against.

Also what `torch_tpu.kernels` runs when Tokamax is not installed (`implementation="reference"`).
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu import precision


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, window=None, soft_cap=None):
    """Softmax attention on (batch, heads, seq, head_dim); fewer key/value heads than query heads is GQA.

    `window=(before, after)`: query i sees keys i-before .. i+after. Products in float32.
    """
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads != kv_heads:
        k, v = (jnp.repeat(t, heads // kv_heads, axis=-3) for t in (k, v))
    scale = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    s = precision.einsum("...qd,...kd->...qk", q, k, accumulator=True).astype(jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    qi = jnp.arange(s.shape[-2])[:, None]
    ki = jnp.arange(s.shape[-1])[None, :]
    allowed = jnp.ones(s.shape[-2:], bool)
    if causal:
        allowed &= ki <= qi
    if window is not None:
        before, after = window
        allowed &= (ki >= qi - before) & (ki <= qi + after)
    s = jnp.where(allowed, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = jnp.where(total > 0, p / jnp.where(total > 0, total, 1), 0)
    out = precision.einsum("...qk,...kd->...qd", p.astype(v.dtype) if v.dtype != jnp.float32 else p, v,
                           accumulator=True)
    return out.astype(q.dtype)


def group_ids(group_sizes, rows: int):
    """The group of each of `rows` rows (rows past the last group get len(group_sizes): no group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(rows), side="right")


def grouped_matmul(x, w, group_sizes, *, out_dtype=None):
    """x [m, k] @ w[g] [k, n] for the rows of group g (rows sorted by group): [m, n]; rows in no group are 0."""
    ids = group_ids(group_sizes, x.shape[0])
    one_hot = (ids[:, None] == jnp.arange(w.shape[0])[None, :]).astype(jnp.float32)  # [m, g]
    every = precision.einsum("mk,gkn->gmn", x, w, accumulator=True).astype(jnp.float32)
    out = jnp.einsum("mg,gmn->mn", one_hot, every)
    return out.astype(out_dtype or x.dtype)
