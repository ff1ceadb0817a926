"""torch.linalg on tpu beyond the OpInfo sweep: error reporting, info codes, precision policy, lazy conjugation."""
import pytest
import torch

from conftest import assert_matches_cpu


def _spd(n=4, batch=()):
    torch.manual_seed(0)
    a = torch.randn(*batch, n, n)
    return a @ a.mT + n * torch.eye(n)


@pytest.mark.parametrize("fn, matrix, message", [
    (torch.linalg.cholesky, torch.tensor([[1.0, 2.0], [2.0, 1.0]]), "leading minor of order 2 is not positive-definite"),
    (torch.linalg.inv, torch.tensor([[1.0, 2.0], [2.0, 4.0]]), "singular"),
    (lambda a: torch.linalg.solve(a, torch.ones(2, device=a.device)), torch.tensor([[1.0, 2.0], [2.0, 4.0]]), "singular"),
])
def test_failures_raise_pytorchs_errors(fn, matrix, message):
    """A factorization that fails raises torch.linalg.LinAlgError with PyTorch's message (info is checked)."""
    with pytest.raises(torch.linalg.LinAlgError, match=message):
        fn(matrix)
    with pytest.raises(torch.linalg.LinAlgError, match=message):
        fn(matrix.to("tpu"))


@pytest.mark.parametrize("fn, matrix", [
    (lambda a, **k: torch.linalg.cholesky_ex(a, **k), -torch.eye(3)),
    (lambda a, **k: torch.linalg.inv_ex(a, **k), torch.tensor([[1.0, 2.0], [2.0, 4.0]])),
    (lambda a, **k: torch.linalg.solve_ex(a, torch.ones(2, device=a.device), **k), torch.tensor([[1.0, 2.0], [2.0, 4.0]])),
    (lambda a, **k: torch.linalg.lu_factor_ex(a, **k), torch.tensor([[1.0, 2.0], [2.0, 4.0]])),
], ids=["cholesky_ex", "inv_ex", "solve_ex", "lu_factor_ex"])
def test_ex_variants_raise_at_the_call_with_check_errors(fn, matrix):
    """check_errors=True: ATen checks the info after the factorization and raises at the call (out= too)."""
    with pytest.raises((torch.linalg.LinAlgError, RuntimeError)) as expected:
        fn(matrix, check_errors=True)
    with pytest.raises(type(expected.value), match=str(expected.value)[:40].replace("[", r"\[")):
        fn(matrix.to("tpu"), check_errors=True)
    assert fn(matrix.to("tpu"))[-1].cpu().tolist() == fn(matrix)[-1].tolist()  # without it: info only


def test_cholesky_ex_out_checks_errors_too():
    factor, info = torch.empty(0, device="tpu"), torch.empty(0, dtype=torch.int32, device="tpu")
    with pytest.raises(torch.linalg.LinAlgError, match="leading minor of order 1"):
        torch.linalg.cholesky_ex(-torch.eye(3, device="tpu"), check_errors=True, out=(factor, info))
    assert info.cpu().item() == 1


def test_eigh_takes_lowercase_uplo_and_eig_refuses_non_finite_input():
    a = torch.tensor([[2.0, 9.0, 9.0], [1.0, 3.0, 9.0], [0.5, 0.25, 4.0]])  # lower and upper triangles differ
    for uplo in ("l", "u"):
        torch.testing.assert_close(torch.linalg.eigvalsh(a.to("tpu"), UPLO=uplo).cpu(), torch.linalg.eigvalsh(a, UPLO=uplo))
    nan = torch.eye(3)
    nan[0, 1] = float("nan")
    with pytest.raises(RuntimeError, match="input tensor should not contain infs or NaNs"):
        torch.linalg.eig(nan)
    with pytest.raises(RuntimeError, match="input tensor should not contain infs or NaNs"):
        torch.linalg.eig(nan.to("tpu"))  # at the call, as on CPU and CUDA


