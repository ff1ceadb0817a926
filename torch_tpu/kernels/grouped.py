"""Grouped (ragged) matmul for mixture-of-experts: Tokamax's `ragged_dot`, bound through `jax_op`.

`x` [m, k] holds the tokens sorted by expert, `w` [g, k, n] one matrix per expert,
`group_sizes` [g] how many consecutive rows each expert takes. Tokamax runs its Pallas
kernel where one compiles and XLA's ragged dot elsewhere.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torch_tpu import precision as precision_policy
from torch_tpu.kernels import reference
from torch_tpu.kernels.attention import have_tokamax, tokamax
from torch_tpu.pallas import jax_op


def ragged_dot(x, w, group_sizes, *, implementation="auto"):
    """The JAX function: [m, k] x [g, k, n] with per-group rows -> [m, n] in x's dtype (float32 accumulation)."""
    group_sizes = group_sizes.astype(jnp.int32)
    if implementation == "reference":
        return reference.grouped_matmul(x, w, group_sizes)
    if implementation == "xla" or not have_tokamax():
        out = precision_policy._product(jax.lax.ragged_dot, x, w, group_sizes, accumulator=True)
        return out.astype(x.dtype)
    out = tokamax().ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32,
                             implementation=None if implementation == "auto" else implementation)
    return out.astype(x.dtype)


@jax_op("tpu_kernels::grouped_matmul", vjp=True)
def _grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, implementation: str = "auto") -> jax.Array:
    return ragged_dot(x, w, group_sizes, implementation=implementation)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *,
                   implementation: str = "auto") -> torch.Tensor:
    """x [m, k] (rows sorted by group) times w [g, k, n] per group of `group_sizes` [g] rows: [m, n]."""
    if x.dim() != 2 or w.dim() != 3 or group_sizes.dim() != 1 or group_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_matmul expects x [m, k], w [g, k, n], group_sizes [g]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(group_sizes.shape)}")
    if group_sizes.dtype.is_floating_point:
        raise TypeError("grouped_matmul: group_sizes must be an integer tensor")
    return _grouped_matmul(x, w, group_sizes, implementation)
