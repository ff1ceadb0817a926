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
import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torch_tpu.ops import checks
from torch_tpu.ops.linalg import _matmul
from torch_tpu.ops.registry import aten, lowers


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


def _check_errors_after(api_name: str):
    """A host check for an `*_ex` op: with check_errors=True (its last argument), ATen's kernel runs
    _linalg_check_errors on its info (its last result) after the factorization, reading it: the error is
    raised at the call, as by the op without _ex (its out= variant too)."""
    def host_check(a, *args):
        if not args[-1]:
            return None
        return lambda results: torch._linalg_check_errors(results[-1], api_name, is_matrix=a.dim() == 2)

    return host_check


@lowers(aten.linalg_cholesky_ex.default, host_check=_check_errors_after("linalg.cholesky_ex"))
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


@lowers(aten._linalg_check_errors.default, eager=False)
@checks.checked
def linalg_check_errors(info, api_name, is_matrix):
    """A compiled graph's check of a factorization's info (the effect AOTAutograd keeps in its graph):
    PyTorch's error at the next materialization point. Eager keeps PyTorch's own kernel, which reads
    the info at the call."""
    flat = info.reshape(-1)
    checks.require(flat == 0, checks.LINALG, value=flat, dim=jnp.argmax(flat != 0),
                   size=checks.linalg_api(api_name, is_matrix))
    return ()


@lowers(aten._linalg_solve_ex.default, host_check=_check_errors_after("torch.linalg.solve_ex"))
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


@lowers(aten.linalg_inv_ex.default, host_check=_check_errors_after("linalg.inv_ex"))
@_highest
def linalg_inv_ex(a, check_errors=False):
    lu, _, permutation = _lu(a)
    return _lu_solve(lu, permutation, _eye_like(a)), _lu_info(lu)


@lowers(aten.linalg_lu_factor_ex.default, host_check=_check_errors_after("torch.linalg.lu_factor_ex"))
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


def _det_input(a, contiguous):
    # PyTorch's contract (its backward relies on it): for a contiguous real A, the LU and pivots
    # returned are those of A^T (free to factor in column-major LAPACK); det is the same.
    return _mT(a) if contiguous[0] and not jnp.issubdtype(a.dtype, jnp.complexfloating) else a


@lowers(aten._linalg_det.default, layout_args=("A",))
@_highest
def linalg_det(a, contiguous):
    lu, pivots, diagonal, sign = _det_parts(_det_input(a, contiguous))
    return sign * jnp.prod(diagonal, axis=-1), lu, pivots


@lowers(aten._linalg_slogdet.default, layout_args=("A",))
@_highest
def linalg_slogdet(a, contiguous):
    lu, pivots, diagonal, sign = _det_parts(_det_input(a, contiguous))
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


def _geqrf_meta(a):
    # LAPACK's layout, as CPU and CUDA return it (ormqr callers read it): column-major reflectors
    *batch, m, n = a.shape
    reflectors = a.new_empty((*batch, n, m)).mT
    return reflectors, a.new_empty((*batch, min(m, n)))


@lowers(aten.geqrf.default, meta=_geqrf_meta)
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
    vectors, values = lax.linalg.eigh(a, lower=UPLO.upper() == "L", symmetrize_input=False)  # ATen takes 'l'/'u' too
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


def _eig_host_check(a):
    # ATen reads the input at the call on every device (CUDA's eig runs on the host); its eigvals does not check
    if not bool(torch.isfinite(a).all()):
        raise RuntimeError("torch.linalg.eig: input tensor should not contain infs or NaNs.")


@lowers(aten.linalg_eig.default, host_check=_eig_host_check)
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


def _expm(a):
    """exp(A) by scaling and squaring of a degree-18 Taylor polynomial, a Taylor method like ATen's (JAX's expm,
    a Pade approximant, loses three digits in float32 after squaring). Scaled to a 1-norm of at most theta,
    where the polynomial's truncation error (theta^19 / 19!) is below the dtype's rounding."""
    theta = (float(jnp.finfo(a.dtype).eps) / 2 * math.factorial(19)) ** (1 / 19)
    norm = jnp.max(jnp.sum(jnp.abs(a), axis=-2), axis=-1)
    squarings = jnp.clip(jnp.ceil(jnp.log2(norm / theta)), 0, 128)  # 2^128 overflows every float dtype
    squarings = jnp.where(jnp.isnan(squarings), 0, squarings)  # (a NaN input gives NaN without squaring)
    scaled = a / (2.0 ** squarings)[..., None, None].astype(a.dtype)
    # Paterson-Stockmeyer: p(A) = sum_j G_j(A) B^j with B = A^4 and G_j of degree 3: 7 products, not 17
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    powers = [eye, scaled, scaled @ scaled]
    powers.append(powers[2] @ scaled)
    b = powers[2] @ powers[2]
    coefficient = [1 / math.factorial(k) for k in range(19)]
    result = None
    for j in range(4, -1, -1):
        group = sum(coefficient[4 * j + i] * powers[i] for i in range(4) if 4 * j + i <= 18)
        result = group if result is None else result @ b + group
    return lax.fori_loop(0, jnp.max(squarings).astype(jnp.int32),
                         lambda i, x: jnp.where((i < squarings)[..., None, None], x @ x, x), result)


