"""torch._scaled_mm: float8 matmuls with float32 scales (torchao's Float8Linear, TorchTitan's float8).

`out = (self @ mat2) * scale_a * scale_b (+ bias)`, cast to `out_dtype` (default: self's dtype). Scales
are tensorwise (one float32 each) or rowwise (`scale_a` [M, 1], `scale_b` [1, N]), the two forms CPU takes.
Every float8 value is exact in bfloat16 and their products are exact in float32, so the product is a
bfloat16 dot accumulated in float32 whatever the float32 matmul precision; the scales multiply the
accumulated result, as a float8 matrix unit applies them (CPU's kernel scales the operands first:
the same numbers up to float32 rounding). A float8 result saturates like c10's conversion.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch

from torch_tpu import precision
from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _meta(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """CPU's checks and messages (PyTorch's meta kernel checks CUDA's layout and size-16 limits on
    "cuda", "xpu" and "cpu" only, and no scale form at all elsewhere)."""
    torch._check(a.dim() == 2, lambda: "mat1 must be a matrix")
    torch._check(b.dim() == 2, lambda: "mat2 must be a matrix")
    m, k, n = a.size(0), a.size(1), b.size(1)
    torch._check(k == b.size(0), lambda: f"mat_a and mat_b shapes cannot be multiplied ({m}x{k} and {b.size(0)}x{n})")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    torch._check_value(a.dtype in _FLOAT8 and b.dtype in _FLOAT8 and scale_a.dtype == torch.float32
                       and scale_b.dtype == torch.float32 and (tensorwise or rowwise),
                       lambda: "Invalid scaling configuration.")
    torch._check(bias is None or bias.numel() == n, lambda: f"Bias must be size {n} but got {bias.numel()}")
    return torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)


@lowers(aten._scaled_mm.default, meta=_meta)
def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    # scale_result is ignored, as CPU's kernel ignores it; use_fast_accum is CUDA's (the sum is float32)
    out = precision.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), accumulator=True)
    for scale in (scale_a, scale_b):
        out = out * (scale.reshape(()) if scale.size == 1 else scale).astype(jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return dtypes.cast(out, dtypes.to_jax(out_dtype) if out_dtype is not None else a.dtype)
