"""torch.linalg's factorizations and solvers: cholesky, LU (factor, solve, unpack), QR,
geqrf/householder/ormqr, eigh, eig, SVD, solve, inv, det/slogdet, lstsq, triangular
solves, matrix_exp.

Factorizations and triangular solves run at HIGHEST precision whatever the
float32 matmul policy: their inner products are part of an algorithm, and
one-pass bfloat16 there loses the answer, not a few bits. (ormqr, a product by
Q, follows the policy.)

NOTE(torch-vs-xla): LU pivots are 0-based row swaps in XLA, 1-based (LAPACK)
in PyTorch; a failing factorization gives NaN in XLA where LAPACK stops early:
`info` is derived from the factors (first zero pivot; for Cholesky an
elimination run only on failure).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax import lax

from torch_tpu.ops.linalg import _matmul
from torch_tpu.ops.registry import aten, lowers, prepare


# ---------------------------------------------------------------- helpers
def _highest(fn):
    """Trace `fn` with every inner matrix product at full precision."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x))


def _batch_broadcast(a, b, b_is_vector=False):
    """Broadcast the batch dims of a (..., m, n) and b (..., m, k) (or (..., m) if b_is_vector)."""
    tail = 1 if b_is_vector else 2
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-tail])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-tail:])


def _first_failure(bad):
    """PyTorch's `info`: 1 + the index of the first failing pivot, 0 if none (int32, batch shape)."""
    if bad.shape[-1] == 0:
        return jnp.zeros(bad.shape[:-1], jnp.int32)
    return jnp.where(jnp.any(bad, axis=-1), jnp.argmax(bad, axis=-1) + 1, 0).astype(jnp.int32)


def _eye_like(x, n=None):
    n = x.shape[-1] if n is None else n
    return jnp.broadcast_to(jnp.eye(n, dtype=x.dtype), x.shape[:-2] + (n, n))


@lowers(aten.linalg_cholesky_ex.default)
@_highest
def linalg_cholesky_ex(a, upper=False, check_errors=False):
    # PyTorch reads one triangle (lower, or upper for upper=True): no symmetrization.
    source = _mH(a) if upper else a
    factor = lax.linalg.cholesky(source, symmetrize_input=False)
    failed = jnp.any(~jnp.isfinite(jnp.diagonal(factor, axis1=-2, axis2=-1)))
    # XLA marks a failed factor with NaN throughout; LAPACK's info (the order of the first leading minor
    # that is not positive-definite) needs an elimination: run it only when something failed.
    info = lax.cond(failed, _cholesky_info, lambda m: jnp.zeros(m.shape[:-2], jnp.int32), source)
    factor = jnp.tril(factor)
    return (_mH(factor) if upper else factor), info


def _cholesky_info(a):
    """1 + the first k where the Cholesky pivot a_kk - sum_j L_kj^2 is not positive (0 if none), per matrix."""
    n = a.shape[-1]
    if n == 0:
        return jnp.zeros(a.shape[:-2], jnp.int32)
    index = jnp.arange(n)

    def step(k, carry):
        factor, info = carry
        row = jnp.where(index < k, factor[..., k, :], 0)  # L[k, :k]
        pivot = jnp.real(a[..., k, k] - jnp.sum(row * jnp.conj(row), axis=-1))
        info = jnp.where((info == 0) & ~(pivot > 0), k + 1, info)
        root = jnp.sqrt(jnp.where(pivot > 0, pivot, 1)).astype(a.dtype)
        column = (a[..., :, k] - jnp.einsum("...ij,...j->...i", jnp.where(index < k, factor, 0), jnp.conj(row))) / root[..., None]
        column = jnp.where(index > k, column, jnp.where(index == k, root[..., None], 0))
        return factor.at[..., :, k].set(column), info

    zeros = jnp.zeros(a.shape[:-2], jnp.int32)
    _, info = lax.fori_loop(0, n, step, (jnp.zeros_like(a), zeros))
    return info.astype(jnp.int32)


@lowers(aten.cholesky.default)
def cholesky(a, upper=False):
    return linalg_cholesky_ex(a, upper)[0]


def _triangular(a, b, lower, left=True, transpose=False, conjugate=False, unit=False):
    a, b = _batch_broadcast(a, b)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=transpose,
                                       conjugate_a=conjugate, unit_diagonal=unit)


def _cholesky_solve(b, factor, upper):
    # A = L L^H (or U^H U): solve L y = b, then L^H x = y.
    if upper:
        y = _triangular(factor, b, lower=False, transpose=True, conjugate=True)
        return _triangular(factor, y, lower=False)
    y = _triangular(factor, b, lower=True)
    return _triangular(factor, y, lower=True, transpose=True, conjugate=True)


@lowers(aten._cholesky_solve_helper.default)
@_highest
def cholesky_solve_helper(b, factor, upper):
    return _cholesky_solve(b, factor, upper)


@lowers(aten.cholesky_inverse.default)
@_highest
def cholesky_inverse(factor, upper=False):
    return _cholesky_solve(_eye_like(factor), factor, upper)


