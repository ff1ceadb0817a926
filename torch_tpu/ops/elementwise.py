"""Elementwise math, comparisons, logic and bit ops.

Arguments arrive already promoted to the computation dtype chosen by
PyTorch's own rules (the `promote=` policy); results are cast to PyTorch's
result dtype by the executor. So most lowerings are one jnp call.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

import torch

from torch_tpu.ops.registry import Promote, aten, lower_table, lowers, prepare

# ---------------------------------------------------------------- unary, float results
lower_table(
    {
        aten.exp.default: jnp.exp,
        aten.exp2.default: jnp.exp2,
        aten.expm1.default: jnp.expm1,
        aten.log.default: jnp.log,
        aten.log2.default: jnp.log2,
        aten.log10.default: jnp.log10,
        aten.log1p.default: jnp.log1p,
        aten.sqrt.default: jnp.sqrt,
        aten.rsqrt.default: lax.rsqrt,
        aten.sin.default: jnp.sin,
        aten.cos.default: jnp.cos,
        aten.tan.default: jnp.tan,
        aten.asin.default: jnp.arcsin,
        aten.acos.default: jnp.arccos,
        aten.atan.default: jnp.arctan,
        aten.sinh.default: jnp.sinh,
        aten.cosh.default: jnp.cosh,
        aten.tanh.default: jnp.tanh,
        aten.asinh.default: jnp.arcsinh,
        aten.acosh.default: jnp.arccosh,
        aten.atanh.default: jnp.arctanh,
        aten.sigmoid.default: jax.nn.sigmoid,
        aten.erf.default: jsp.erf,
        aten.erfc.default: jsp.erfc,
        aten.erfinv.default: jsp.erfinv,
        aten.lgamma.default: jsp.gammaln,
        aten.reciprocal.default: lambda x: 1 / x,
        aten.sinc.default: jnp.sinc,
        aten.deg2rad.default: jnp.deg2rad,
        aten.rad2deg.default: jnp.rad2deg,
        aten.i0.default: jsp.i0,
        aten.special_i0e.default: jsp.i0e,
        aten.special_i1.default: jsp.i1,
        aten.special_i1e.default: jsp.i1e,
        aten.special_ndtri.default: jsp.ndtri,
        aten.special_erfcx.default: jsp.erfcx,
        aten.special_log_ndtr.default: jsp.log_ndtr,
        aten.special_entr.default: jsp.entr,
    },
    promote=Promote.INT_TO_FLOAT,
)

def _sign(x):
    return x if x.dtype == jnp.bool_ else jnp.sign(x)  # jnp.sign refuses bool; ATen's sign of bool is itself


lower_table(
    {
        aten.neg.default: jnp.negative,
        aten.sign.default: _sign,
        aten.sgn.default: _sign,
        aten.floor.default: lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.floor(x),
        aten.ceil.default: lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.ceil(x),
        aten.trunc.default: lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.trunc(x),
        aten.frac.default: lambda x: x - jnp.trunc(x),
        aten.bitwise_not.default: lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.invert(x),
        aten._conj_physical.default: jnp.conj,
    },
    promote=Promote.DEFAULT,
)

lower_table({aten.abs.default: jnp.abs}, promote=Promote.COMPLEX_TO_FLOAT)


@lowers(aten.round.default, promote=Promote.DEFAULT)
def round_(x):
    # NOTE(torch-vs-xla): both round half to even.
    return x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.round(x)


@lowers(aten.round.decimals, promote=Promote.DEFAULT)
def round_decimals(x, decimals=0):
    return jnp.round(x, decimals)


lower_table(
    {
        aten.isnan.default: jnp.isnan,
        aten.isinf.default: jnp.isinf,
        aten.isposinf.default: jnp.isposinf,
        aten.isneginf.default: jnp.isneginf,
        aten.signbit.default: jnp.signbit,
        aten.logical_not.default: jnp.logical_not,
    },
)


@lowers(aten.nan_to_num.default, static_scalars=True)
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


# ---------------------------------------------------------------- binary arithmetic
_BINARY = ("self", "other")


@lowers(aten.add.Tensor, aten.add.Scalar, promote=Promote.DEFAULT, promote_args=_BINARY)
def add(x, y, alpha=1):
    y = y if alpha is None or (isinstance(alpha, int) and alpha == 1) else y * _alpha(alpha, y)
    return jnp.logical_or(x, y) if x.dtype == jnp.bool_ else x + y


@lowers(aten.sub.Tensor, aten.sub.Scalar, promote=Promote.DEFAULT, promote_args=_BINARY)
def sub(x, y, alpha=1):
    return x - (y if isinstance(alpha, int) and alpha == 1 else y * _alpha(alpha, y))


@lowers(aten.rsub.Tensor, aten.rsub.Scalar, promote=Promote.DEFAULT, promote_args=_BINARY)
def rsub(x, y, alpha=1):
    return y - (x if isinstance(alpha, int) and alpha == 1 else x * _alpha(alpha, x))


def _alpha(alpha, like):
    return jnp.asarray(alpha).astype(like.dtype)


@lowers(aten.mul.Tensor, aten.mul.Scalar, promote=Promote.DEFAULT)
def mul(x, y):
    return jnp.logical_and(x, y) if x.dtype == jnp.bool_ else x * y


@lowers(aten.div.Tensor, aten.div.Scalar, promote=Promote.INT_TO_FLOAT)
def div(x, y):
    return x / y


_LOW = (jnp.bfloat16, jnp.float16)


def _div_floor(x, y):
    """PyTorch's div_floor_floating (c10/util/generic_math.h): floor(x / y) through fmod, exact at ties.

    Low-precision floats: PyTorch's CPU kernel computes each step in float32 and rounds it to the
    input dtype (Vectorized<BFloat16> arithmetic); so do we (reduce_precision: XLA would fold a
    float32 -> bfloat16 -> float32 convert pair away).
    """
    low = x.dtype if x.dtype in _LOW else None
    if low is None:
        r = lambda v: v  # noqa: E731
    else:
        info = jnp.finfo(low)
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        r = lambda v: lax.reduce_precision(v, info.nexp, info.nmant)  # noqa: E731
    mod = r(jnp.fmod(x, y))
    div = r(r(x - mod) / y)
    div = jnp.where((mod != 0) & ((y < 0) != (mod < 0)), r(div - 1), div)
    floor = jnp.floor(div)
    floor = jnp.where(r(div - floor) > 0.5, r(floor + 1), floor)
    out = jnp.where(div != 0, floor, jnp.copysign(jnp.zeros_like(div), x / y))
    out = jnp.where(y == 0, r(x / y), out)
    return out if low is None else out.astype(low)


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode, promote=Promote.NO_OPMATH, promote_args=_BINARY)
def div_mode(x, y, rounding_mode=None):
    if rounding_mode is None:
        return x / y
    if jnp.issubdtype(x.dtype, jnp.integer):
        # NOTE(torch-vs-xla): integer division by zero raises on CPU; XLA returns a value.
        if rounding_mode == "floor":
            return jnp.floor_divide(x, y)
        q = lax.div(x, jnp.where(y == 0, 1, y))
        return q
    if rounding_mode == "floor":
        return _div_floor(x, y)
    if x.dtype not in _LOW:
        return jnp.trunc(x / y)
    # PyTorch's CPU kernel rounds the quotient to the input dtype before truncating it (reduce_precision:
    # XLA folds a float32 -> bfloat16 -> float32 convert pair away).
    info = jnp.finfo(x.dtype)
    q = lax.reduce_precision(x.astype(jnp.float32) / y.astype(jnp.float32), info.nexp, info.nmant)
    return jnp.trunc(q).astype(x.dtype)


@lowers(aten.floor_divide.default, aten.floor_divide.Scalar, promote=Promote.NO_OPMATH)
def floor_divide(x, y):
    return jnp.floor_divide(x, y) if jnp.issubdtype(x.dtype, jnp.integer) else _div_floor(x, y)


@lowers(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, promote=Promote.DEFAULT)
def remainder(x, y):
    return jnp.remainder(x, y)


@lowers(aten.fmod.Tensor, aten.fmod.Scalar, promote=Promote.DEFAULT)
def fmod(x, y):
    return jnp.fmod(x, y)


@lowers(aten.pow.Tensor_Tensor, aten.pow.Scalar, promote=Promote.DEFAULT)
def pow_(x, y):
    x, y = jnp.asarray(x), jnp.asarray(y)
    if jnp.issubdtype(x.dtype, jnp.integer) and jnp.issubdtype(y.dtype, jnp.integer):
        return _integer_power(x, y)
    return jnp.power(x, y)


def _integer_power(x, y):
    """Integers to integer powers as PyTorch computes them: a negative power is 0, except of 1 and -1."""
    positive = jnp.power(x, jnp.maximum(y, 0))
    if not jnp.issubdtype(y.dtype, jnp.signedinteger):
        return positive
    one = jnp.ones_like(positive)
    negative = jnp.where(x == 1, one, jnp.where(x == -1, jnp.where(y % 2 == 0, one, -one), jnp.zeros_like(positive)))
    return jnp.where(y < 0, negative, positive)


@lowers(aten.pow.Tensor_Scalar, promote=Promote.DEFAULT, static_scalars=True)
def pow_scalar(x, exponent):
    # Static exponent: x**2 compiles to x*x, like PyTorch's special cases.
    if isinstance(exponent, float) and exponent.is_integer() and abs(exponent) <= 64:
        exponent = int(exponent) if not jnp.issubdtype(x.dtype, jnp.integer) else exponent
    if isinstance(exponent, int) and jnp.issubdtype(x.dtype, jnp.inexact):
        return lax.integer_pow(x, exponent) if exponent >= 0 else 1 / lax.integer_pow(x, -exponent)
    if isinstance(exponent, int) and exponent < 0 and jnp.issubdtype(x.dtype, jnp.integer):
        raise RuntimeError("Integers to negative integer powers are not allowed.")
    return jnp.power(x, jnp.asarray(exponent, x.dtype))


def complex_logaddexp(x, y):
    """log(exp(x) + exp(y)) of complex values as ATen computes it: the operand with the larger real part plus
    log1p(exp(other - it)). Its imaginary part is not wrapped into (-pi, pi] (jnp.logaddexp's is)."""
    smaller = x.real < y.real
    low, high = jnp.where(smaller, x, y), jnp.where(smaller, y, x)
    both_infinite = ~jnp.isfinite(low.real) & (low.real == high.real)
    value = jnp.where(both_infinite, jnp.where(low.real < 0, low, jnp.log(jnp.exp(low) + jnp.exp(high))),
                      jnp.log1p(jnp.exp(low - high)) + high)
    nan = jnp.isnan(x.real) | jnp.isnan(x.imag) | jnp.isnan(y.real) | jnp.isnan(y.imag)
    return jnp.where(nan, jnp.asarray(complex(jnp.nan, jnp.nan), x.dtype), value)


def _logaddexp(x, y):
    return complex_logaddexp(x, y) if jnp.iscomplexobj(x) else jnp.logaddexp(x, y)


lower_table(
    {
        aten.atan2.default: jnp.arctan2,
        aten.hypot.default: jnp.hypot,
        aten.logaddexp.default: _logaddexp,
        aten.logaddexp2.default: jnp.logaddexp2,
        aten.copysign.Tensor: jnp.copysign,
        aten.copysign.Scalar: jnp.copysign,
        aten.xlogy.Tensor: jsp.xlogy,
        aten.xlogy.Scalar_Self: jsp.xlogy,
        aten.xlogy.Scalar_Other: jsp.xlogy,
        aten.special_xlog1py.default: jsp.xlog1py,
        aten.nextafter.default: jnp.nextafter,
    },
    promote=Promote.INT_TO_FLOAT,
)


@lowers(aten.maximum.default, promote=Promote.DEFAULT)
def maximum(x, y):
    return jnp.maximum(x, y)  # NaN propagates


@lowers(aten.minimum.default, promote=Promote.DEFAULT)
def minimum(x, y):
    return jnp.minimum(x, y)


@lowers(aten.fmax.default, promote=Promote.DEFAULT)
def fmax(x, y):
    return jnp.fmax(x, y)  # NaN ignored unless both are


@lowers(aten.fmin.default, promote=Promote.DEFAULT)
def fmin(x, y):
    return jnp.fmin(x, y)


@lowers(aten.heaviside.default, promote=Promote.DEFAULT)
def heaviside(x, values):
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype))


