"""The float32 matmul precision policy on "tpu".

Owns: which precision float32 matrix products run at, and how each level is
computed so that every platform gives TPU numerics.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax


def matmul_precision() -> str:
    """The precision float32 matmuls run at now: "highest", "high" or "medium"."""
    return torch.get_float32_matmul_precision()


def matmul_f32(a, b):
    """A float32 product at the current precision (called while tracing a program)."""
    level = matmul_precision()
    if level == "medium":
        # The TPU MXU's native mode: bfloat16 operands, float32 accumulation.
        return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    mode = lax.Precision.HIGHEST if level == "highest" else lax.Precision.HIGH
    return jnp.matmul(a, b, precision=mode, preferred_element_type=jnp.float32)


def conv_f32(lhs, rhs, **conv_kwargs):
    """A float32 `lax.conv_general_dilated` at the current precision (called while tracing a program)."""
    level = matmul_precision()
    if level == "medium":
        return lax.conv_general_dilated(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16),
                                        preferred_element_type=jnp.float32, **conv_kwargs)
    mode = lax.Precision.HIGHEST if level == "highest" else lax.Precision.HIGH
    return lax.conv_general_dilated(lhs, rhs, precision=mode, preferred_element_type=jnp.float32, **conv_kwargs)
