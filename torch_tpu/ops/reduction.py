"""Reductions and scans: sum, mean, prod, max/min, arg-max/min, var/std, any/all, norms,
cumulative scans (cumsum/cumprod/cummax/cummin/logcumsumexp) and order statistics
(median, kthvalue, mode). Histograms are in histogram.py.

NOTE(torch-vs-xla): PyTorch accumulates float16/bfloat16 reductions in
float32 and integer/bool sums in int64; we do the same explicitly.
"""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torch_tpu.ops.elementwise import complex_logaddexp
from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes


def _axes(x, dim):
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return None
    if isinstance(dim, int):
        dim = (dim,)
    if x.ndim == 0:
        return None
    return tuple(d % x.ndim for d in dim)


def _acc(x, dtype=None):
    """Cast to the accumulation dtype PyTorch would use."""
    if dtype is not None:
        return x.astype(dtypes.to_jax(dtype))
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.int64)
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return x.astype(jnp.float32)
    return x


@lowers(aten.sum.dim_IntList)
def sum_dim(x, dim=None, keepdim=False, dtype=None):
    x, axes = _acc(x, dtype), _axes(x, dim)
    if _few_long_rows(x, axes):
        return _sum_rows(x, len(axes), keepdim)
    return jnp.sum(x, axis=axes, keepdims=keepdim)


# NOTE(xla-cpu): XLA:CPU's library reduction (YNNPACK) is ~10-50x slower than a loop when it
# sums a few long rows: the leading dims of [8, 128, 256] (a position embedding's gradient,
# summed over the batch) take ~0.7 ms instead of ~0.05 ms, [4, 262144] ~5 ms. There the rows
# are added pairwise: one fused elementwise pass. Other platforms reduce as usual.
_FEW_ROWS, _LONG_ROW = 64, 4096


def _few_long_rows(x, axes) -> bool:
    """Whether `axes` are x's leading dims, holding a few long rows, on XLA:CPU."""
    if not axes or len(axes) == x.ndim or tuple(sorted(axes)) != tuple(range(len(axes))):
        return False
    rows, length = math.prod(x.shape[:len(axes)]), math.prod(x.shape[len(axes):])
    if not (2 <= rows <= _FEW_ROWS and length >= _LONG_ROW):
        return False
    from torch_tpu.runtime import platform

    return platform.get().platform == "cpu"


def _sum_rows(x, n_leading: int, keepdim: bool):
    """The sum over x's first `n_leading` dims as a pairwise sum of its rows."""
    inner = x.shape[n_leading:]
    parts = list(x.reshape(-1, *inner))
    while len(parts) > 1:
        parts = [a + b for a, b in zip(parts[::2], parts[1::2])] + parts[len(parts) - len(parts) % 2:]
    return parts[0].reshape((1,) * n_leading + inner) if keepdim else parts[0]


@lowers(aten.sum.default)
def sum_all(x, dtype=None):
    return jnp.sum(_acc(x, dtype))


@lowers(aten.mean.dim)
def mean_dim(x, dim=None, keepdim=False, dtype=None):
    return jnp.mean(_acc(x, dtype), axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.mean.default)
def mean_all(x, dtype=None):
    return jnp.mean(_acc(x, dtype))


@lowers(aten.prod.dim_int)
def prod_dim(x, dim, keepdim=False, dtype=None):
    return jnp.prod(_acc(x, dtype), axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.prod.default)
def prod_all(x, dtype=None):
    return jnp.prod(_acc(x, dtype))


@lowers(aten.amax.default)
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.amin.default)
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.max.default)
def max_all(x):
    return jnp.max(x)


@lowers(aten.min.default)
def min_all(x):
    return jnp.min(x)


def _arg_reduce(fn, x, dim, keepdim):
    if dim is None:
        return fn(x.reshape(-1)).reshape((1,) * x.ndim if keepdim else ())
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    return fn(x, axis=dim % x.ndim, keepdims=keepdim)