# ---------------------------------------------------------------- comparisons and logic
def _cmp(fn):
    return lambda x, y: fn(x, y)


lower_table(
    {
        aten.eq.Tensor: _cmp(jnp.equal), aten.eq.Scalar: _cmp(jnp.equal),
        aten.ne.Tensor: _cmp(jnp.not_equal), aten.ne.Scalar: _cmp(jnp.not_equal),
        aten.lt.Tensor: _cmp(jnp.less), aten.lt.Scalar: _cmp(jnp.less),
        aten.le.Tensor: _cmp(jnp.less_equal), aten.le.Scalar: _cmp(jnp.less_equal),
        aten.gt.Tensor: _cmp(jnp.greater), aten.gt.Scalar: _cmp(jnp.greater),
        aten.ge.Tensor: _cmp(jnp.greater_equal), aten.ge.Scalar: _cmp(jnp.greater_equal),
    },
    promote=Promote.ALWAYS_BOOL,
)

lower_table(
    {
        aten.logical_and.default: jnp.logical_and,
        aten.logical_or.default: jnp.logical_or,
        aten.logical_xor.default: jnp.logical_xor,
    },
)


def _bitwise(fn, logical):
    return lambda x, y: logical(x, y) if x.dtype == jnp.bool_ else fn(x, y)


