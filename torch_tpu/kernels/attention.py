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