@lowers(aten.linalg_matrix_exp.default)
@_highest
def linalg_matrix_exp(a):
    if a.size == 0:
        return a
    wide = a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float16) else a  # half products lose the sum
    return _expm(wide).astype(a.dtype)


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
    keep = s > cutoff * jnp.max(s, axis=-1, keepdims=True, initial=0)  # (initial: s is empty when m or n is 0)
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


# ---------------------------------------------------------------- LDL (Bunch-Kaufman)
# PyTorch returns LAPACK's sytrf/hetrf factorization (lower): LD holds D's 1x1 and 2x2 blocks and L's
# columns below them, pivots LAPACK's 1-based interchanges (negative for a 2x2 block). The pivoting is
# part of the result, so this is LAPACK's unblocked algorithm (sytf2/hetf2, what sytrf runs on matrices
# smaller than its block size), step for step: the same pivot choices, the same interchanges (within the
# trailing matrix only: earlier columns of L are not permuted), the same updates.
_BK_ALPHA = (1 + 17 ** 0.5) / 8


def _cabs1(z):
    return jnp.abs(z.real) + jnp.abs(z.imag) if jnp.iscomplexobj(z) else jnp.abs(z)


def _ldl_one(a, hermitian):
    n = a.shape[-1]
    herm = hermitian and jnp.iscomplexobj(a)
    conj = jnp.conj if herm else (lambda z: z)
    idx = jnp.arange(n)
    # The full symmetric (Hermitian) matrix of the lower triangle: a symmetric interchange of it is
    # LAPACK's interchange of the lower triangle's trailing part.
    s = jnp.tril(a) + conj(_mT(jnp.tril(a, -1)))
    if herm:
        s = s - 1j * jnp.diag(jnp.diagonal(s).imag)

    def diag_abs(value):
        return jnp.abs(value.real) if herm else _cabs1(value)

    def body(state):
        k, s, ld, ipiv, info = state
        absakk = diag_abs(s[k, k])
        colabs = jnp.where(idx > k, _cabs1(s[:, k]), -1.0)
        imax = jnp.argmax(colabs)  # the first largest, as LAPACK's IxAMAX
        colmax = jnp.where(k < n - 1, colabs[imax], 0.0)
        zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        rowabs = _cabs1(s[imax, :])
        rowmax = jnp.maximum(jnp.max(jnp.where((idx >= k) & (idx < imax), rowabs, -1.0)),
                             jnp.max(jnp.where(idx > imax, rowabs, -1.0)))
        keep = zero | (absakk >= _BK_ALPHA * colmax) | (absakk >= _BK_ALPHA * colmax * (colmax / rowmax))
        one_by_one = keep | (diag_abs(s[imax, imax]) >= _BK_ALPHA * rowmax)
        kp = jnp.where(keep, k, imax)
        kstep = jnp.where(one_by_one, 1, 2)
        kk = k + kstep - 1
        perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
        s = s[perm][:, perm]

        def step1(s):
            d = s[k, k].real if herm else s[k, k]
            x = jnp.where(idx > k, s[:, k], 0)
            x = jnp.where(zero, 0, x)
            scale = jnp.where(zero, 0, 1 / d)
            s = s - scale * jnp.outer(x, conj(x))
            column = jnp.where(idx > k, x * scale, jnp.where(idx == k, s[k, k], 0))
            return s, column, jnp.zeros_like(column)

        def step2(s):
            below = idx > k + 1
            x0, x1 = jnp.where(below, s[:, k], 0), jnp.where(below, s[:, k + 1], 0)
            if herm:
                d = jnp.abs(s[k + 1, k])
                d11, d22 = s[k + 1, k + 1].real / d, s[k, k].real / d
                tt = 1 / (d11 * d22 - 1)
                d21 = s[k + 1, k] / d
                d = tt / d
                wk = d * (d11 * x0 - d21 * x1)
                wkp1 = d * (d22 * x1 - jnp.conj(d21) * x0)
            else:
                d21 = s[k + 1, k]
                d11, d22 = s[k + 1, k + 1] / d21, s[k, k] / d21
                d21 = (1 / (d11 * d22 - 1)) / d21
                wk = d21 * (d11 * x0 - x1)
                wkp1 = d21 * (d22 * x1 - x0)
            s = s - jnp.outer(x0, conj(wk)) - jnp.outer(x1, conj(wkp1))
            first = jnp.where(below, wk, jnp.where(idx == k, s[k, k], jnp.where(idx == k + 1, s[k + 1, k], 0)))
            second = jnp.where(below, wkp1, jnp.where(idx == k + 1, s[k + 1, k + 1], 0))
            return s, first, second

        s, first, second = lax.cond(kstep == 1, step1, step2, s)
        ld = ld.at[:, k].set(first)
        ld = jnp.where((kstep == 2) & (idx[None, :] == k + 1), second[:, None], ld)
        pivot = (kp + 1).astype(jnp.int32)
        ipiv = jnp.where(kstep == 1, ipiv.at[k].set(pivot), ipiv.at[k].set(-pivot).at[k + 1].set(-pivot))
        info = jnp.where((info == 0) & zero, k + 1, info).astype(jnp.int32)
        return k + kstep, s, ld, ipiv, info

    state = (jnp.asarray(0), s, jnp.zeros_like(a), jnp.zeros((n,), jnp.int32), jnp.asarray(0, jnp.int32))
    _, _, ld, ipiv, info = lax.while_loop(lambda st: st[0] < n, body, state)
    return ld, ipiv, info


