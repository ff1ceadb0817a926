"""Random ops. Each takes a jax.random key derived from (seed, offset) of the
device generator: runtime inputs, so one compiled program serves every call
and `torch.manual_seed` makes runs reproducible.
"""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_tpu.ops import _draws, checks
from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes


def _draw_dtype(dtype):
    """The dtype a floating draw is made in: float32 (ATen's opmath for half types), or double's own."""
    return jnp.float64 if dtype in (jnp.float64, jnp.complex128) else jnp.float32


def _floating_only(x, kernel: str, empty_returns_first: bool = False) -> None:
    """ATen's dispatch of uniform_/normal_ over floating (and complex) types only (normal_ returns an empty
    tensor before it)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact) and not (empty_returns_first and x.size == 0):
        raise dtypes.not_implemented(kernel, dtypes.to_torch(x.dtype))


def _normal_meta(x, mean=0.0, std=1.0, generator=None):
    """normal_'s output (PyTorch's reference meta kernel refuses an integer dtype even for an empty tensor)."""
    return x if x.numel() == 0 else aten.normal_.default(x, mean, std, generator=generator)


def _std_tensor(std):
    checks.require(std >= 0, checks.NORMAL_STD)  # ATen reads the minimum (a sync); here a value check
    return std


# ---------------------------------------------------------------- ATen's checks of Python scalars
# On the host, at the call (`host_check`), as every PyTorch device makes them. A lowering asks again
# when it sees the values (a torch.compile graph's constants); in an eager program they are traced.
def _concrete(*values) -> bool:
    return all(isinstance(v, (int, float)) for v in values)


def _check_uniform(dtype: torch.dtype, low, high) -> None:
    """uniform_impl_'s checks (empty tensors included)."""
    real = dtype.to_real() if dtype.is_complex else dtype
    if not real.is_floating_point or not _concrete(low, high):
        return  # the lowering raises ATen's dispatch error; traced bounds were checked on the host
    lowest, highest = torch.finfo(real).min, torch.finfo(real).max
    for name, value in (("from", low), ("to", high)):
        if not lowest <= value <= highest:
            raise RuntimeError(f"{name} is out of bounds for {dtypes.cpp_name(real)}")
    if not low <= high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={low:g} > to={high:g}")
    if high - low > highest:
        raise RuntimeError(f"uniform_ expects to-from <= std::numeric_limits<{dtypes.scalar_type_name(real)}>::max(), "
                           f"but found to={high:g} and from={low:g} which result in to-from to exceed the limit")


def _check_std(std) -> None:
    if _concrete(std) and not std >= 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std:g}")


def _check_p(p) -> None:
    if _concrete(p) and not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p:g}")


def _uniform_host_check(x, low=0.0, high=1.0, generator=None):
    _check_uniform(x.dtype, low, high)


def _normal_host_check(x, mean=0.0, std=1.0, generator=None):
    _check_std(std)


def _bernoulli_host_check(x, p=0.5, generator=None):
    _check_p(p)


@lowers(aten.uniform.default, rng=True, host_check=_uniform_host_check, runtime=("from", "to"))
def uniform(x, low=0.0, high=1.0, generator=None, *, key):
    _floating_only(x, "check_uniform_bounds")
    _check_uniform(dtypes.to_torch(x.dtype), low, high)
    draw = _draw_dtype(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):  # ATen: the real and imaginary parts each uniform
        parts = _draws.uniform(key, x.shape + (2,), dtype=draw, minval=low, maxval=high)
        return lax.complex(parts[..., 0], parts[..., 1]).astype(x.dtype)
    return _draws.uniform(key, x.shape, dtype=draw, minval=low, maxval=high).astype(x.dtype)