def test_info_codes():
    """cholesky_ex/inv_ex/lu_factor_ex report info like LAPACK: 0 on success, 1 + the failing index otherwise."""
    bad = torch.stack([_spd(3), torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])])
    assert torch.linalg.cholesky_ex(bad.to("tpu")).info.cpu().tolist() == torch.linalg.cholesky_ex(bad).info.tolist()
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    assert torch.linalg.inv_ex(singular.to("tpu")).info.item() == 2
    assert torch.linalg.lu_factor_ex(singular.to("tpu")).info.item() == 2


@pytest.mark.parametrize("fn", [
    torch.linalg.cholesky, torch.linalg.inv, torch.linalg.det, lambda a: torch.linalg.slogdet(a),
    lambda a: torch.linalg.eigh(a).eigenvalues, lambda a: torch.linalg.svdvals(a),
    lambda a: torch.linalg.solve(a, a[..., :1]), lambda a: torch.linalg.qr(a).R.abs(),
    lambda a: torch.cholesky_solve(a[..., :2], torch.linalg.cholesky(a)),
])
def test_factorizations_ignore_the_matmul_precision_policy(fn):
    """At float32 matmul precision "medium" (bf16 products) factorizations still give float32 accuracy."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert_matches_cpu(fn, _spd(6, (2,)), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_products_follow_the_matmul_precision_policy():
    """ormqr multiplies by Q: at "medium" it rounds operands to bfloat16 (like every float32 product here)."""
    torch.manual_seed(0)
    a, tau = torch.geqrf(torch.randn(16, 16))
    c = torch.randn(16, 16) * 1000 + 1
    exact = torch.ormqr(a, tau, c)
    highest = torch.ormqr(a.to("tpu"), tau.to("tpu"), c.to("tpu")).cpu()
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        medium = torch.ormqr(a.to("tpu"), tau.to("tpu"), c.to("tpu")).cpu()
    finally:
        torch.set_float32_matmul_precision(previous)
    torch.testing.assert_close(highest, exact, atol=1e-2, rtol=1e-4)
    assert (medium - exact).abs().max() > (highest - exact).abs().max()


def test_conjugate_views_reach_products_resolved():
    """Lazily conjugated complex views (x.conj(), x.mH) give the right values in mm/bmm/dot/vdot/copy/clone,
    also when a program for the same shapes without the bits is cached (the boxed hit path refuses them)."""
    torch.manual_seed(0)
    a = torch.randn(3, 4, dtype=torch.complex64)
    b = torch.randn(4, 2, dtype=torch.complex64)
    v = torch.randn(4, dtype=torch.complex64)
    for fn in (lambda a, b, v: a @ b, lambda a, b, v: a.clone(), lambda a, b, v: torch.dot(v, v),
               lambda a, b, v: a.conj() @ b, lambda a, b, v: a.mH.mH @ b.conj(), lambda a, b, v: torch.vdot(v, v.conj()),
               lambda a, b, v: torch.dot(v.conj(), v), lambda a, b, v: a.conj().clone(),
               lambda a, b, v: torch.empty(3, 4, dtype=torch.complex64, device=a.device).copy_(a.conj()),
               lambda a, b, v: a._neg_view().clone(), lambda a, b, v: torch.addmm(a[:, :2], a.conj(), b)) * 2:
        assert_matches_cpu(fn, a, b, v)


def test_det_keeps_pytorchs_factor_layout_for_backward():
    """det's backward (which reuses the forward LU) matches CPU for row- and column-major inputs."""
    a = torch.randn(5, 5, dtype=torch.float32)
    assert_matches_cpu(torch.linalg.det, a.requires_grad_(), grads=True, atol=1e-4, rtol=1e-4)
    assert_matches_cpu(lambda x: torch.linalg.det(x.mT), a, grads=True, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn", [lambda a, out: torch.linalg.cholesky(a, out=out),
                                lambda a, out: torch.linalg.inv(a, out=out)], ids=["cholesky", "inv"])
