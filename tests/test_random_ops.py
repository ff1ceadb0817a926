"""Random ops' statistics on tpu (the OpInfo sweep compares only dtype/shape/device for them)."""

import math

import pytest
import torch

from conftest import no_fallback


N = 200_000


def _close(value, expected, tolerance):
    assert abs(float(value) - expected) < tolerance, (float(value), expected)


def test_multinomial_with_replacement_frequencies():
    """Draw frequencies match the probabilities (5 sigma); zero-probability classes never appear."""
    torch.manual_seed(0)
    p = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    with no_fallback():
        draws = torch.multinomial(p.to("tpu"), N, replacement=True).cpu()
    assert draws.shape == (2, N) and draws.dtype == torch.int64
    for row in range(2):
        freq = torch.bincount(draws[row], minlength=4).double() / N
        sigma = (p[row].double() * (1 - p[row].double()) / N).sqrt()
        assert ((freq - p[row].double()).abs() <= 5 * sigma + 1e-12).all(), freq


def test_multinomial_without_replacement_draws_distinct_classes():
    """Without replacement every row holds distinct classes, never a zero-probability one, first draw ~ p."""
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.6, 0.3, 0.0, 0.0])
    with no_fallback():
        draws = torch.multinomial(p.to("tpu").expand(4000, 5).contiguous(), 3).cpu()
    assert ((draws != 3) & (draws != 4)).all()
    assert (draws.sort(dim=1).values.diff(dim=1) != 0).all()
    first = torch.bincount(draws[:, 0], minlength=5).double() / 4000
    assert (first[:3] - p[:3].double()).abs().max() < 0.04


@pytest.mark.parametrize("name, make, mean, std", [
    ("uniform_", lambda t: t.uniform_(-2.0, 4.0), 1.0, 6 / 12**0.5),
    ("normal_", lambda t: t.normal_(3.0, 2.0), 3.0, 2.0),
    ("exponential_", lambda t: t.exponential_(2.0), 0.5, 0.5),
    ("log_normal_", lambda t: t.log_normal_(0.0, 0.5), 2.718281828**0.125, None),
    ("geometric_", lambda t: t.geometric_(0.25), 4.0, (0.75 / 0.25**2) ** 0.5),
    ("bernoulli_", lambda t: t.bernoulli_(0.3), 0.3, (0.3 * 0.7) ** 0.5),
    ("normal(tensor, tensor)", lambda t: torch.normal(torch.full_like(t, -1.0), torch.full_like(t, 0.5)), -1.0, 0.5),
    ("bernoulli(tensor)", lambda t: torch.bernoulli(torch.full_like(t, 0.8)), 0.8, (0.8 * 0.2) ** 0.5),
])
def test_distribution_moments(name, make, mean, std):
    """Sample mean (and standard deviation) within a few standard errors of the distribution's."""
    torch.manual_seed(0)
    with no_fallback():
        sample = make(torch.empty(N, device="tpu")).cpu().double()
    assert torch.isfinite(sample).all()
    spread = std if std is not None else sample.std().item()
    _close(sample.mean(), mean, 6 * spread / N**0.5)
    if std is not None:
        _close(sample.std(), std, 0.02 * std)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float64])
def test_geometric_of_other_dtypes(dtype):
    """geometric_ draws integers into any real dtype, as ATen (the reference decomposition ran uniform_ on self)."""
    torch.manual_seed(0)
    with no_fallback():
        sample = torch.empty(N, dtype=dtype, device="tpu").geometric_(0.25).cpu()
    assert sample.dtype == dtype and sample.min() >= 1
    _close(sample.double().mean(), 4.0, 6 * (0.75 / 0.25**2) ** 0.5 / N**0.5)


