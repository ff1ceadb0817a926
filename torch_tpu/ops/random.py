"""Random ops. Each takes a jax.random key derived from (seed, offset) of the
device generator: runtime inputs, so one compiled program serves every call
and `torch.manual_seed` makes runs reproducible.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torch_tpu.ops import checks
from torch_tpu.ops.registry import aten, lowers


def _float_dtype(dtype):
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32


@lowers(aten.uniform.default, rng=True)
@checks.checked
def uniform(x, low=0.0, high=1.0, generator=None, *, key):
    checks.require(jnp.asarray(low) <= jnp.asarray(high), checks.UNIFORM_RANGE, checks.float_bits(low), 0,
                   checks.float_bits(high))
    dt = _float_dtype(x.dtype)
    return jax.random.uniform(key, x.shape, dtype=jnp.float32, minval=low, maxval=high).astype(dt)


@lowers(aten.normal_.default, rng=True)
def normal_(x, mean=0.0, std=1.0, generator=None, *, key):
    return (jax.random.normal(key, x.shape, dtype=jnp.float32) * std + mean).astype(_float_dtype(x.dtype))


@lowers(aten.normal.Tensor_Tensor, rng=True)
def normal_tensors(mean, std, generator=None, *, key):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return jax.random.normal(key, shape, dtype=jnp.float32) * std + mean


@lowers(aten.normal.Tensor_float, rng=True)
def normal_tensor_float(mean, std=1.0, generator=None, *, key):
    return jax.random.normal(key, mean.shape, dtype=jnp.float32) * std + mean


@lowers(aten.normal.float_Tensor, rng=True)
def normal_float_tensor(mean, std, generator=None, *, key):
    return jax.random.normal(key, std.shape, dtype=jnp.float32) * std + mean


def _check_probability(p):
    p = jnp.asarray(p)
    if p.ndim == 0 and not jnp.issubdtype(p.dtype, jnp.floating):  # an integer p: 0 or 1 are the valid ones
        p = p.astype(jnp.float64)
    if p.ndim == 0:  # a Python float (bernoulli_.float, bernoulli.p): PyTorch's message shows it
        checks.require((p >= 0) & (p <= 1), checks.BERNOULLI_FLOAT, checks.float_bits(p))
    else:
        checks.require((p >= 0) & (p <= 1), checks.BERNOULLI)


@lowers(aten.bernoulli_.float, aten.bernoulli_.Tensor, rng=True)
@checks.checked
def bernoulli_(x, p=0.5, generator=None, *, key):
    _check_probability(p)
    return jax.random.bernoulli(key, p, x.shape).astype(x.dtype)


@lowers(aten.bernoulli.default, rng=True)
@checks.checked
def bernoulli(x, generator=None, *, key):
    checks.require((x >= 0) & (x <= 1), checks.BERNOULLI)
    return jax.random.bernoulli(key, x.astype(jnp.float32), x.shape).astype(x.dtype)


@lowers(aten.bernoulli.p, rng=True)
@checks.checked
def bernoulli_p(x, p, generator=None, *, key):
    _check_probability(p)
    return jax.random.bernoulli(key, p, x.shape).astype(x.dtype)


def _randint(key, shape, low, high, dtype):
    if jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.bool_:
        return jax.random.randint(key, shape, low, high, dtype=jnp.int64).astype(dtype)
    return jax.random.randint(key, shape, low, high, dtype=jnp.int64).astype(dtype)


def _dtype_top(dtype):
    if dtype == jnp.bool_:
        return 2
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** jnp.finfo(dtype).nmant + 1
    return int(jnp.iinfo(dtype).max) + 1 if jnp.iinfo(dtype).max < 2**62 else 2**62


@lowers(getattr(aten.random_, "from"), rng=True, static_scalars=True)
def random_from(x, low, high=None, generator=None, *, key):
    return _randint(key, x.shape, low, _dtype_top(x.dtype) if high is None else high, x.dtype)


@lowers(aten.random_.to, rng=True, static_scalars=True)
def random_to(x, high, generator=None, *, key):
    return _randint(key, x.shape, 0, high, x.dtype)


@lowers(aten.random_.default, rng=True)
def random_(x, generator=None, *, key):
    return _randint(key, x.shape, 0, _dtype_top(x.dtype), x.dtype)


@lowers(aten.exponential_.default, rng=True)
def exponential_(x, lambd=1.0, generator=None, *, key):
    return (jax.random.exponential(key, x.shape, dtype=jnp.float32) / lambd).astype(x.dtype)


@lowers(aten.randperm.generator_out, rng=True)
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
    scores = logits + jax.random.gumbel(key, probs.shape, jnp.float32)
    return lax.top_k(scores, num_samples)[1].astype(jnp.int64)


# ---------------------------------------------------------------- samplers behind torch.distributions
def _wide(x):
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


@lowers(aten.poisson.default, rng=True)
def poisson(rates, generator=None, *, key):
    return jax.random.poisson(key, _wide(rates), rates.shape, dtype=jnp.int64).astype(rates.dtype)


@lowers(aten.binomial.default, rng=True)
def binomial(count, prob, generator=None, *, key):
    shape = jnp.broadcast_shapes(count.shape, prob.shape)
    return jax.random.binomial(key, _wide(count), _wide(prob), shape, dtype=jnp.float32).astype(count.dtype)


@lowers(aten._standard_gamma.default, rng=True)
def standard_gamma(alpha, generator=None, *, key):
    return jax.random.gamma(key, _wide(alpha), alpha.shape).astype(alpha.dtype)


@lowers(aten._standard_gamma_grad.default)
def standard_gamma_grad(alpha, sample):
    """d sample / d alpha of a Gamma(alpha, 1) draw (implicit reparameterisation: Gamma/Beta/Dirichlet rsample)."""
    return lax.random_gamma_grad(_wide(alpha), _wide(sample)).astype(alpha.dtype)


@lowers(aten._sample_dirichlet.default, rng=True)
def sample_dirichlet(alpha, generator=None, *, key):
    # Normalised Gamma draws along the last dimension, as PyTorch does.
    gammas = jax.random.gamma(key, _wide(alpha), alpha.shape)
    return (gammas / jnp.sum(gammas, axis=-1, keepdims=True)).astype(alpha.dtype)
