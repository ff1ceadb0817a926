"""The float32 matmul precision policy on "tpu", and the product helpers lowerings use.

Owns: which precision float32 matrix products (matmul, conv, einsum, attention)
run at on "tpu", how each level is computed so that every platform gives TPU
numerics, the one-time performance warning, and the "precision" section of
the metrics report. Does not own: autocast (autocast.py) or which ops are
products (the ops/ families call the helpers below).

Levels (the names of `torch.set_float32_matmul_precision`):

    "medium"   operands rounded to bfloat16, products accumulated in float32:
               the TPU matrix unit's single pass. The default on "tpu".
    "high"     bf16x3: each operand split into bfloat16 hi + lo parts, three
               bfloat16 passes (lo*hi + hi*lo + hi*hi) accumulated in float32,
               about 16 significant bits (TPU `Precision.HIGH`).
    "highest"  full float32 products.

Every level is computed explicitly (bfloat16 casts, float32 accumulation), so
XLA:CPU and XLA:GPU give the same numerics as a TPU: on a GPU XLA would
otherwise use TF32 and on a CPU full float32.

Which level applies, first match:
  1. the innermost `with torch_tpu.precision.use(level):` block of this thread;
  2. the level the user chose through PyTorch: `torch.set_float32_matmul_precision`
     (or `torch.backends.fp32_precision`). PyTorch records a choice in its
     fp32_precision settings, which read "none" until something is set; we
     read the CPU (oneDNN) matmul entry, the one place where the three levels
     are recorded distinctly (ieee / tf32 / bf16). PyTorch's own default
     ("highest", recorded as "none") is not a choice: tpu stays at "medium",
     and CPU numerics are untouched. CUDA-only switches
     (`torch.backends.cuda.matmul.allow_tf32`) are CUDA's and do not apply.
  3. "medium".
Running a float32 product at "high" or "highest" warns once per process
(`TpuPerformanceWarning`, a UserWarning subclass: filter it as usual).

Helper API for lowerings (call them while tracing; any dtype; the result has
the dtype of the inputs, as in PyTorch):

    matmul(a, b)                                   jnp.matmul
    dot_general(lhs, rhs, dimension_numbers)       lax.dot_general
    einsum(subscripts, a, b)                       jnp.einsum, two operands
    conv_general_dilated(lhs, rhs, *args, **kw)    lax.conv_general_dilated
    matmul_f32(a, b)                               float32 operands only

float32 follows the policy; bfloat16/float16 accumulate in float32 and round
back (or, with `accumulator=True`, stay float32: round once after adding a
bias, as PyTorch's addmm does); float64 and complex run at full precision;
integers are exact. A
lowering that calls a helper must be registered with `precision=True`: the
level is then part of its program's cache key, and the program is traced at
the level of its key (`bind`) wherever the trace runs (Strict or
DeferAndFuse). Importing this module does not import JAX.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
import warnings

import torch

from torch_tpu import metrics

LEVELS = ("highest", "high", "medium")
DEFAULT = "medium"

# PyTorch's fp32_precision record of the CPU (oneDNN) matmul -> our level.
_FROM_TORCH = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


class TpuPerformanceWarning(UserWarning):
    """A setting that makes "tpu" work slower than it needs to be (e.g. float32 matmuls at "highest")."""


_local = threading.local()  # .stack: use() levels of this thread; .tracing: the level bound to a trace
_warned = False
traced: collections.Counter = collections.Counter()  # float32 products traced, by level


# ---------------------------------------------------------------- the policy
def _torch_choice_fp32_precision() -> str | None:
    # torch >= 2.9 records the setting per backend; "none" = never set (inherit the default).
    value = _get_fp32_precision("mkldnn", "matmul")
    return _FROM_TORCH.get(value)


def _torch_choice_legacy() -> str | None:
    # Older torch records only the level: its default "highest" cannot be told from a choice.
    level = torch._C._get_float32_matmul_precision()
    return None if level == "highest" else level


_get_fp32_precision = getattr(torch._C, "_get_fp32_precision_getter", None)
torch_choice = _torch_choice_fp32_precision if _get_fp32_precision is not None else _torch_choice_legacy
torch_choice.__doc__ = "The level the user chose through PyTorch, or None while PyTorch is at its default."


def matmul_precision() -> str:
    """The precision float32 products on "tpu" run at now: "medium", "high" or "highest"."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    return torch_choice() or DEFAULT


