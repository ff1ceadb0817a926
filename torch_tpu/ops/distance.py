"""F.pdist: p-norm distances between every pair of rows, and its backward.

NOTE(torch-vs-xla): torch.cdist's kernels (`_cdist_forward`/`_cdist_backward`)
are left to the operator-coverage families; its p=2 large-input path is
`_euclidean_dist`, a composite of matmuls.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from torch_tpu.ops.registry import aten, lowers


def _pairs(n):
    return np.triu_indices(n, 1)


def _norm(diff, p):
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=-1)
    if p == float("inf"):
        return jnp.max(a, axis=-1)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    return jnp.sum(a ** p, axis=-1) ** (1.0 / p)


def _norm_grad(diff, dist, p):
    """d dist / d diff, PyTorch's conventions: zero where the distance is zero (and for p=0)."""
    d = dist[..., None]
    zero = jnp.zeros((), diff.dtype)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return jnp.sign(diff)
    if p == float("inf"):
        return jnp.where(jnp.abs(diff) == d, jnp.sign(diff), zero)
    safe = jnp.where(d == 0, 1, d)
    if p == 2:
        return jnp.where(d == 0, zero, diff / safe)
    if p < 1:
        # NOTE(torch-vs-xla): PyTorch's formula, including its 0 where a coordinate difference is 0.
        return jnp.where((d == 0) | (diff == 0), zero, jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1))
    return jnp.where(d == 0, zero, diff * jnp.abs(diff) ** (p - 2) / safe ** (p - 1))


@lowers(aten._pdist_forward.default, static_scalars=True)
def pdist_forward(x, p=2):
    i, j = _pairs(x.shape[0])
    return _norm(x[i] - x[j], p)


@lowers(aten._pdist_backward.default, static_scalars=True)
def pdist_backward(grad, x, p, pdist):
    i, j = _pairs(x.shape[0])
    contribution = _norm_grad(x[i] - x[j], pdist, p) * grad[:, None]
    return jnp.zeros_like(x).at[i].add(contribution).at[j].add(-contribution)