def test_a_resized_out_warns_once_as_on_cpu(fn):
    """PyTorch's C++ meta kernels warn about the resize too, during the program build: those warnings are
    caught there (they would surface at the user's call, beside the executor's own)."""
    import warnings

    counts = []
    for device in ("cpu", "tpu"):
        out = torch.empty(2, 3, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn(torch.eye(3, device=device) * 2, out)
        counts.append(sum("was resized" in str(w.message) for w in caught))
        assert out.shape == (3, 3)
    assert counts == [1, 1]


@pytest.mark.parametrize("dtypes", [(torch.int64, torch.bool), (torch.bool, torch.bool), (torch.bool, torch.int64),
                                    (torch.float32, torch.bool)])
def test_addr_of_bool_and_integer_operands_matches_cpu(dtypes):
    """torch.addr promotes its three tensors: bool vectors into an integer or float input are 0/1 factors,
    and an all-bool addr is (x and beta) or (v1 and v2 and alpha)."""
    x_dtype, v_dtype = dtypes
    x = torch.tensor([[2, 0, 1], [1, 1, 0], [0, 3, 1]]).to(x_dtype)
    v1, v2 = torch.tensor([1, 0, 1]).to(v_dtype), torch.tensor([1, 1, 0]).to(v_dtype)
    kwargs = {} if torch.bool in (x.dtype, v1.dtype) and x_dtype == v_dtype else dict(beta=2, alpha=3)
    expected = torch.addr(x, v1, v2, **kwargs)
    got = torch.addr(x.to("tpu"), v1.to("tpu"), v2.to("tpu"), **kwargs)
    assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("shapes", [((2, 2, 0, 0), (2, 2, 0, 0)), ((2, 2, 3, 0), (2, 2, 3, 2)), ((0, 3), (0, 2))])
def test_lstsq_of_empty_matrices_matches_cpu(shapes):
    """linalg.lstsq with an empty dimension gives CPU's zero solution, rank and result shapes."""
    a, b = torch.rand(shapes[0]), torch.rand(shapes[1])
    expected = torch.linalg.lstsq(a, b)
    got = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"))
    for g, e in zip(got, expected):
        assert g.shape == e.shape and torch.equal(g.cpu(), e)


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 5), (4, 4)])
def test_geqrf_returns_lapacks_column_major_reflectors(shape):
    """geqrf's reflectors are column-major, as CPU and CUDA return them (callers such as test_ormqr read the layout)."""
    torch.manual_seed(0)
    a = torch.randn(*shape)
    expected = torch.geqrf(a)
    got = torch.geqrf(a.to("tpu"))
    for e, g in zip(expected, got):
        assert g.stride() == e.stride()
        torch.testing.assert_close(g.cpu(), e, atol=1e-5, rtol=1e-5)


def test_matrix_exp_in_float32_is_as_accurate_as_cpus():
    """matrix_exp scales and squares a Taylor polynomial as ATen does: in float32 its error against the float64
    result stays at CPU's (JAX's Pade-based expm was 300x further off for 1-norms near 6)."""
    torch.manual_seed(0)
    for n in (2, 3, 5):
        x = torch.eye(n) + torch.rand(n, n) / n**2
        x = (x / x.abs().sum(-2).max() * 6.02).expand(3, n, n) * torch.tensor([1.0, -1.0, 0.3]).view(3, 1, 1)
        exact = torch.linalg.matrix_exp(x.double())
        cpu_error = (torch.linalg.matrix_exp(x).double() - exact).abs().max()
        tpu_error = (torch.linalg.matrix_exp(x.to("tpu")).cpu().double() - exact).abs().max()
        assert tpu_error <= 2 * cpu_error + 1e-6 * exact.abs().max()