def source() -> str:
    """Where the current level comes from: "torch_tpu.precision.use", "torch" or "default"."""
    if getattr(_local, "stack", None):
        return "torch_tpu.precision.use"
    return "torch" if torch_choice() is not None else "default"


@contextlib.contextmanager
def use(level: str):
    """Run float32 products on "tpu" at `level` inside the block (this thread only).

    Overrides `torch.set_float32_matmul_precision` for "tpu" work and leaves
    PyTorch's setting (and so CPU/CUDA numerics) alone.
    """
    if level not in LEVELS:
        raise ValueError(f"precision level must be one of {', '.join(LEVELS)}, got {level!r}")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(level)
    try:
        yield
    finally:
        stack.pop()


def bind(trace, level: str):
    """`trace` with its products computed at `level`, whatever the level when it is traced."""

    def bound(*args, **kwargs):
        previous = getattr(_local, "tracing", None)
        _local.tracing = level
        try:
            return trace(*args, **kwargs)
        finally:
            _local.tracing = previous

    return bound


def _trace_level() -> str:
    level = getattr(_local, "tracing", None) or matmul_precision()
    traced[level] += 1
    if level != DEFAULT and not _warned:
        _warn(level)
    return level


# Frames of these files are skipped so the warning names the user's line.
_INTERNAL = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep, contextlib.__file__, "<frozen ")
_COST = {"high": "3 bfloat16 passes per product on a TPU", "highest": "6 bfloat16 passes per product on a TPU"}


def _warn(level: str) -> None:
    global _warned
    _warned = True
    internal = _INTERNAL
    jax = sys.modules.get("jax")
    if jax is not None:
        internal += (os.path.dirname(jax.__file__) + os.sep,)
    frame, stacklevel = sys._getframe(2), 3  # stacklevel 3 = the caller of our caller
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(
        f"float32 matmuls on 'tpu' run at precision {level!r} (set by {source()}): {_COST[level]}, against 1 at "
        "the TPU default 'medium' (bfloat16 operands, float32 accumulation). Keep it where the numerics need it "
        "(`with torch_tpu.precision.use(...)`) and check the rest with torch_tpu.numerics.compare. "
        "Silence: warnings.filterwarnings('ignore', category=torch_tpu.TpuPerformanceWarning).",
        TpuPerformanceWarning,
        stacklevel=stacklevel if frame is not None else 2,
    )


def _report() -> dict:
    counts = ", ".join(f"{level} {traced[level]}" for level in reversed(LEVELS))
    return {"float32 matmul": f"{matmul_precision()} ({source()})", "float32 products traced": counts}


metrics.add_section("precision", _report)


# ---------------------------------------------------------------- helpers for lowerings
def _product(fn, a, b, *args, accumulator: bool = False, **kwargs):
    """fn(a, b, *args, **kwargs) for a bilinear JAX fn, at PyTorch's dtype rules and the policy."""
    import jax.numpy as jnp
    from jax import lax

    dtype = jnp.result_type(a, b)
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        return fn(a, b, *args, preferred_element_type=dtype, **kwargs)
    if dtype == jnp.float32:
        return _f32(fn, a.astype(dtype), b.astype(dtype), *args, **kwargs)
    if dtype in (jnp.bfloat16, jnp.float16):
        # NOTE(torch-vs-xla): PyTorch accumulates low-precision products in float32 and rounds once.
        out = fn(_low(a.astype(dtype)), _low(b.astype(dtype)), *args, precision=lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32, **kwargs)
        return out if accumulator else out.astype(dtype)
    # NOTE(torch-vs-xla): float64 and complex products are exact in PyTorch; the policy is float32's only.
    return fn(a.astype(dtype), b.astype(dtype), *args, precision=lax.Precision.HIGHEST,
              preferred_element_type=dtype, **kwargs)


