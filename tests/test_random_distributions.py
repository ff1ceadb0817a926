"""Every random OpInfo entry checked by distribution on tpu (the sweep compares only their dtype/shape/device).

For each entry in test_opinfo.METADATA_ONLY with random values, a large seeded draw on tpu has the
mean, variance and support PyTorch documents (within a few standard errors), and the same seed
reproduces the draw. A new random entry in the sweep must get a check here
(test_every_random_entry_has_a_distribution_check).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import test_opinfo
from conftest import TPU, no_fallback

N = 100_000


def _moments(x, mean, var, sigmas=6.0):
    """Sample mean within `sigmas` standard errors of `mean`; sample variance within 5% of `var`."""
    x = x.double()
    assert abs(x.mean().item() - mean) < sigmas * math.sqrt(var / x.numel()) + 1e-12, (x.mean().item(), mean)
    assert abs(x.var().item() - var) < 0.05 * var + 1e-12, (x.var().item(), var)


def _ints(x):
    return torch.equal(x, x.round())


def check_bernoulli():
    x = torch.bernoulli(torch.full((N,), 0.3, device=TPU)).cpu()
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    _moments(x, 0.3, 0.21)
    return x


def check_cauchy():
    x = torch.empty(N, device=TPU).cauchy_(1.0, 2.0).cpu()
    q = torch.quantile(x, torch.tensor([0.25, 0.5, 0.75]))
    torch.testing.assert_close(q, torch.tensor([-1.0, 1.0, 3.0]), atol=0.1, rtol=0)  # median -+ sigma
    return x


def check_exponential():
    x = torch.empty(N, device=TPU).exponential_(2.0).cpu()
    assert (x >= 0).all()
    _moments(x, 0.5, 0.25)
    return x


def check_geometric():
    x = torch.empty(N, device=TPU).geometric_(0.25).cpu()
    assert (x >= 1).all() and _ints(x)
    _moments(x, 4.0, 0.75 / 0.25**2)
    return x


def check_log_normal():
    x = torch.empty(N, device=TPU).log_normal_(0.5, 0.4).cpu()
    assert (x > 0).all()
    _moments(x.log(), 0.5, 0.16)
    _moments(x, math.exp(0.5 + 0.08), (math.exp(0.16) - 1) * math.exp(1 + 0.16))
    return x


def check_multinomial():
    p = torch.tensor([0.1, 0.6, 0.3, 0.0])
    x = torch.multinomial(p.to(TPU), N, replacement=True).cpu()
    freq = torch.bincount(x, minlength=4).double() / N
    sigma = (p.double() * (1 - p.double()) / N).sqrt()
    assert ((freq - p.double()).abs() <= 6 * sigma + 1e-12).all(), freq
    return x


def check_normal():
    x = torch.normal(torch.full((N,), -1.0, device=TPU), torch.full((N,), 0.5, device=TPU)).cpu()
    _moments(x, -1.0, 0.25)
    return x


def check_normal_in_place():
    x = torch.empty(N, device=TPU).normal_(3.0, 2.0).cpu()
    _moments(x, 3.0, 4.0)
    return x


def check_normal_number_mean():
    x = torch.normal(2.0, torch.full((N,), 3.0, device=TPU)).cpu()
    _moments(x, 2.0, 9.0)
    return x


def check_uniform():
    x = torch.empty(N, device=TPU).uniform_(-2.0, 4.0).cpu()
    assert (x >= -2).all() and (x < 4).all()
    _moments(x, 1.0, 36 / 12)
    return x


def check_rand_like():
    x = torch.rand_like(torch.empty(N, device=TPU)).cpu()
    assert (x >= 0).all() and (x < 1).all()
    _moments(x, 0.5, 1 / 12)
    return x


def check_randn_like():
    x = torch.randn_like(torch.empty(N, device=TPU)).cpu()
    _moments(x, 0.0, 1.0)
    return x


def check_randn():
    x = torch.randn(N, device=TPU).cpu()
    _moments(x, 0.0, 1.0)
    return x


def _discrete_uniform(x, low, high):
    assert _ints(x) and x.min() >= low and x.max() < high
    assert set(x.unique().tolist()) == set(range(low, high))
    n = high - low
    _moments(x, (low + high - 1) / 2, (n * n - 1) / 12)


def check_randint():
    x = torch.randint(-3, 7, (N,), device=TPU).cpu()
    assert x.dtype == torch.int64
    _discrete_uniform(x, -3, 7)
    return x


def check_randint_like():
    x = torch.randint_like(torch.empty(N, device=TPU), 2, 12).cpu()
    _discrete_uniform(x, 2, 12)
    return x


def check_dropout():
    x = torch.rand(N) + 0.5
    out = F.dropout(x.to(TPU), 0.4, training=True).cpu()
    kept = out != 0
    _moments(kept.double(), 0.6, 0.24)
    torch.testing.assert_close(out[kept], x[kept] / 0.6)  # survivors scaled by 1/(1-p)
    return out


def _channel_dropout(fn, shape):
    x = torch.rand(shape) + 0.5
    out = fn(x.to(TPU), 0.4, training=True).cpu()
    planes, xs = out.flatten(2), x.flatten(2)
    dropped = (planes == 0).all(-1)
    kept = (planes != 0).all(-1)
    assert (dropped | kept).all()  # whole channels, never single elements
    _moments(kept.double().flatten(), 0.6, 0.24)
    torch.testing.assert_close(planes[kept], xs[kept] / 0.6)
    return out


def check_dropout2d():
    return _channel_dropout(F.dropout2d, (500, 100, 2, 3))


def check_dropout3d():
    return _channel_dropout(F.dropout3d, (500, 100, 2, 1, 3))


_SELU_ALPHA = 1.6732632423543772 * 1.0507009873554805  # alpha' = -lambda * alpha


def _alpha_form(x, out, p):
    """alpha dropout keeps a*x+b or sets a*(-alpha')+b with a, b keeping mean 0 and variance 1."""
    a = 1 / math.sqrt((_SELU_ALPHA**2 * p + 1) * (1 - p))
    b = a * _SELU_ALPHA * p
    kept = torch.isclose(out, a * x + b, atol=1e-5)
    dropped = torch.isclose(out, torch.full_like(out, -a * _SELU_ALPHA + b), atol=1e-5)
    assert (kept | dropped).all()
    return kept


def check_alpha_dropout():
    x = torch.randn(N)
    out = F.alpha_dropout(x.to(TPU), 0.3, training=True).cpu()
    kept = _alpha_form(x, out, 0.3)
    _moments(kept.double(), 0.7, 0.21)
    _moments(out, 0.0, 1.0)  # self-normalising: a standard normal input keeps mean 0, variance 1
    return out


def check_feature_alpha_dropout():
    x = torch.randn(1000, 100, 4)
    out = F.feature_alpha_dropout(x.to(TPU), 0.3, training=True).cpu()
    kept = _alpha_form(x, out, 0.3)
    assert (kept.all(-1) | (~kept).all(-1)).all()  # per channel
    _moments(kept.all(-1).double().flatten(), 0.7, 0.21)
    return out


def check_rrelu():
    x = -torch.rand(N) - 0.1
    out = F.rrelu(x.to(TPU), 0.1, 0.3, training=True).cpu()
    slope = out / x
    assert (slope >= 0.1 - 1e-6).all() and (slope <= 0.3 + 1e-6).all()
    _moments(slope, 0.2, 0.2**2 / 12)  # uniform in [lower, upper]
    pos = torch.rand(100) + 0.1
    assert torch.equal(F.rrelu(pos.to(TPU), 0.1, 0.3, training=True).cpu(), pos)
    return out


def _fractional(fn, shape, kernel, out_size):
    x = torch.randn(shape)
    out, idx = fn(x.to(TPU), kernel, output_size=out_size, return_indices=True)
    out, idx = out.cpu(), idx.cpu()
    flat = x.flatten(2)
    # Each output is the input element its index names, and the max of a kernel window starting at a
    # pseudo-random offset: no larger than the input's max and never below the window-free lower bound.
    torch.testing.assert_close(flat.gather(2, idx.flatten(2)), out.flatten(2), rtol=0, atol=0)
    assert (idx.flatten(2).diff(dim=-1) != 0).any()
    # Regions tile the input: along each dim the chosen rows increase with the output position.
    return out


def check_fractional_max_pool2d():
    out = _fractional(F.fractional_max_pool2d, (8, 4, 20, 20), 3, 7)
    assert out.shape == (8, 4, 7, 7)
    return out


def check_fractional_max_pool3d():
    out = _fractional(F.fractional_max_pool3d, (2, 3, 10, 10, 10), 2, 4)
    assert out.shape == (2, 3, 4, 4, 4)
    return out


def _low_rank(m, n, k):
    g = torch.Generator().manual_seed(1)
    return torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g)