lower_table(
    {
        aten.bitwise_and.Tensor: _bitwise(jnp.bitwise_and, jnp.logical_and),
        aten.bitwise_and.Scalar: _bitwise(jnp.bitwise_and, jnp.logical_and),
        aten.bitwise_or.Tensor: _bitwise(jnp.bitwise_or, jnp.logical_or),
        aten.bitwise_or.Scalar: _bitwise(jnp.bitwise_or, jnp.logical_or),
        aten.bitwise_xor.Tensor: _bitwise(jnp.bitwise_xor, jnp.logical_xor),
        aten.bitwise_xor.Scalar: _bitwise(jnp.bitwise_xor, jnp.logical_xor),
        aten.gcd.default: jnp.gcd,
        aten.lcm.default: jnp.lcm,
    },
    promote=Promote.DEFAULT,
)


# NOTE(torch-vs-xla): both shift out to 0 (or the sign, right-shifting a negative) for shift counts
# outside [0, bits): XLA's shifts already do, so no clamping is needed.
lower_table(
    {
        op: jnp.left_shift
        for op in (aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
                   aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)
    } | {
        op: jnp.right_shift
        for op in (aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
                   aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)
    },
    promote=Promote.DEFAULT,
)


@prepare(aten.__lshift__.Tensor, aten.__lshift__.Scalar, aten.__rshift__.Tensor, aten.__rshift__.Scalar,
         aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
         aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar, only_on_miss=True)