@lowers(aten.normal_.default, rng=True, host_check=_normal_host_check, runtime=("mean", "std"), meta=_normal_meta)
def normal_(x, mean=0.0, std=1.0, generator=None, *, key):
    _floating_only(x, "normal_kernel_tpu", empty_returns_first=True)
    _check_std(std)
    draw = _draw_dtype(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):  # ATen: both parts normal(mean, std / sqrt(2))
        parts = _draws.normal(key, x.shape + (2,), dtype=draw) * (std / math.sqrt(2)) + mean
        return lax.complex(parts[..., 0], parts[..., 1]).astype(x.dtype)
    return (_draws.normal(key, x.shape, dtype=draw) * std + mean).astype(x.dtype)


@lowers(aten.normal.Tensor_Tensor, rng=True)
@checks.checked
def normal_tensors(mean, std, generator=None, *, key):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return _draws.normal(key, shape, dtype=jnp.float32) * _std_tensor(std) + mean


@lowers(aten.normal.Tensor_float, rng=True, host_check=_normal_host_check, runtime=("std",))
def normal_tensor_float(mean, std=1.0, generator=None, *, key):
    _check_std(std)
    return _draws.normal(key, mean.shape, dtype=jnp.float32) * std + mean


@lowers(aten.normal.float_Tensor, rng=True)
@checks.checked
def normal_float_tensor(mean, std, generator=None, *, key):
    return _draws.normal(key, std.shape, dtype=jnp.float32) * _std_tensor(std) + mean


@lowers(aten.bernoulli_.float, rng=True, host_check=_bernoulli_host_check)
def bernoulli_float(x, p=0.5, generator=None, *, key):
    _check_p(p)
    return _draws.bernoulli(key, p, x.shape).astype(x.dtype)


@lowers(aten.bernoulli_.Tensor, rng=True)
@checks.checked
def bernoulli_(x, p, generator=None, *, key):
    checks.require((p >= 0) & (p <= 1), checks.BERNOULLI)
    return _draws.bernoulli(key, p, x.shape).astype(x.dtype)


@lowers(aten.bernoulli.default, rng=True)
@checks.checked
def bernoulli(x, generator=None, *, key):
    checks.require((x >= 0) & (x <= 1), checks.BERNOULLI)
    return _draws.bernoulli(key, x.astype(jnp.float32), x.shape).astype(x.dtype)


def _bernoulli_out_meta(x, generator, out):
    # ATen's bernoulli_out resizes out and draws in its dtype, any dtype (result.bernoulli_(self)); the
    # reference out= wrapper PyTorch's meta kernel uses would refuse float -> int64 as an unsafe cast.
    return out.resize_(x.shape)


@lowers(aten.bernoulli.out, rng=True, meta=_bernoulli_out_meta)
@checks.checked
def bernoulli_out(x, generator, out, *, key):
    return bernoulli(x, generator, key=key).astype(out.dtype)


@lowers(aten.bernoulli.p, rng=True, host_check=_bernoulli_host_check)
def bernoulli_p(x, p, generator=None, *, key):
    _check_p(p)
    return _draws.bernoulli(key, p, x.shape).astype(x.dtype)


# ---------------------------------------------------------------- random_: ATen's ranges and checks
# random_() draws from [0, 2^digits] for floating types (every integer they hold exactly) and from
# [0, max] for integer types; random_(from, None) up to those tops; random_(from, to) from [from, to).
# A draw is `from + (64 random bits mod range)`, as ATen's kernel, so even int64's whole range fits.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _digits(dtype) -> int:
    return jnp.finfo(dtype).nmant + 1


def _as(dtype, value: int) -> float:
    with np.errstate(over="ignore"):  # past the dtype's range: inf, which the callers check
        return float(np.asarray(float(value), dtype=dtype))


def _representable_from(dtype, low: int) -> int:
    """The least value of `dtype` that is >= low (ATen's update_from)."""
    rounded = _as(dtype, low + 1)
    if not np.isfinite(rounded):  # past the dtype's range: the bound check refuses it
        return low
    return int(np.nextafter(np.asarray(rounded, dtype), np.asarray(np.inf, dtype))) if rounded < low else low