def test_cauchy_median_and_quartiles():
    """cauchy_(median, sigma): median and quartiles at median -+ sigma."""
    torch.manual_seed(0)
    with no_fallback():
        sample = torch.empty(N, device="tpu").cauchy_(1.0, 2.0).cpu()
    q = torch.quantile(sample[:100_000], torch.tensor([0.25, 0.5, 0.75]))
    torch.testing.assert_close(q, torch.tensor([-1.0, 1.0, 3.0]), atol=0.08, rtol=0)


def test_random_ops_are_reproducible():
    """manual_seed makes multinomial and friends repeat their draws."""
    p = torch.rand(3, 7).to("tpu")

    def draw():
        torch.manual_seed(5)
        return [torch.multinomial(p, 4).cpu(), torch.empty(10, device="tpu").cauchy_().cpu()]

    for a, b in zip(draw(), draw()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, draw, mean, var", [
    ("poisson", lambda: torch.poisson(torch.full((N,), 3.5, device="tpu")), 3.5, 3.5),
    ("binomial", lambda: torch.binomial(torch.full((N,), 10.0, device="tpu"), torch.full((N,), 0.3, device="tpu")),
     3.0, 2.1),
    ("standard_gamma", lambda: torch._standard_gamma(torch.full((N,), 2.5, device="tpu")), 2.5, 2.5),
    ("dirichlet", lambda: torch.distributions.Dirichlet(torch.tensor([1.0, 3.0], device="tpu")).sample((N,))[:, 0],
     0.25, 0.25 * 0.75 / 5),
])
def test_distribution_samplers(name, draw, mean, var):
    """The samplers behind torch.distributions run natively with the right mean and variance."""
    torch.manual_seed(0)
    with no_fallback():
        sample = draw().cpu().double()
    _close(sample.mean(), mean, 6 * var**0.5 / N**0.5)
    _close(sample.var(), var, 0.05 * var)


def test_gamma_rsample_gradient():
    """Gamma.rsample's implicit-reparameterisation gradient (_standard_gamma_grad) matches PyTorch's."""
    x = torch.tensor([0.05, 0.5, 1.0, 3.0, 20.0])
    alpha = torch.tensor([0.3, 0.7, 2.0, 5.0, 18.0])
    with no_fallback():
        actual = torch._standard_gamma_grad(alpha.to("tpu"), x.to("tpu")).cpu()
    torch.testing.assert_close(actual, torch._standard_gamma_grad(alpha, x), rtol=1e-4, atol=1e-5)


def test_flat_draws_are_jax_randoms_numbers():
    """torch_tpu.ops._draws draws 1-D and reshapes (XLA:CPU compiles that several times faster): the
    numbers must be jax.random's own N-d draw's, jitted as the ops run them, for every function it wraps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from torch_tpu.ops import _draws

    torch.zeros(1, device="tpu")  # the device's JAX configuration (64-bit types) is in place
    shape = (2, 3, 4)
    p = jnp.linspace(0.1, 0.9, math.prod(shape), dtype=jnp.float32).reshape(shape)
    calls = {
        "uniform": lambda r, k: r.uniform(k, shape, jnp.float32, -1.0, p + 1),
        "normal": lambda r, k: r.normal(k, shape, jnp.float64),
        "bits": lambda r, k: r.bits(k, shape, jnp.uint64),
        "exponential": lambda r, k: r.exponential(k, shape, jnp.float32),
        "gumbel": lambda r, k: r.gumbel(k, shape, jnp.float32),
        "bernoulli": lambda r, k: (r.bernoulli(k, p, shape), r.bernoulli(k, 0.3, shape)),
        "gamma": lambda r, k: r.gamma(k, p + 0.5, shape),
        "poisson": lambda r, k: r.poisson(k, p * 5, shape, jnp.int64),
        "binomial": lambda r, k: r.binomial(k, p * 10 + 1, p, shape, jnp.float32),
    }
    key = jax.random.key(7)
    for name, call in calls.items():
        ours, theirs = jax.jit(lambda k: (call(_draws, k), call(jax.random, k)))(key)  # one compile each
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True), name