@lowers(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    return jnp.max(x, axis=dim, keepdims=keepdim), _arg_reduce(jnp.argmax, x, dim, keepdim)


@lowers(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    return jnp.min(x, axis=dim, keepdims=keepdim), _arg_reduce(jnp.argmin, x, dim, keepdim)


@lowers(aten.argmax.default)
def argmax(x, dim=None, keepdim=False):
    return _arg_reduce(jnp.argmax, x, dim, keepdim)


@lowers(aten.argmin.default)
def argmin(x, dim=None, keepdim=False):
    return _arg_reduce(jnp.argmin, x, dim, keepdim)


def _correction(correction, unbiased=True):
    if correction is None:
        return 1 if unbiased else 0
    return correction


def _var(name, a, axes, correction, keepdim):
    """ATen's variance: the squared deviations' sum over max(N - correction, 0), with its warning when
    that is <= 0 (inf, or NaN for no deviation; jnp.var gives a negative divisor's NaN or -inf)."""
    n = a.size if axes is None else math.prod(a.shape[d] for d in axes)
    correction = _correction(correction)
    if n - correction > 0:
        return jnp.var(a, axis=axes, ddof=correction, keepdims=keepdim)
    warnings.warn(f"{name}(): degrees of freedom is <= 0. Correction should be strictly less than the reduction "
                  "factor (input numel divided by output numel).", UserWarning, stacklevel=2)
    return jnp.var(a, axis=axes, keepdims=keepdim) * n / 0.0


@lowers(aten.var.correction, static_scalars=True)  # the correction decides the warning
def var(x, dim=None, correction=None, keepdim=False):
    return _var("var", _acc(x), _axes(x, dim), correction, keepdim)


@lowers(aten.std.correction, static_scalars=True)
def std(x, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_var("std", _acc(x), _axes(x, dim), correction, keepdim))


@lowers(aten.var_mean.correction, static_scalars=True)
def var_mean(x, dim=None, correction=None, keepdim=False):
    a, axes = _acc(x), _axes(x, dim)
    return _var("var_mean", a, axes, correction, keepdim), jnp.mean(a, axis=axes, keepdims=keepdim)


@lowers(aten.std_mean.correction, static_scalars=True)
def std_mean(x, dim=None, correction=None, keepdim=False):
    a, axes = _acc(x), _axes(x, dim)
    return jnp.sqrt(_var("std_mean", a, axes, correction, keepdim)), jnp.mean(a, axis=axes, keepdims=keepdim)


@lowers(aten.any.default)
def any_all(x):
    return jnp.any(x)


@lowers(aten.any.dim, aten.any.dims)
def any_dim(x, dim=None, keepdim=False):
    return jnp.any(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.all.default)
def all_all(x):
    return jnp.all(x)


@lowers(aten.all.dim, aten.all.dims)
def all_dim(x, dim=None, keepdim=False):
    return jnp.all(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.logsumexp.default)
def logsumexp(x, dim, keepdim=False):
    a = x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.inexact) else _acc(x)
    return jax.nn.logsumexp(a, axis=_axes(x, dim), keepdims=keepdim)


def _scan(fn, x, dim, dtype):
    """cumsum/cumprod as PyTorch's CPU kernel: cast to `dtype` first, accumulate in its opmath type
    (float32 for bfloat16/float16, int64 for integers), round each output once."""
    if dtype is not None:
        x = x.astype(dtypes.to_jax(dtype))
    out_dtype = x.dtype if dtype is not None or jnp.issubdtype(x.dtype, jnp.inexact) else jnp.int64
    acc = _acc(x)
    out = acc if x.ndim == 0 else fn(acc, axis=dim)
    return out.astype(out_dtype)


@lowers(aten.cumsum.default)
def cumsum(x, dim, dtype=None):
    return _scan(jnp.cumsum, x, dim, dtype)


@lowers(aten.cumprod.default)
def cumprod(x, dim, dtype=None):
    return _scan(jnp.cumprod, x, dim, dtype)


@lowers(aten.linalg_vector_norm.default, static_scalars=True)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    a = jnp.abs(_acc(x, dtype))
    axes = _axes(x, dim)
    if ord == float("inf"):
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    return jnp.sum(a**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


@lowers(aten.hash_tensor.default)
def hash_tensor(x, dim=(), keepdim=False, mode=0):
    """PyTorch's mode 0: XOR of the elements' 64-bit patterns (floats widened to float64, ints to int64)."""
    if mode != 0:
        raise NotImplementedError(f"hash_tensor: mode {mode}")
    if jnp.issubdtype(x.dtype, jnp.floating):
        wide = x.astype(jnp.float64)
    elif x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        wide = x.astype(jnp.uint64)
    else:
        wide = x.astype(jnp.int64)
    bits = lax.bitcast_convert_type(wide, jnp.uint64)
    axes = tuple(range(x.ndim)) if _axes(x, dim) is None else _axes(x, dim)
    out = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, axes)
    if keepdim:
        out = jnp.expand_dims(out, axes)
    return out


@lowers(aten.count_nonzero.dim_IntList)
def count_nonzero(x, dim):
    return jnp.sum(x != 0, axis=_axes(x, dim)).astype(jnp.int64)


# ---------------------------------------------------------------- scans
def _scan_select(x, dim, later_wins):
    """Running (value, index) where a later element replaces the current one if `later_wins(new, current)`."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    index = lax.broadcasted_iota(jnp.int64, x.shape, dim)

    def combine(a, b):
        take = later_wins(b[0], a[0])
        return jnp.where(take, b[0], a[0]), jnp.where(take, b[1], a[1])

    return lax.associative_scan(combine, (x, index), axis=dim)


def _isnan(v):
    return jnp.isnan(v) if jnp.issubdtype(v.dtype, jnp.inexact) else jnp.zeros(v.shape, jnp.bool_)


@lowers(aten.cummax.default)
def cummax(x, dim):
    # PyTorch: ties take the later index; a NaN sticks (a later NaN takes over).
    return _scan_select(x, dim, lambda new, cur: (new >= cur) | _isnan(new))


@lowers(aten.cummin.default)
def cummin(x, dim):
    return _scan_select(x, dim, lambda new, cur: (new <= cur) | _isnan(new))


@lowers(aten._logcumsumexp.default, aten.logcumsumexp.default)  # the public op: whole in compiled graphs
def logcumsumexp(x, dim):
    rank = max(x.ndim, 1)
    if not -rank <= dim < rank:  # PyTorch's meta kernel does not check it
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    if x.ndim == 0:
        return x
    if jnp.iscomplexobj(x):
        # ATen's sequential log-add-exp, whose imaginary part is not wrapped: a tree scan would wrap differently
        moved = jnp.moveaxis(x, dim % x.ndim, 0)
        start = jnp.full(moved.shape[1:], complex(-jnp.inf, 0), x.dtype)
        _, out = lax.scan(lambda acc, v: (complex_logaddexp(v, acc),) * 2, start, moved)
        return jnp.moveaxis(out, 0, dim % x.ndim)
    a = _acc(x) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return lax.cumlogsumexp(a, axis=dim % x.ndim).astype(x.dtype)


# ---------------------------------------------------------------- order statistics
def _sorted_along(x, dim):
    """(sorted values, their original indices) along `dim`, NaN last, stable."""
    order = jnp.argsort(x, axis=dim, stable=True)
    return jnp.take_along_axis(x, order, axis=dim), order.astype(jnp.int64)


def _pick(values, order, position, dim, keepdim):
    position = jnp.expand_dims(position, dim)
    v = jnp.take_along_axis(values, position, axis=dim)
    i = jnp.take_along_axis(order, position, axis=dim)
    return (v, i) if keepdim else (jnp.squeeze(v, dim), jnp.squeeze(i, dim))


def _median(x, dim, keepdim, ignore_nan):
    """PyTorch's median: the lower of the two middle values, with its index."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    values, order = _sorted_along(x, dim)
    nan = _isnan(x)
    n = x.shape[dim]
    if ignore_nan:
        count = jnp.sum(~nan, axis=dim)
        position = jnp.maximum((count - 1) // 2, 0)
        return _pick(values, order, position, dim, keepdim)
    v, i = _pick(values, order, jnp.full(values.shape[:dim] + values.shape[dim + 1:], (n - 1) // 2), dim, keepdim)
    # NOTE(torch-vs-xla): a row holding NaN has median NaN at the index of its first NaN.
    has_nan = jnp.any(nan, axis=dim, keepdims=keepdim)
    first_nan = jnp.argmax(nan, axis=dim, keepdims=keepdim).astype(jnp.int64)
    return jnp.where(has_nan, jnp.asarray(jnp.nan, x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else v, v), \
        jnp.where(has_nan, first_nan, i)


@lowers(aten.median.dim)
def median_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, ignore_nan=False)


@lowers(aten.nanmedian.dim)
def nanmedian_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, ignore_nan=True)


def _median_of_nothing(dtype):
    # ATen's median/nanmedian of an empty tensor: NaN, or an integer type's lowest value.
    return jnp.asarray(jnp.nan if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min, dtype)


@lowers(aten.median.default)
def median_all(x):
    if x.size == 0:
        return _median_of_nothing(x.dtype)
    return _median(x.reshape(-1), 0, False, ignore_nan=False)[0]


@lowers(aten.nanmedian.default)
def nanmedian_all(x):
    if x.size == 0:
        return _median_of_nothing(x.dtype)
    return _median(x.reshape(-1), 0, False, ignore_nan=True)[0]


@lowers(aten.kthvalue.default)
def kthvalue(x, k, dim=-1, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    values, order = _sorted_along(x, dim)
    return _pick(values, order, jnp.full(values.shape[:dim] + values.shape[dim + 1:], k - 1), dim, keepdim)


@lowers(aten.mode.default)
def mode(x, dim=-1, keepdim=False):
    """The most frequent value (the smallest among equally frequent ones) and its last index."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    moved = jnp.moveaxis(x, dim, -1)
    values, order = _sorted_along(moved, -1)
    starts = jnp.concatenate([jnp.ones(values.shape[:-1] + (1,), jnp.bool_), values[..., 1:] != values[..., :-1]], -1)
    run_id = jnp.cumsum(starts, axis=-1) - 1
    position = lax.broadcasted_iota(jnp.int64, values.shape, values.ndim - 1)
    run_start = jnp.take_along_axis(
        lax.cummax(jnp.where(starts, position, 0), axis=values.ndim - 1), position, axis=-1)
    run_length = position - run_start + 1  # length of the run so far, at each element
    # The end of the longest run (first such run: smallest value); ties within a value pick its largest index.
    best_end = jnp.argmax(run_length, axis=-1)
    best_run = jnp.take_along_axis(run_id, best_end[..., None], axis=-1)
    in_run = run_id == best_run
    value = jnp.take_along_axis(values, best_end[..., None], axis=-1)[..., 0]
    index = jnp.max(jnp.where(in_run, order, -1), axis=-1)
    if keepdim:
        value, index = jnp.expand_dims(value, dim), jnp.expand_dims(index, dim)
    return value, index.astype(jnp.int64)


# ---------------------------------------------------------------- segment reductions
def _segment_ids(lengths, offsets, n):
    """(segment id of each position along the reduced axis, lengths): both batch + (...)."""
    if lengths is None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    ends = jnp.cumsum(lengths, axis=-1)
    position = jnp.arange(n)
    if ends.ndim == 1:
        ids = jnp.searchsorted(ends, position, side="right")
    else:
        rows = ends.reshape(-1, ends.shape[-1])
        ids = jax.vmap(lambda e: jnp.searchsorted(e, position, side="right"))(rows).reshape(ends.shape[:-1] + (n,))
    return ids, lengths


def _segment_index(ids, axis):
    """An index tuple addressing [batch..., ids] (batch dims are the ones before `axis`)."""
    batch = ids.shape[:-1]
    grids = [lax.broadcasted_iota(jnp.int64, ids.shape, d) for d in range(len(batch))]
    return tuple(grids) + (ids,)


def _segment_host_check(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    # unsafe=False asks ATen to read the lengths at the call, on every device (two .item() reads)
    if unsafe or lengths is None:
        return
    if lengths.numel() and int(lengths.min()) < 0:
        raise RuntimeError("lengths contains negative value!")
    if not bool((lengths.sum(-1) == data.size(axis)).all()):
        raise RuntimeError("segment_reduce(): Expected all rows of lengths along axis to sum to "
                           "data.size(lengths.dim()-1) when !unsafe.")


_REDUCE_ALIASES = {"amax": "max", "amin": "min"}  # ATen's get_reduction_enum takes both spellings


@lowers(aten.segment_reduce.default, static_scalars=True, host_check=_segment_host_check)
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    reduce = _REDUCE_ALIASES.get(reduce, reduce)
    axis = axis % data.ndim
    ids, lengths = _segment_ids(lengths, offsets, data.shape[axis])
    segments = lengths.shape[-1]
    shape = data.shape[:axis] + (segments,) + data.shape[axis + 1:]
    where = _segment_index(ids, axis)
    count = jnp.zeros(lengths.shape, data.dtype).at[where].add(1)
    count = count.reshape(count.shape + (1,) * (data.ndim - axis - 1))
    floating = jnp.issubdtype(data.dtype, jnp.floating)
    if reduce in ("sum", "mean"):
        start = jnp.zeros(shape, data.dtype) if initial is None else jnp.full(shape, initial, data.dtype)
        total = start.at[where].add(data)
        if reduce == "sum":
            return total
        mean = total / jnp.where(count == 0, 1, count)
        empty = jnp.nan if initial is None else initial
        return jnp.where(count == 0, jnp.asarray(empty, data.dtype), mean)
    if reduce == "prod":
        start = jnp.ones(shape, data.dtype) if initial is None else jnp.full(shape, initial, data.dtype)
        return start.at[where].multiply(data)
    lowest = -jnp.inf if floating else jnp.iinfo(data.dtype).min
    highest = jnp.inf if floating else jnp.iinfo(data.dtype).max
    if reduce == "max":
        return jnp.full(shape, lowest if initial is None else initial, data.dtype).at[where].max(data)
    if reduce == "min":
        return jnp.full(shape, highest if initial is None else initial, data.dtype).at[where].min(data)
    raise NotImplementedError(f"segment_reduce: reduce={reduce!r}")


@lowers(aten._segment_reduce_backward.default, static_scalars=True)
def segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None):
    reduce = _REDUCE_ALIASES.get(reduce, reduce)
    axis = axis % data.ndim
    ids, lengths = _segment_ids(lengths, offsets, data.shape[axis])
    where = _segment_index(ids, axis)
    g = grad[where]
    out = output[where]
    if reduce == "sum":
        return g
    trailing = (1,) * (data.ndim - axis - 1)
    if reduce == "mean":
        count = jnp.maximum(lengths, 1).astype(data.dtype)
        return g / count[where].reshape(ids.shape + trailing)
    if reduce in ("max", "min"):
        # ATen's rule: NaNs and the elements equal to the result take the gradient; where two or more
        # do, the positive gradients (only those) are split among them
        hit = (data == out) | jnp.isnan(data)
        ties = jnp.zeros(output.shape, jnp.int64).at[where].add(hit.astype(jnp.int64))[where]
        split = (ties >= 2) & (g > 0)
        return jnp.where(hit, jnp.where(split, g / jnp.where(split, ties, 1).astype(data.dtype), g), 0)
    if reduce == "prod":
        # NaNs and zeros take the product of the segment's other elements (ATen computes it for them
        # explicitly): the non-special ones' product when they are alone, else 0 or NaN from the others
        special = (data == 0) | jnp.isnan(data)
        count = lambda mask: jnp.zeros(output.shape, jnp.int64).at[where].add(mask.astype(jnp.int64))[where]
        specials, nans = count(special), count(jnp.isnan(data))
        start = jnp.ones(output.shape, data.dtype) if initial is None else jnp.full(output.shape, initial, data.dtype)
        others = start.at[where].multiply(jnp.where(special, 1, data))[where]  # product of the non-special ones
        other_nan = (nans - jnp.isnan(data).astype(jnp.int64)) > 0
        exclusive = jnp.where(specials == 1, others, jnp.where(other_nan, jnp.nan, others * 0))
        return jnp.where(special, g * exclusive, g * out / jnp.where(special, 1, data))
    raise NotImplementedError(f"segment_reduce backward: reduce={reduce!r}")