def _representable_to(dtype, high: int) -> int:
    """An exclusive bound of `dtype` that is <= high (ATen's update_to)."""
    rounded = _as(dtype, high - 1)
    if not np.isfinite(rounded):
        return high
    return int(np.nextafter(np.asarray(rounded, dtype), np.asarray(-np.inf, dtype))) if rounded >= high else high


def _check_bound(dtype, name: str, value: int) -> None:
    meta = dtypes.cpp_name(dtypes.to_torch(dtype))
    if _floating(dtype):
        lowest, highest = float(jnp.finfo(dtype).min), float(jnp.finfo(dtype).max)
    elif dtype == jnp.bool_:
        lowest, highest = 0, 1
    else:
        lowest, highest = int(jnp.iinfo(dtype).min), int(jnp.iinfo(dtype).max)
    if not lowest <= value <= highest:
        raise RuntimeError(f"{name} is out of bounds for {meta}")
    if _floating(dtype) and abs(value) > 1 << _digits(dtype):
        digits = _digits(dtype)
        warnings.warn(f"{name} is out of bounds [-(2^{digits}), 2^{digits}]. Due to precision limitations {meta} can "
                      "support discrete uniform distribution only within this range. This warning will become an "
                      "error in version 1.7 release, please fix the code in advance", UserWarning, stacklevel=2)


def _range(dtype, low: int, high: int | None) -> tuple[int, int]:
    """(from, number of values) of random_(from, to) on `dtype`, with ATen's checks (raised while tracing:
    the bounds are static)."""
    if high is not None:
        if not low < high:
            raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
        if _floating(dtype):
            low, high = _representable_from(dtype, low), _representable_to(dtype, high)
            if not low < high:
                raise RuntimeError("random_ expects 'from' casted to dtype to be less than 'to' casted to dtype, "
                                   f"but got from={low} >= to={high}")
        _check_bound(dtype, "from", low)
        _check_bound(dtype, "to - 1", high - 1)
        return low, high - low
    if low == _INT64_MIN:
        return low, 2**64
    if _floating(dtype):
        top = min(1 << _digits(dtype), _INT64_MAX)
        low = _representable_from(dtype, low)
        if not low < top:
            raise RuntimeError("random_ expects 'from' casted to dtype to be less than or equal to 'to_inc' casted to "
                               f"dtype, but got from={low} > to_inc={top}")
    else:
        top = 1 if dtype == jnp.bool_ else int(jnp.iinfo(dtype).max)
    _check_bound(dtype, "from", low)
    _check_bound(dtype, "to - 1", top)
    return low, top - low + 1


def _draw(key, x, low: int, count: int):
    bits = _draws.bits(key, x.shape, jnp.uint64)
    if count < 2**64:
        bits = bits % jnp.uint64(count)
    return lax.bitcast_convert_type(bits + jnp.uint64(low % 2**64), jnp.int64).astype(x.dtype)


@lowers(getattr(aten.random_, "from"), rng=True, static_scalars=True)
def random_from(x, low, high=None, generator=None, *, key):
    return _draw(key, x, *_range(x.dtype, low, high))


@lowers(aten.random_.to, rng=True, static_scalars=True)
def random_to(x, high, generator=None, *, key):
    return _draw(key, x, *_range(x.dtype, 0, high))


@lowers(aten.random_.default, rng=True)
def random_(x, generator=None, *, key):
    return _draw(key, x, *_range(x.dtype, 0, None))


def _geometric_host_check(x, p, generator=None):
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p:g}")


@lowers(aten.geometric.default, rng=True, host_check=_geometric_host_check, runtime=("p",))
def geometric(x, p, generator=None, *, key):
    """The number of Bernoulli(p) trials to the first success, in any real dtype (ATen's ceil(log(u) / log1p(-p)))."""
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise dtypes.not_implemented("geometric_tpu", dtypes.to_torch(x.dtype))
    draw = _draw_dtype(x.dtype)
    u = _draws.uniform(key, x.shape, dtype=draw, minval=jnp.finfo(draw).tiny, maxval=1.0)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-jnp.asarray(p, draw))).astype(x.dtype)