def _batched(fn, a, *rest):
    batch = a.shape[:-2]
    flat = a.reshape((-1,) + a.shape[-2:])
    out = jax.vmap(lambda m: fn(m, *rest))(flat)
    return tuple(o.reshape(batch + o.shape[1:]) for o in out)


@lowers(aten.linalg_ldl_factor_ex.default, host_check=_check_errors_after("torch.linalg.ldl_factor_ex"))
def linalg_ldl_factor_ex(a, hermitian=False, check_errors=False):
    if a.shape[-1] == 0 or math.prod(a.shape[:-2]) == 0:
        return a, jnp.zeros(a.shape[:-1], jnp.int32), jnp.zeros(a.shape[:-2], jnp.int32)
    return _batched(_ldl_one, a, hermitian)


def _ldl_solve_one(ld, ipiv, b, hermitian):
    n = ld.shape[-1]
    herm = hermitian and jnp.iscomplexobj(ld)
    conj = jnp.conj if herm else (lambda z: z)
    idx = jnp.arange(n)

    def swap(b, i, j):
        perm = jnp.where(idx == i, j, jnp.where(idx == j, i, idx))
        return b[perm]

    def forward(state):  # L D y = b, pivots applied in order
        k, b = state
        p = ipiv[k]

        def one(b):
            b = swap(b, k, p - 1)
            column = jnp.where(idx > k, ld[:, k], 0)
            b = b - column[:, None] * b[k][None, :]
            d = ld[k, k].real if herm else ld[k, k]
            return b.at[k].set(b[k] / d)

        def two(b):
            b = swap(b, k + 1, -p - 1)
            below = idx > k + 1
            b = b - jnp.where(below, ld[:, k], 0)[:, None] * b[k][None, :] \
                  - jnp.where(below, ld[:, k + 1], 0)[:, None] * b[k + 1][None, :]
            akm1k = ld[k + 1, k]
            akm1 = ld[k, k] / conj(akm1k)
            ak = ld[k + 1, k + 1] / akm1k
            denom = akm1 * ak - 1
            bkm1, bk = b[k] / conj(akm1k), b[k + 1] / akm1k
            return b.at[k].set((ak * bkm1 - bk) / denom).at[k + 1].set((akm1 * bk - bkm1) / denom)

        return k + jnp.where(p > 0, 1, 2), lax.cond(p > 0, one, two, b)

    def backward(state):  # L^T x = y (L^H when Hermitian), pivots undone in reverse
        k, b = state
        p = ipiv[k]
        below = idx > k
        lk = conj(jnp.where(below, ld[:, k], 0))

        def one(b):
            b = b.at[k].add(-(lk @ b))
            return swap(b, k, p - 1)

        def two(b):  # k is the block's second row
            lkm1 = conj(jnp.where(below, ld[:, k - 1], 0))
            b = b.at[k].add(-(lk @ b)).at[k - 1].add(-(lkm1 @ b))
            return swap(b, k, -p - 1)

        return k - jnp.where(p > 0, 1, 2), lax.cond(p > 0, one, two, b)

    _, b = lax.while_loop(lambda st: st[0] < n, forward, (jnp.asarray(0), b))
    _, b = lax.while_loop(lambda st: st[0] >= 0, backward, (jnp.asarray(n - 1), b))
    return b


@lowers(aten.linalg_ldl_solve.default)
@_highest
def linalg_ldl_solve(ld, pivots, b, hermitian=False):
    batch = jnp.broadcast_shapes(ld.shape[:-2], pivots.shape[:-1], b.shape[:-2])
    n = ld.shape[-1]
    if n == 0 or b.shape[-1] == 0 or math.prod(batch) == 0:
        return jnp.broadcast_to(b, batch + b.shape[-2:]).astype(b.dtype)
    ld = jnp.broadcast_to(ld, batch + ld.shape[-2:]).reshape((-1, n, n))
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:]).reshape((-1, n))
    rhs = jnp.broadcast_to(b, batch + b.shape[-2:])
    out = jax.vmap(lambda l, p, r: _ldl_solve_one(l, p, r, hermitian))(ld, pivots, rhs.reshape((-1,) + b.shape[-2:]))
    return out.reshape(rhs.shape)
