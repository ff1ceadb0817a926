"""torch._grouped_mm (mixture-of-experts matmuls; transformers' grouped experts path).

`offs` holds the cumulative end of each group along the ragged dimension (int32):
- 2-D x 3-D: rows of `self` in groups, one `mat2[g]` per group -> [m, n] (the MoE forward);
- 2-D x 2-D: the contracted dimension in groups -> [g, m, n] (the weight gradient);
- 3-D x 2-D: columns of `mat2` in groups, one `self[g]` per group -> [m, n];
- 3-D x 3-D: a batched matmul (no offs).
Rows/columns past the last offset are zeros. The 2-D x 3-D form is XLA's ragged dot, or
Tokamax's ragged_dot kernel where the routing policy sends PyTorch ops to the bundled kernels
(kernels/routing.py). Products follow the float32 matmul precision.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from torch_tpu import precision
from torch_tpu.ops.registry import aten, lowers


def _ids(offs, length):
    """The group of each index along the ragged dimension (len(offs): past the last group)."""
    return jnp.searchsorted(offs.astype(jnp.int32), jnp.arange(length, dtype=jnp.int32), side="right")


def _ragged_rows(a, b, offs):
    from torch_tpu.kernels import routing

    sizes = jnp.diff(offs.astype(jnp.int32), prepend=jnp.zeros((1,), jnp.int32))
    if routing.use_kernels():
        from torch_tpu.kernels.attention import have_tokamax, tokamax

        if have_tokamax():
            return tokamax().ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)
    return precision._product(jax.lax.ragged_dot, a, b, sizes, accumulator=True)


def _meta(a, b, offs=None, bias=None, out_dtype=None):
    """PyTorch's meta kernel checks CUDA's bf16-only limit; tpu (like CPU) takes every float dtype."""
    import torch

    torch._check(a.dtype == b.dtype, lambda: f"Expected mat_a and mat_b of one dtype, got {a.dtype} and {b.dtype}")
    torch._check(a.dtype.is_floating_point, lambda: f"torch._grouped_mm: expected float inputs, got {a.dtype}")
    bf16 = torch.bfloat16
    out = aten._grouped_mm.default(a.to(bf16), b.to(bf16), offs, None if bias is None else bias.to(bf16))
    return out.to(out_dtype or a.dtype)


@lowers(aten._grouped_mm.default, precision=True, meta=_meta)
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    if a.ndim == 3 and b.ndim == 3:
        out = precision.matmul(a, b, accumulator=True)
    elif offs is None:
        raise ValueError("torch._grouped_mm: offs is required unless both operands are 3-D")
    elif a.ndim == 2 and b.ndim == 3:
        out = _ragged_rows(a, b, offs)
    elif a.ndim == 2 and b.ndim == 2:  # groups along the contraction: [g, m, n]
        mask = (_ids(offs, a.shape[1])[None, :] == jnp.arange(offs.shape[0])[:, None])  # [g, k]
        parts = jnp.where(mask[:, None, :], a[None], jnp.zeros((), a.dtype))  # [g, m, k]
        out = precision.matmul(parts, b, accumulator=True)
    else:  # 3-D x 2-D: groups along mat2's columns
        ids = _ids(offs, b.shape[1])
        every = precision.matmul(a, b, accumulator=True)  # [g, m, n]
        mask = ids[None, :] == jnp.arange(offs.shape[0])[:, None]  # [g, n]
        out = jnp.sum(jnp.where(mask[:, None, :], every, jnp.zeros((), every.dtype)), axis=0)
    if bias is not None:
        out = out + bias.astype(out.dtype)
    return out
