"""Bundled kernels on tpu tensors, bound through `torch_tpu.pallas.jax_op` (docs/kernels.md).

- `flash_attention(q, k, v, causal=False, ...)`: (batch, heads, seq, head_dim) as SDPA takes them;
  fewer key/value heads than query heads is grouped-query attention. Tokamax's attention.
- `grouped_matmul(x, w, group_sizes)`: ragged matmul for mixture-of-experts. Tokamax's ragged_dot.
Each has a plain-JAX reference (kernels/reference.py). Which PyTorch ops use them is the routing
policy (kernels/routing.py, TORCH_TPU_KERNELS).
"""
from __future__ import annotations

from torch_tpu.kernels import routing
from torch_tpu.kernels.attention import flash_attention, have_tokamax
from torch_tpu.kernels.grouped import grouped_matmul

__all__ = ["flash_attention", "grouped_matmul", "have_tokamax", "routing"]