def _bool_shift_arguments(x, other):
    """A bool tensor shifted by an integer promotes first, as PyTorch's CPU kernel does (bool << 1 is int64);
    PyTorch's meta kernel checks the unpromoted dtype and would refuse it."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        wide = torch.result_type(x, other)
        if wide != torch.bool:
            x = x.to(wide)
    return (x, other), {}


# `a <<= b` is __ilshift__, which has no functional counterpart to derive it from.
lower_table(
    {
        aten.__ilshift__.Tensor: jnp.left_shift, aten.__ilshift__.Scalar: jnp.left_shift,
        aten.__irshift__.Tensor: jnp.right_shift, aten.__irshift__.Scalar: jnp.right_shift,
    },
    promote=Promote.DEFAULT,
)


# ---------------------------------------------------------------- selection
# torch._refs writes `where` as the prim (same dtypes: no promotion); compiled graphs reach it
# (e.g. det's backward).
@lowers(torch.ops.prims.where.default)
@lowers(aten.where.self, promote=Promote.DEFAULT, promote_args=("self", "other"))
def where(condition, x, y):
    return jnp.where(condition, x, y)


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x)


@lowers(aten.clamp.default, aten.clamp.Tensor, promote=Promote.DEFAULT)
def clamp(x, min=None, max=None):
    if min is not None:
        x = jnp.maximum(x, min)
    if max is not None:
        x = jnp.minimum(x, max)
    return x


@lowers(aten.clamp_min.default, aten.clamp_min.Tensor, promote=Promote.DEFAULT)
def clamp_min(x, min):
    return jnp.maximum(x, min)


@lowers(aten.clamp_max.default, aten.clamp_max.Tensor, promote=Promote.DEFAULT)
def clamp_max(x, max):
    return jnp.minimum(x, max)


@lowers(aten.lerp.Scalar, aten.lerp.Tensor, promote=Promote.DEFAULT)
def lerp(start, end, weight):
    # PyTorch's formula: exact at weight 0 and 1.
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight))


@lowers(aten.addcmul.default, promote=Promote.DEFAULT)
def addcmul(x, t1, t2, value=1):
    return x + value * t1 * t2


@lowers(aten.addcdiv.default, promote=Promote.DEFAULT)
def addcdiv(x, t1, t2, value=1):
    return x + value * (t1 / t2)


# ---------------------------------------------------------------- complex parts and float decomposition
@lowers(aten.angle.default, promote=Promote.INT_TO_FLOAT)
def angle(x):
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.angle(x)
    # PyTorch: pi for negative reals, 0 otherwise, NaN stays NaN.
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0).astype(x.dtype))


@lowers(aten.frexp.Tensor)
def frexp(x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent.astype(jnp.int32)


@lowers(aten.logit_backward.default, promote=Promote.INT_TO_FLOAT, static_scalars=True)
def logit_backward(grad, x, eps=None):
    derivative = grad / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.nan, derivative)
    return jnp.where((x < eps) | (x > 1 - eps), jnp.zeros_like(derivative), derivative)


# torch._decomp writes dtype casts (`_to_copy`, `.to(dtype)`) as this prim: torch.compile graphs reach it.
@lowers(torch.ops.prims.convert_element_type.default)
def convert_element_type(a, dtype):
    from torch_tpu.runtime import dtypes

    return dtypes.cast(a, dtypes.to_jax(dtype))
