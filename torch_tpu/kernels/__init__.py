"""Bundled kernels on tpu tensors, bound through `torch_tpu.pallas.jax_op` (docs/kernels.md).

- `flash_attention(q, k, v, causal=False, ...)`: (batch, heads, seq, head_dim) as SDPA takes them;
  fewer key/value heads than query heads is grouped-query attention. Tokamax's attention.
- `grouped_matmul(x, w, group_sizes)`: ragged matmul for mixture-of-experts. Tokamax's ragged_dot.
Each has a plain-JAX reference (kernels/reference.py). Which PyTorch ops use them is the routing
policy (kernels/routing.py, TORCH_TPU_KERNELS).
"""
from __future__ import annotations

import torch

from torch_tpu.kernels import routing
from torch_tpu.kernels.attention import _flash_attention, have_tokamax
from torch_tpu.kernels.grouped import _grouped_matmul

__all__ = ["flash_attention", "grouped_matmul", "have_tokamax", "routing"]


def _level() -> str:
    from torch_tpu import precision

    return precision.matmul_precision()


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, *, window: tuple[int, int] | None = None,
                    soft_cap: float | None = None, implementation: str = "auto") -> torch.Tensor:
    """Attention of tpu tensors (batch, heads, seq, head_dim), differentiable.

    `window=(before, after)`: sliding-window (local) attention; `soft_cap`: logits soft cap;
    `implementation`: "auto" (Tokamax picks: its Pallas kernel where one compiles), "mosaic",
    "triton", "xla", "xla_chunked" or "reference".
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention expects (batch, heads, seq, head_dim) tensors, got {q.dim()}-D, "
                         f"{k.dim()}-D and {v.dim()}-D")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"flash_attention: {q.shape[1]} query heads cannot be grouped over {k.shape[1]} key and "
                         f"{v.shape[1]} value heads")
    return _flash_attention(q, k, v, causal, None if scale is None else float(scale),
                            None if window is None else list(window), soft_cap, implementation, _level())


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *,
                   implementation: str = "auto") -> torch.Tensor:
    """x [m, k] (rows sorted by group) times w [g, k, n] per group of `group_sizes` [g] rows: [m, n]."""
    if x.dim() != 2 or w.dim() != 3 or group_sizes.dim() != 1 or group_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_matmul expects x [m, k], w [g, k, n], group_sizes [g]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(group_sizes.shape)}")
    if group_sizes.dtype.is_floating_point:
        raise TypeError("grouped_matmul: group_sizes must be an integer tensor")
    return _grouped_matmul(x, w, group_sizes, implementation)