@lowers(aten.linalg_solve_triangular.default)
@_highest
def linalg_solve_triangular(a, b, upper, left=True, unitriangular=False):
    return _triangular(a, b, lower=not upper, left=left, unit=unitriangular)


@lowers(aten.triangular_solve.default)
@_highest
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    a_b, _ = _batch_broadcast(a, b)
    return _triangular(a, b, lower=not upper, transpose=transpose, unit=unitriangular), a_b


# ---------------------------------------------------------------- LU and what is built on it
def _lu(a):
    """(LU, 1-based int32 pivots, permutation) of a (..., m, n)."""
    lu, pivots, permutation = lax.linalg.lu(a)
    return lu, (pivots + 1).astype(jnp.int32), permutation


def _lu_info(lu):
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return _first_failure(diagonal == 0)


def _lu_solve(lu, permutation, b, adjoint=False):
    """Solve A x = b (or A^H x = b) for A = P L U given as (lu, permutation); b is (..., n, k)."""
    lu, b = _batch_broadcast(lu, b)
    permutation = jnp.broadcast_to(permutation, lu.shape[:-1])
    if not adjoint:
        pb = jnp.take_along_axis(b, permutation[..., None], axis=-2)
        y = lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)
    # A^H = U^H L^H P^T: solve U^H y = b, L^H z = y, x = P z.
    y = lax.linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    z = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True,
                                    unit_diagonal=True)
    inverse = jnp.argsort(permutation, axis=-1)
    return jnp.take_along_axis(z, inverse[..., None], axis=-2)


def _is_vector_rhs(a, b):
    # PyTorch's rule (linalg_solve_is_vector_rhs).
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


@lowers(aten._linalg_solve_ex.default)
@_highest
def linalg_solve_ex(a, b, left=True, check_errors=False):
    vector = _is_vector_rhs(a, b)
    rhs = b[..., None] if vector else b
    if not left:  # X A = B  <=>  A^T X^T = B^T
        lu, _, permutation = _lu(_mT(a))
        x = _mT(_lu_solve(lu, permutation, _mT(rhs)))
        lu_a, pivots, _ = _lu(a)
    else:
        lu_a, pivots, permutation = _lu(a)
        x = _lu_solve(lu_a, permutation, rhs)
    return (x[..., 0] if vector else x), lu_a, pivots, _lu_info(lu_a)


@lowers(aten.linalg_inv_ex.default)
@_highest
def linalg_inv_ex(a, check_errors=False):
    lu, _, permutation = _lu(a)
    return _lu_solve(lu, permutation, _eye_like(a)), _lu_info(lu)


@lowers(aten.linalg_lu_factor_ex.default)
@_highest
def linalg_lu_factor_ex(a, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("linalg.lu_factor: LU without pivoting is not implemented on the tpu device")
    lu, pivots, _ = _lu(a)
    return lu, pivots, _lu_info(lu)


def _unpack(lu, permutation):
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    # A = P L U with P[permutation[i], i] = 1.
    p = (permutation[..., None, :] == jnp.arange(m)[:, None]).astype(lu.dtype)
    return p, lower, upper


@lowers(aten.linalg_lu.default)
@_highest
def linalg_lu(a, pivot=True):
    if not pivot:
        raise NotImplementedError("linalg.lu: LU without pivoting is not implemented on the tpu device")
    lu, _, permutation = _lu(a)
    return _unpack(lu, permutation)


def _permutation(pivots, m):
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


@lowers(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    p, lower, upper = _unpack(lu, _permutation(pivots, lu.shape[-2]))
    empty = jnp.zeros((0,), lu.dtype)
    return (p if unpack_pivots else empty), (lower if unpack_data else empty), (upper if unpack_data else empty)


@lowers(aten.linalg_lu_solve.default)
@_highest
def linalg_lu_solve(lu, pivots, b, left=True, adjoint=False):
    permutation = _permutation(pivots, lu.shape[-2])
    if left:
        return _lu_solve(lu, permutation, b, adjoint)
    # X A = B  <=>  A^H X^H = B^H (and X A^H = B  <=>  A X^H = B^H)
    return _mH(_lu_solve(lu, permutation, _mH(b), not adjoint))


def _det_parts(a):
    lu, pivots, _ = _lu(a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), axis=-1)
    sign = jnp.where(swaps % 2 == 1, -1, 1).astype(lu.dtype)
    return lu, pivots, diagonal, sign


@prepare(aten._linalg_det.default, aten._linalg_slogdet.default)
def _det_of_transpose(a):
    # PyTorch's contract (its backward relies on it): for a contiguous real A, the LU and
    # pivots returned are those of A^T (free to factor in column-major LAPACK); det is the same.
    if a.is_contiguous() and not a.is_complex():
        a = a.mT
    return (a,), {}


@lowers(aten._linalg_det.default)
@_highest
def linalg_det(a):
    lu, pivots, diagonal, sign = _det_parts(a)
    return sign * jnp.prod(diagonal, axis=-1), lu, pivots


@lowers(aten._linalg_slogdet.default)
@_highest
def linalg_slogdet(a):
    lu, pivots, diagonal, sign = _det_parts(a)
    magnitude = jnp.abs(diagonal)
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        phase = jnp.prod(jnp.where(magnitude == 0, 0, diagonal / jnp.where(magnitude == 0, 1, magnitude)), axis=-1)
        sign = sign * phase
    else:
        sign = sign * jnp.prod(jnp.sign(diagonal), axis=-1)
    return sign, jnp.sum(jnp.log(magnitude), axis=-1), lu, pivots


# ---------------------------------------------------------------- QR, eigen and singular values
@lowers(aten.linalg_qr.default)
@_highest
def linalg_qr(a, mode="reduced"):
    q, r = lax.linalg.qr(a, full_matrices=mode == "complete")
    if mode == "r":
        return jnp.zeros((0,), a.dtype), r
    return q, r


@lowers(aten.geqrf.default)
@_highest
def geqrf(a):
    h, tau = jnp.linalg.qr(a, mode="raw")  # LAPACK's geqrf, with the reflectors transposed
    return _mT(h), tau


@lowers(aten.linalg_householder_product.default)
@_highest
def householder_product(a, tau):
    return lax.linalg.householder_product(a, tau)


@lowers(aten.ormqr.default, precision=True)
def ormqr(a, tau, other, left=True, transpose=False):
    m = a.shape[-2]
    # The full m x m Q: pad the reflectors to m columns (zero taus are identity reflectors).
    square = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, m - a.shape[-1])]) if a.shape[-1] < m else a[..., :m]
    taus = jnp.pad(tau, [(0, 0)] * (tau.ndim - 1) + [(0, m - tau.shape[-1])])
    with jax.default_matmul_precision("highest"):
        q = lax.linalg.householder_product(square, taus)
    if transpose:
        q = _mH(q)
    return _matmul(q, other) if left else _matmul(other, q)


