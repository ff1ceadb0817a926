"""Flash attention on tpu tensors: Tokamax's `dot_product_attention`, bound through `jax_op`.

Tokamax picks its Pallas kernel where one compiles (Mosaic on TPU, Triton / Mosaic GPU on
NVIDIA GPUs) and its XLA implementation elsewhere; `implementation=` chooses explicitly
("mosaic", "triton", "xla", "xla_chunked", or "reference": kernels/reference.py, also used
when Tokamax is not installed). Gradients: `jax.vjp` of the same function (Tokamax's own
backward kernels where it has them).
"""
from __future__ import annotations

import importlib.util

import jax
import torch

from torch_tpu import precision as precision_policy
from torch_tpu.kernels import reference
from torch_tpu.pallas import jax_op

_IMPLEMENTATIONS = ("auto", "mosaic", "triton", "xla", "xla_chunked", "reference")


def have_tokamax() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def tokamax():
    """The tokamax module, with absl's flags marked parsed.

    NOTE(tokamax 0.0.12): its options are absl flags, read by parsing the whole `sys.argv` on first
    use, which fails in any program with arguments of its own (pytest's, a training script's); we
    parse only the program name, so tokamax's options keep their defaults.
    """
    import sys

    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1], known_only=True)
    import tokamax as module

    return module


def _precision(level: str):
    return {"highest": jax.lax.Precision.HIGHEST, "high": jax.lax.Precision.HIGH}.get(level,
                                                                                    jax.lax.Precision.DEFAULT)


def attention(q, k, v, *, causal=False, scale=None, window=None, soft_cap=None, implementation="auto",
              precision="medium"):
    """The JAX function: (batch, heads, seq, head_dim) in, same layout out."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"flash_attention: implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "reference" or not have_tokamax():
        return reference.attention(q, k, v, causal=causal, scale=scale, window=window, soft_cap=soft_cap)
    swap = lambda t: jax.numpy.swapaxes(t, -3, -2)  # noqa: E731  (Tokamax takes (batch, seq, heads, dim))
    out = tokamax().dot_product_attention(
        swap(q), swap(k), swap(v), is_causal=causal, scale=scale,
        local_window_size=tuple(window) if window is not None else None, logits_soft_cap=soft_cap,
        precision=_precision(precision), implementation=None if implementation == "auto" else implementation)
    return swap(out)


@jax_op("tpu_kernels::flash_attention", vjp=True)
def _flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False, scale: float | None = None,
                     window: list[int] | None = None, soft_cap: float | None = None, implementation: str = "auto",
                     precision: str = "medium") -> jax.Array:
    return attention(q, k, v, causal=causal, scale=scale, window=window, soft_cap=soft_cap,
                     implementation=implementation, precision=precision)


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
                            None if window is None else list(window), soft_cap, implementation,
                            precision_policy.matmul_precision())