@lowers(aten.exponential_.default, rng=True)
def exponential_(x, lambd=1.0, generator=None, *, key):
    return (_draws.exponential(key, x.shape, dtype=jnp.float32) / lambd).astype(x.dtype)


_RANDPERM_LIMITS = {torch.float16: (2**11 + 1, "2049", "Half"), torch.float32: (2**24 + 1, "2^24+1", "Float"),
                    torch.float64: (2**53 + 1, "2^53+1", "Double")}


def _randperm_host_check(n, generator=None, out=None):
    """ATen's randperm checks: the dtypes it dispatches, and n's largest value held exactly by `out`."""
    dtype = out.dtype
    if dtype == torch.bool or dtype.is_complex:
        raise dtypes.not_implemented("randperm", dtype)
    if n <= 0:
        return
    if not dtype.is_floating_point and n - 1 > torch.iinfo(dtype).max:
        torch.scalar_tensor(n - 1, dtype=dtype)  # ATen's own overflow error ("... to type uint8_t without overflow")
    limit, text, name = _RANDPERM_LIMITS.get(dtype, (n, "", ""))
    if n > limit:
        raise RuntimeError(f"n cannot be greater than {text} for {name} type.")


@lowers(aten.randperm.generator_out, rng=True, host_check=_randperm_host_check)
def randperm_out(n, generator=None, out=None, *, key):
    return jax.random.permutation(key, n).astype(out.dtype)


@lowers(aten.multinomial.default, rng=True)
@checks.checked
def multinomial(probs, num_samples, replacement=False, generator=None, *, key):
    p = probs.astype(jnp.float32)
    checks.require(jnp.isfinite(p) & (p >= 0), checks.MULTINOMIAL_INVALID)
    checks.require(jnp.sum(jnp.where(p > 0, p, 0), axis=-1) > 0, checks.MULTINOMIAL_SUM)
    logits = jnp.log(probs.astype(jnp.float32))
    if replacement:
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + probs.shape[:-1])
        return jnp.moveaxis(draws, 0, -1).astype(jnp.int64)
    # Without replacement: the top num_samples of logits + Gumbel noise (a draw in order, like PyTorch's).
    scores = logits + _draws.gumbel(key, probs.shape, jnp.float32)
    return lax.top_k(scores, num_samples)[1].astype(jnp.int64)


# ---------------------------------------------------------------- samplers behind torch.distributions
def _wide(x):
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


@lowers(aten.poisson.default, rng=True)
def poisson(rates, generator=None, *, key):
    return _draws.poisson(key, _wide(rates), rates.shape, dtype=jnp.int64).astype(rates.dtype)


@lowers(aten.binomial.default, rng=True)
def binomial(count, prob, generator=None, *, key):
    shape = jnp.broadcast_shapes(count.shape, prob.shape)
    return _draws.binomial(key, _wide(count), _wide(prob), shape, dtype=jnp.float32).astype(count.dtype)


@lowers(aten._standard_gamma.default, rng=True)
def standard_gamma(alpha, generator=None, *, key):
    return _draws.gamma(key, _wide(alpha), alpha.shape).astype(alpha.dtype)


@lowers(aten._standard_gamma_grad.default)
def standard_gamma_grad(alpha, sample):
    """d sample / d alpha of a Gamma(alpha, 1) draw (implicit reparameterisation: Gamma/Beta/Dirichlet rsample)."""
    return lax.random_gamma_grad(_wide(alpha), _wide(sample)).astype(alpha.dtype)


@lowers(aten._sample_dirichlet.default, rng=True)
def sample_dirichlet(alpha, generator=None, *, key):
    # Normalised Gamma draws along the last dimension, as PyTorch does.
    gammas = _draws.gamma(key, _wide(alpha), alpha.shape)
    return (gammas / jnp.sum(gammas, axis=-1, keepdims=True)).astype(alpha.dtype)