def check_svd_lowrank():
    a = _low_rank(60, 40, 4)
    u, s, v = torch.svd_lowrank(a.to(TPU), q=6, niter=3)
    torch.testing.assert_close(s.cpu()[:4], torch.linalg.svdvals(a)[:4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((u @ torch.diag(s) @ v.mT).cpu(), a, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close((u.mT @ u).cpu(), torch.eye(6), atol=1e-4, rtol=0)
    return s.cpu()


def check_pca_lowrank():
    a = _low_rank(60, 40, 3) + 5.0  # pca centres the columns
    u, s, v = torch.pca_lowrank(a.to(TPU), q=5, niter=3)
    centred = a - a.mean(0, keepdim=True)
    torch.testing.assert_close(s.cpu()[:3], torch.linalg.svdvals(centred)[:3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((u[:, :3] @ torch.diag(s[:3]) @ v[:, :3].mT).cpu(), centred, rtol=1e-3, atol=1e-3)
    return s.cpu()


def check_sdpa_dropout():
    q = torch.randn(4, 2, 64, 8)
    v = torch.randn(4, 2, 64, 8)
    # Uniform attention (zero scores), p=0.5: E[out] = mean of v; each weight is 0 or 2/64.
    out = F.scaled_dot_product_attention(torch.zeros_like(q).to(TPU), torch.zeros_like(q).to(TPU), v.to(TPU),
                                         dropout_p=0.5).cpu()
    mean = v.mean(-2, keepdim=True).expand_as(out)
    # out - mean = (1/64) * sum_j (+-1) v_j with independent fair signs: mean 0, variance E[v^2]/64.
    err = out - mean
    var = (v * v).mean().item() / 64
    assert abs(err.mean().item()) < 6 * math.sqrt(var / err.numel())
    assert abs(err.var().item() - var) < 0.1 * var
    return out


CHECKS = {
    "bernoulli": check_bernoulli, "cauchy": check_cauchy, "exponential": check_exponential,
    "geometric": check_geometric, "log_normal": check_log_normal, "multinomial": check_multinomial,
    "normal": check_normal, "normal.in_place": check_normal_in_place, "normal.number_mean": check_normal_number_mean,
    "uniform": check_uniform, "rand_like": check_rand_like, "randn_like": check_randn_like,
    "randint_like": check_randint_like, "randint": check_randint, "randn": check_randn,
    "nn.functional.dropout": check_dropout, "nn.functional.dropout2d": check_dropout2d,
    "nn.functional.dropout3d": check_dropout3d, "nn.functional.alpha_dropout": check_alpha_dropout,
    "nn.functional.feature_alpha_dropout.with_train": check_feature_alpha_dropout,
    "nn.functional.rrelu": check_rrelu, "nn.functional.fractional_max_pool2d": check_fractional_max_pool2d,
    "nn.functional.fractional_max_pool3d": check_fractional_max_pool3d, "svd_lowrank": check_svd_lowrank,
    "pca_lowrank": check_pca_lowrank, "nn.functional.scaled_dot_product_attention": check_sdpa_dropout,
}


def test_every_random_entry_has_a_distribution_check():
    random = {n for n, r in test_opinfo.METADATA_ONLY.items() if "random" in (r if isinstance(r, str) else r[0])}
    random.discard("nn.functional.multi_head_attention_forward")  # its dropout is sdpa's (checked there)
    assert random <= set(CHECKS), sorted(random - set(CHECKS))


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_random_entry_distribution_and_seed(name):
    with no_fallback():
        torch.manual_seed(1234)
        first = CHECKS[name]()
        torch.manual_seed(1234)
        again = CHECKS[name]()
    assert torch.equal(first, again), "the same seed must reproduce the draw"
