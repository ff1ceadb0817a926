"""Special functions computed by quadrature/asymptotics/recurrences match PyTorch's CPU kernels on wide grids."""
import pytest
import torch

_GRID = torch.cat([
    torch.linspace(-60, 60, 2401),
    torch.logspace(-6, 2, 200),
    -torch.logspace(-6, 2, 200),
    torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")]),
])


@pytest.mark.parametrize("name", [
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
    "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
    "spherical_bessel_j0",
])
def test_bessel_functions_on_a_wide_grid(name):
    """Within 2e-6 absolute (or 1e-4 relative) of PyTorch's float32 Cephes kernels over [-60, 60] and 1e-6..100."""
    fn = getattr(torch.special, name)
    x = _GRID[torch.isfinite(_GRID)]
    expected = fn(x)
    actual = fn(x.to("tpu")).cpu()
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=1e-4, equal_nan=True)


def test_airy_ai():
    """Ai(x) on [-30, 15] within 1e-4 relative / 5e-6 absolute of PyTorch's CPU kernel.

    (For x < -20 the phase 2/3 |x|^1.5 > 60 carries float32 rounding of ~5e-6 in both implementations.)
    """
    x = torch.linspace(-30, 15, 2001)
    torch.testing.assert_close(torch.special.airy_ai(x.to("tpu")).cpu(), torch.special.airy_ai(x), atol=5e-6, rtol=1e-4)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_polygamma_for_negative_arguments(n):
    """polygamma(n, x) for x < 0 (jax's own returns NaN there) against PyTorch's float64 result."""
    x = torch.linspace(-9.9, 9.9, 397)
    x = x[(x - x.round()).abs() > 1e-2]  # away from the poles at non-positive integers
    expected = torch.polygamma(n, x.double())
    actual = torch.polygamma(n, x.to("tpu")).cpu().double()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_polygamma_poles(n):
    """At 0 polygamma is +-inf like PyTorch ((-1)^(n+1) inf; digamma(0) = -inf)."""
    zero = torch.zeros(1)
    torch.testing.assert_close(torch.polygamma(n, zero.to("tpu")).cpu(), torch.polygamma(n, zero))


@pytest.mark.parametrize("name", [
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
])
def test_orthogonal_polynomials(name):
    """Degrees -1..12 (a runtime value per element) on [-1.5, 1.5], including the exact points +-1 and 0."""
    fn = getattr(torch.special, name)
    x = torch.cat([torch.linspace(-1.5, 1.5, 61), torch.tensor([-1.0, 0.0, 1.0])]).repeat(14)
    n = torch.arange(-1, 13).repeat_interleave(64).float()
    expected = fn(x, n)
    actual = fn(x.to("tpu"), n.to("tpu")).cpu()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