@lowers(aten._linalg_eigh.default)
@_highest
def linalg_eigh(a, UPLO="L", compute_v=True):
    vectors, values = lax.linalg.eigh(a, lower=UPLO == "L", symmetrize_input=False)
    if not compute_v:
        return values, jnp.zeros((0,), a.dtype)
    return values, vectors


@lowers(aten._linalg_svd.default)
@_highest
def linalg_svd(a, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        s = lax.linalg.svd(a, full_matrices=False, compute_uv=False)
        return jnp.zeros((0,), a.dtype), s, jnp.zeros((0,), a.dtype)
    u, s, vh = lax.linalg.svd(a, full_matrices=full_matrices, compute_uv=True)
    return u, s, vh


@lowers(aten.linalg_eig.default)
@_highest
def linalg_eig(a):
    # NOTE(torch-vs-xla): XLA has a general eigensolver on CPU (LAPACK geev) and GPU only; on a
    # TPU this raises when the program compiles.
    values, vectors = jnp.linalg.eig(a)
    return values, vectors


@lowers(aten._linalg_eigvals.default)
@_highest
def linalg_eigvals(a):
    return jnp.linalg.eigvals(a)


@lowers(aten.linalg_eigvals.out)  # (its functional form is CompositeImplicit; out= is a kernel of its own)
def linalg_eigvals_out(a, out):
    return linalg_eigvals(a)


@lowers(aten.linalg_matrix_exp.default)
@_highest
def linalg_matrix_exp(a):
    if a.shape[-1] == 0:
        return a
    wide = a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float16) else a  # expm has no bfloat16
    flat = wide.reshape((-1,) + a.shape[-2:])
    return jax.vmap(jsl.expm)(flat).reshape(a.shape).astype(a.dtype)


@lowers(aten.linalg_lstsq.default)
@_highest
def linalg_lstsq(a, b, rcond=None, driver=None):
    driver = driver or "gelsy"
    vector = b.ndim == a.ndim - 1
    rhs = b[..., None] if vector else b
    a, rhs = _batch_broadcast(a, rhs)
    m, n = a.shape[-2:]
    real = jnp.finfo(a.dtype).dtype
    u, s, vh = lax.linalg.svd(a, full_matrices=False)
    cutoff = (jnp.finfo(real).eps * max(m, n)) if rcond is None or rcond < 0 else rcond
    keep = s > cutoff * jnp.max(s, axis=-1, keepdims=True)
    inverse_s = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
    x = _mH(vh) @ (inverse_s[..., None] * (_mH(u) @ rhs))
    rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
    if driver != "gelsy" and m > n:
        residuals = jnp.sum(jnp.abs(rhs - a @ x) ** 2, axis=-2)
    else:
        residuals = jnp.zeros((0,), real)
    if driver == "gels":
        rank = jnp.zeros((0,), jnp.int64)
    singular = s if driver in ("gelsd", "gelss") else jnp.zeros((0,), real)
    return (x[..., 0] if vector else x), residuals, rank, singular