def _f32(fn, a, b, *args, **kwargs):
    import jax.numpy as jnp
    from jax import lax

    level = _trace_level()
    f32, bf16 = jnp.float32, jnp.bfloat16
    exact = lax.Precision.HIGHEST  # for widened operands (`_low`); a bfloat16 pass is one pass at any precision
    if level == "medium":
        return fn(_low(a.astype(bf16)), _low(b.astype(bf16)), *args, precision=exact, preferred_element_type=f32,
                  **kwargs)
    if level == "high":
        a_hi, a_hi_finite, a_lo = map(_low, _split(a))
        b_hi, b_hi_finite, b_lo = map(_low, _split(b))
        small = fn(a_lo, b_hi_finite, *args, precision=exact, preferred_element_type=f32, **kwargs)
        small = small + fn(a_hi_finite, b_lo, *args, precision=exact, preferred_element_type=f32, **kwargs)
        return small + fn(a_hi, b_hi, *args, precision=exact, preferred_element_type=f32, **kwargs)
    return fn(a, b, *args, precision=exact, preferred_element_type=f32, **kwargs)


def _low(x):
    """A bfloat16/float16 operand as the product takes it: as it is, or widened to float32 on a host
    whose bfloat16 products are emulated (`widens_low_precision`). Widening is exact, and so is the
    float32 product of two widened values (8 or 11 significant bits each), so the numbers are the same."""
    import jax.numpy as jnp

    return x.astype(jnp.float32) if widens_low_precision() else x


def _split(x):
    """(hi, hi with non-finite values zeroed, lo) in bfloat16, x = hi + lo.

    The correction terms use the zeroed hi and lo = 0 where hi is not finite,
    so an infinite operand gives inf (from hi*hi), not NaN (from inf*0).
    """
    import jax.numpy as jnp

    hi = x.astype(jnp.bfloat16)
    finite = jnp.isfinite(hi)
    zero = jnp.zeros((), jnp.bfloat16)
    lo = jnp.where(finite, (x - hi.astype(x.dtype)).astype(jnp.bfloat16), zero)
    return hi, jnp.where(finite, hi, zero), lo


def matmul(a, b, *, accumulator: bool = False):
    """jnp.matmul(a, b) at the precision policy."""
    import jax.numpy as jnp

    fn = jnp.matmul
    if _xla_cpu():
        nt = _nt_form(a, b)
        if nt is not None:
            fn, b = nt
            return _product(_cpu_form(fn, row_major=True), a, b, accumulator=accumulator)
        fn = _cpu_form(fn, row_major=a.ndim >= 2 and b.ndim >= 2)
    return _product(fn, a, b, accumulator=accumulator)


# ---------------------------------------------------------------- XLA:CPU: the fast product form
# XLA:CPU runs a bfloat16 (or float32) dot through its fast library (YNNPACK) only when both
# operands are laid out row-major, the left one [batch..., rows, contracted]. It decides, early
# in compilation, which dots stay bfloat16: the others are widened to float32 (the operands
# rounded to bfloat16 and back, so the numbers are the same) and run in XLA's own kernel, about
# 2x slower than the bfloat16 library dot and 4x with the widening passes (2-core AMD EPYC).
# A transposed operand (x @ W.T of a linear layer, the weight gradient g.T @ x, attention's
# q @ k.T and its backward) reaches XLA as a transpose with a column-major layout, which is
# what that early decision sees. `_materialized` passes an operand (after its bfloat16 rounding,
# so the transpose is done in bfloat16) through a flat 1-D view behind an optimization barrier:
# the dot then sees a row-major operand in jnp.matmul's form, a transposed operand is copied
# once, row-major (a bitcast otherwise), and the dot takes the fast path.
#
# The barrier on the result guards against an XLA:CPU bug: a dot kept in bfloat16 whose result
# is transposed inside the same program gets rewritten after that decision (operands swapped,
# the transpose folded in) into a form no kernel runs ("Unsupported element type for
# DotThunk::Execute: BF16 x BF16 = F32"); DeferAndFuse programs often end like that
# ((a @ b).t() + 1 failed before this guard).
#
# The products are the same, and so are their float32 sums up to summation order inside the
# kernel. TPU and GPU dots take any layout: there the operands stay as they are. On a host
# without bfloat16 instructions the operands arrive widened to float32 (`_low`), and the same
# row-major rule gives the float32 library dot.
def _xla_cpu() -> bool:
    from torch_tpu.runtime import platform

    return platform.get().platform == "cpu"


