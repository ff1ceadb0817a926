"""Routing policy: which of PyTorch's ops run the bundled kernels on "tpu".

Policy (TORCH_TPU_KERNELS, or `set_policy`):
- "auto" (default): where Pallas compiles natively (TPU, GPU), `F.scaled_dot_product_attention`
  (no mask, no dropout, 4-D) runs `torch_tpu.kernels.flash_attention` and `torch._grouped_mm`
  runs Tokamax's ragged matmul; elsewhere (XLA:CPU) both keep their XLA lowerings, so nothing
  changes on CPU;
- "always": the kernels wherever they run (on CPU through Tokamax's XLA implementations or
  Pallas interpret mode: for testing the routing);
- "never": always the XLA lowerings.

Owns: the decision and the SDPA override (an AutogradPrivateUse1 kernel of
`aten::scaled_dot_product_attention`, registered only while kernels are routed to).
"""
from __future__ import annotations

import torch

from torch_tpu.config import config

_POLICIES = ("auto", "always", "never")
_library = None


def policy() -> str:
    return config.kernels


def use_kernels() -> bool:
    """Whether PyTorch's attention and grouped matmul run the bundled kernels here."""
    chosen = config.kernels
    if chosen == "auto":
        from torch_tpu.pallas import interpret

        return interpret.native()
    return chosen == "always"


def set_policy(value: str) -> None:
    """Set the routing policy ("auto", "always", "never") for this process."""
    if value not in _POLICIES:
        raise ValueError(f"kernel routing policy must be one of {_POLICIES}, got {value!r}")
    config.kernels = value
    install()


def install() -> None:
    """Register (or remove) the SDPA override to match the policy (runs at runtime initialisation)."""
    global _library
    if use_kernels() and _library is None:
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    elif not use_kernels() and _library is not None:
        _library._destroy()
        _library = None


def _routable(query, key, value, attn_mask, dropout_p, enable_gqa) -> bool:
    if attn_mask is not None or dropout_p != 0.0 or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if not (query.dtype == key.dtype == value.dtype and query.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return False
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        return False
    return query.device.type == key.device.type == value.device.type == "tpu" and key.shape[-1] == value.shape[-1]


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if _routable(query, key, value, attn_mask, dropout_p, enable_gqa):
        from torch_tpu.kernels.attention import flash_attention

        return flash_attention(query, key, value, causal=is_causal, scale=scale)
    return torch.ops.aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