# CPU instructions that multiply bfloat16 natively; without them XLA:CPU's bfloat16 dot converts
# inside the kernel and is slower than its float32 dot on the same (exactly widened) values:
# measured 1.2-2x on a 2-core AMD EPYC (AVX2) for the GPT's [512, 128] x [128, 128..512] products.
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def widens_low_precision() -> bool:
    """True on XLA:CPU when the host has no bfloat16 multiply instructions: products of bfloat16
    (and float16) operands then run as float32 products of the widened values (same numbers)."""
    if not _xla_cpu():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True  # not Linux: no flags to read; the float32 product is never wrong, only maybe slower
    return not any(flag in flags for flag in _NATIVE_BF16_FLAGS)


def _cpu_form(fn, row_major: bool):
    """fn for a product on XLA:CPU: row-major operands (when `row_major`) and a guarded result."""
    import jax.numpy as jnp
    from jax import lax

    def product(x, y, *args, **kwargs):
        if row_major:
            x, y = _materialized(x), _materialized(y)
        out = fn(x, y, *args, **kwargs)
        return lax.optimization_barrier(out) if x.dtype == jnp.bfloat16 and y.dtype == jnp.bfloat16 else out

    return product


def _nt_form(a, b):
    """(product fn, dense) when `b` is a transposed view of a row-major block `dense` ([..., n, k]):
    the product contracts `dense` as it lies (the library dot's [n, k] form), not a copy of b."""
    from jax import lax

    from torch_tpu.runtime import strided

    if a.ndim < 2 or b.ndim not in (2, a.ndim):
        return None
    source = strided.permuted_source(b)
    if source is None:
        return None
    dense, perm = source
    batch = tuple(range(b.ndim - 2))
    if perm != (*batch, b.ndim - 1, b.ndim - 2) or (b.ndim > 2 and a.shape[:-2] != b.shape[:-2]):
        return None
    lhs_batch = tuple(range(a.ndim - 2)) if b.ndim > 2 else ()
    dimension_numbers = (((a.ndim - 1,), (b.ndim - 1,)), (lhs_batch, batch))

    def fn(x, y, **kwargs):
        return lax.dot_general(x, y, dimension_numbers, **kwargs)

    return fn, dense


def _materialized(x):
    import jax.numpy as jnp
    from jax import lax

    if x.dtype not in (jnp.bfloat16, jnp.float32):
        return x  # no library path to reach
    # The flat view has one layout only, and the barrier keeps XLA from folding the two
    # reshapes (and so the transpose) away.
    return lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


def matmul_f32(a, b):
    """A float32 product at the current precision (called while tracing a program)."""
    import jax.numpy as jnp

    return _f32(jnp.matmul, a, b)


def dot_general(lhs, rhs, dimension_numbers, *, accumulator: bool = False):
    """lax.dot_general(lhs, rhs, dimension_numbers) at the precision policy."""
    from jax import lax

    fn = _cpu_form(lax.dot_general, row_major=False) if _xla_cpu() else lax.dot_general
    return _product(fn, lhs, rhs, dimension_numbers, accumulator=accumulator)


def einsum(subscripts: str, a, b, *, accumulator: bool = False):
    """jnp.einsum(subscripts, a, b) at the precision policy (two operands: contract more in pairs)."""
    import jax.numpy as jnp

    def fn(x, y, **kwargs):
        return jnp.einsum(subscripts, x, y, **kwargs)

    if _xla_cpu():
        fn = _cpu_form(fn, row_major=False)
    return _product(fn, a, b, accumulator=accumulator)


def conv_general_dilated(lhs, rhs, *args, accumulator: bool = False, **kwargs):
    """lax.conv_general_dilated(lhs, rhs, ...) at the precision policy (same arguments)."""
    from jax import lax

    return _product(lax.conv_general_dilated, lhs, rhs, *args, accumulator=accumulator, **kwargs)
