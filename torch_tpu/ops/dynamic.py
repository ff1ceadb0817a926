"""Ops whose result shapes depend on tensor values: nonzero, masked_select, unique, boolean-mask indexing...

An XLA program has static shapes, so each of these runs in two steps, both
ordinary cached tpu programs:
  1. a counting program computes the result size on the device; reading it is
     one synchronisation (a materialization, like `.item()`);
  2. a static-size program computes the result for that size: an ATen op that
     takes the size (`nonzero_static`) or one of our own `torch_tpu::*_static`
     ops, lowered here like any other op (so one program per size, cached).
PyTorch's CUDA backend synchronises at the same places.

Kernels here are torch-level (they call tpu ops through the dispatcher) and
registered with `registry.kernel`; argument rewrites that make an op static
(boolean masks -> index tensors) with `registry.prepare`. Does not own: ops
whose result shape is known without reading values (masked_scatter, histc,
searchsorted): those are plain lowerings in their families.
"""
from __future__ import annotations

import warnings

import jax.numpy as jnp
import torch

from torch_tpu.ops import checks
from torch_tpu.ops.checks import checked
from torch_tpu.ops.registry import aten, kernel, lowers, prepare
from torch_tpu.runtime.dtypes import not_implemented

_lib = torch.library.Library("torch_tpu", "FRAGMENT")  # other modules may add ops to the namespace too
_lib.define("count_unique(Tensor self, int? dim, bool consecutive) -> Tensor")
_lib.define("unique_static(Tensor self, int size, int? dim, bool consecutive, bool return_inverse, "
            "bool return_counts) -> (Tensor, Tensor, Tensor)")
_lib.define("masked_select_static(Tensor self, Tensor mask, int size) -> Tensor")
_lib.define("bincount_static(Tensor self, Tensor? weights, int size) -> Tensor")
ops = torch.ops.torch_tpu


def _size(t: torch.Tensor) -> int:
    """Read a size computed on the device (the one synchronisation of a dynamic op)."""
    return int(t.item())


# ---------------------------------------------------------------- meta (shapes for torch.compile and our own meta runs)
@torch.library.register_fake("torch_tpu::count_unique", lib=_lib)
def _count_unique_fake(x, dim, consecutive):
    return x.new_empty((), dtype=torch.int64)


@torch.library.register_fake("torch_tpu::unique_static", lib=_lib)
def _unique_static_fake(x, size, dim, consecutive, return_inverse, return_counts):
    if dim is None:
        values = x.new_empty((size,))
        inverse_shape = x.shape
    else:
        shape = list(x.shape)
        shape[dim] = size
        values = x.new_empty(shape)
        inverse_shape = (x.shape[dim],)
    inverse = x.new_empty(inverse_shape if return_inverse else (0,), dtype=torch.int64)
    counts = x.new_empty((size,) if return_counts else (0,), dtype=torch.int64)
    return values, inverse, counts


@torch.library.register_fake("torch_tpu::masked_select_static", lib=_lib)
def _masked_select_static_fake(x, mask, size):
    return x.new_empty((size,))


@torch.library.register_fake("torch_tpu::bincount_static", lib=_lib)
def _bincount_static_fake(x, weights, size):
    # PyTorch: float32 weights give float32 counts, any other weights float64.
    dtype = torch.int64 if weights is None else torch.float32 if weights.dtype == torch.float32 else torch.float64
    return x.new_empty((size,), dtype=dtype)


# ---------------------------------------------------------------- nonzero, masked_select
@lowers(aten.nonzero_static.default)
def nonzero_static(x, size, fill_value=-1):
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    if x.size == 0:  # (jnp.nonzero fills with 0 here)
        return jnp.full((size, x.ndim), fill_value, jnp.int64)
    found = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(found, axis=1).astype(jnp.int64)


def _count_nonzero(x: torch.Tensor) -> int:
    return _size(torch.count_nonzero(x))


@kernel(aten.nonzero.default)
def nonzero(x):
    return aten.nonzero_static.default(x, size=_count_nonzero(x), fill_value=-1)


@lowers(ops.masked_select_static.default)
def masked_select_static(x, mask, size):
    (position,) = jnp.nonzero(mask.reshape(-1), size=size, fill_value=0)
    return x.reshape(-1)[position]


@kernel(aten.masked_select.default)
def masked_select(x, mask):
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    x, mask = torch.broadcast_tensors(x, mask)
    return ops.masked_select_static(x, mask, _count_nonzero(mask))


# ---------------------------------------------------------------- boolean-mask and CPU-index indexing
_MASK_DTYPES = (torch.bool, torch.uint8)  # index tensors PyTorch reads as masks (uint8: deprecated, still accepted)


def _mask_position(indices):
    """(position, mask) if the indices are one boolean mask after full slices, else None."""
    found = None
    for position, index in enumerate(indices):
        if index is None:
            continue
        if found is not None or index.dtype not in _MASK_DTYPES:
            return None
        found = (position, index)
    return found


def _long_indices(x: torch.Tensor, indices) -> list:
    """Index tensors on x's device, every boolean mask replaced by its nonzero coordinates (PyTorch's own rule)."""
    _check_mask_shapes(x, indices)
    out = []
    for index in indices:
        if index is None:
            out.append(None)
            continue
        if index.device != x.device:  # PyTorch accepts CPU index tensors for device tensors
            index = index.to(x.device)
        if index.dtype in _MASK_DTYPES:
            out.extend(nonzero(index.bool()).unbind(1))
        else:
            out.append(index)
    return out


def _check_mask_shapes(x: torch.Tensor, indices) -> None:
    """PyTorch's IndexError for a boolean mask whose shape differs from the dimensions it indexes (and its
    deprecation warning for a uint8 mask)."""
    dim = 0  # the dimension of x the next index applies to
    for index in indices:
        if index is not None and index.dtype == torch.uint8:
            warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.")
        if index is not None and index.dtype in _MASK_DTYPES:
            for j, size in enumerate(index.shape):
                if dim + j < x.dim() and size != x.shape[dim + j]:
                    raise IndexError(f"The shape of the mask {list(index.shape)} at index {j} does not match the "
                                     f"shape of the indexed tensor {list(x.shape)} at index {dim + j}")
        dim += 1 if index is None or index.dtype not in _MASK_DTYPES else index.dim()


# The index preparations change boolean/uint8 masks and index tensors on another device (dtypes and
# devices no prepared call has: a mask kept for `x[mask] = scalar` is bool and alone), so cache hits
# keep the boxed kernel (only_on_miss).
@prepare(aten.index.Tensor, aten._unsafe_index.Tensor, only_on_miss=True)
def _index_arguments(x, indices):
    return (x, _long_indices(x, indices)), {}


def _has_mask(indices) -> bool:
    return any(i is not None and i.dtype in _MASK_DTYPES for i in indices)


# Whether a call's shapes depend on values (a torch.compile graph holding one runs in eager,
# compile/plan.py): only a mask among the indices does, not a boolean tensor being indexed
# (Transformers' attention masks index a boolean padding mask with integer index tensors).
_index_arguments.value_dependent = lambda x, indices: _has_mask(indices)


@prepare(aten._unsafe_index_put.default, only_on_miss=True)
def _unsafe_index_put_arguments(x, indices, values, accumulate=False):
    return (x, _index_put_indices(x, indices, values), values, accumulate), {}


@prepare(aten.index_put.default, aten.index_put_.default, only_on_miss=True)
def _index_put_arguments(x, indices, values, accumulate=False):
    prepared = _unsafe_index_put_arguments(x, indices, values, accumulate)
    _check_values_dtype(x, indices, prepared[0][1], values, accumulate)
    return prepared


@prepare(aten._index_put_impl_.default, aten._index_put_impl.default, only_on_miss=True)
def _index_put_impl_arguments(x, indices, values, accumulate=False, unsafe=False):
    prepared = _index_put_indices(x, indices, values)
    _check_values_dtype(x, indices, prepared, values, accumulate)
    return (x, prepared, values, accumulate, unsafe), {}


def _check_values_dtype(x, indices, prepared, values, accumulate) -> None:
    """PyTorch's index_put refuses a source of another dtype (the lowering would cast it): its own
    error, from its CPU kernel on empty tensors of the two dtypes, after its check that the values
    broadcast to the indexing result (CPU's order). Except where PyTorch writes with masked_fill_
    (canDispatchToMaskedFill: no accumulate, one mask on x's device, one CPU value), which casts:
    `scores[mask] = torch.tensor(float("-inf"))` on half scores works on CUDA. `prepared`: the indices
    as the lowering takes them (masks as positions)."""
    if values.dtype == x.dtype:
        return
    given = [i for i in indices if i is not None]
    if (not accumulate and values.numel() == 1 and values.device.type == "cpu" and len(given) == 1
            and given[0].dtype in _MASK_DTYPES and given[0].device == x.device):
        return
    if values.numel() != 1:  # (one value is written by a select, its mask kept: no result shape without a sync)
        metas = [None if i is None else torch.empty(i.shape, dtype=i.dtype, device="meta") for i in prepared]
        result = aten.index.Tensor(torch.empty(x.shape, dtype=x.dtype, device="meta"), metas).shape
        try:
            fits = torch.broadcast_shapes(values.shape, result) == result
        except RuntimeError:
            fits = False
        if not fits:
            raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                               f"indexing result of shape {list(result)}")
    torch.empty(0, dtype=x.dtype).index_put_((torch.empty(0, dtype=torch.long),), torch.empty(0, dtype=values.dtype))


def _index_put_value_dependent(x, indices, values, *rest):
    # A uint8 mask reaches the lowering as bool only through the preparation: counted as dependent.
    bool_select = _writes_by_select(x, indices, values) and not any(
        i is not None and i.dtype == torch.uint8 for i in indices)
    return _has_mask(indices) and not bool_select


_index_put_arguments.value_dependent = _index_put_value_dependent
_unsafe_index_put_arguments.value_dependent = _index_put_value_dependent
_index_put_impl_arguments.value_dependent = _index_put_value_dependent


def _writes_by_select(x, indices, values) -> bool:
    """`x[mask] = scalar` needs no size: the lowering writes it with a select (no synchronisation)."""
    masked = _mask_position(indices)
    return masked is not None and values.numel() == 1 and masked[1].device == x.device


def _index_put_indices(x, indices, values):
    if _writes_by_select(x, indices, values):
        _check_mask_shapes(x, indices)
        return [None if i is None else i.bool() if i.dtype == torch.uint8 else i for i in indices]
    return _long_indices(x, indices)


# ---------------------------------------------------------------- unique
def _rows(x, dim):
    """x as (n, m) rows: the slices along `dim` (or the flattened elements as 1-element rows)."""
    if dim is None:
        return x.reshape(-1, 1)
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(moved.shape[0], -1)


def _group_starts(rows):
    """True where a row differs from the one before (NaN differs from everything, like PyTorch)."""
    if rows.shape[0] == 0:
        return jnp.zeros((0,), jnp.bool_)
    changed = jnp.any(rows[1:] != rows[:-1], axis=1)
    return jnp.concatenate([jnp.ones((1,), jnp.bool_), changed])


def _row_order(rows):
    """A stable lexicographic sort of the rows (NaN last in each column)."""
    if rows.shape[1] == 1:
        return jnp.argsort(rows[:, 0], stable=True)
    return jnp.lexsort(tuple(rows[:, j] for j in reversed(range(rows.shape[1]))))


@lowers(ops.count_unique.default)
def count_unique(x, dim=None, consecutive=False):
    rows = _rows(x, dim)
    if not consecutive:
        rows = rows[_row_order(rows)]
    return jnp.sum(_group_starts(rows)).astype(jnp.int64)


@lowers(ops.unique_static.default)
def unique_static(x, size, dim=None, consecutive=False, return_inverse=False, return_counts=False):
    rows = _rows(x, dim)
    n = rows.shape[0]
    order = jnp.arange(n) if consecutive else _row_order(rows)
    ordered = rows[order]
    group = jnp.cumsum(_group_starts(ordered)) - 1  # group id of each ordered row
    values = jnp.zeros((size,) + rows.shape[1:], rows.dtype).at[group].set(ordered, mode="drop")
    if dim is None:
        values = values.reshape(size)
    else:
        moved_shape = (size,) + tuple(s for d, s in enumerate(x.shape) if d != dim)
        values = jnp.moveaxis(values.reshape(moved_shape), 0, dim)
    inverse = jnp.zeros((n,), jnp.int64).at[order].set(group) if return_inverse else jnp.zeros((0,), jnp.int64)
    if return_inverse and dim is None:
        inverse = inverse.reshape(x.shape)
    counts = (jnp.zeros((size,), jnp.int64).at[group].add(1, mode="drop") if return_counts
              else jnp.zeros((0,), jnp.int64))
    return values, inverse, counts


def _refuse_complex(x, kernel_name):
    """ATen's unique kernels have no complex case (complex numbers have no order)."""
    if x.dtype.is_complex:
        raise not_implemented(kernel_name, x.dtype)


def _unique(x, dim, consecutive, return_inverse, return_counts):
    size = _size(ops.count_unique(x, dim, consecutive))
    return ops.unique_static(x, size, dim, consecutive, return_inverse, return_counts)


@kernel(aten._unique2.default)
def unique2(x, sorted=True, return_inverse=False, return_counts=False):
    # NOTE(torch-vs-xla): the values come out sorted even for sorted=False (PyTorch's CPU kernel does the same).
    _refuse_complex(x, "unique")
    return _unique(x, None, False, return_inverse, return_counts)


@kernel(aten._unique.default)
def unique_legacy(x, sorted=True, return_inverse=False):
    _refuse_complex(x, "unique")
    values, inverse, _ = _unique(x, None, False, return_inverse, False)
    return values, inverse


def _unique_along(x, dim, consecutive, return_inverse, return_counts):
    dim = dim % max(x.dim(), 1)
    if x.numel() == 0:  # ATen's checks and results for empty slices
        if x.shape[dim] != 0:
            raise RuntimeError("There are 0 sized dimensions, and they aren't selected, so unique cannot be applied")
        if list(x.shape).count(0) > 1:
            raise RuntimeError("Number of zero sized dimensions is more than one, so unique cannot be applied ")
        nothing = torch.empty(0, dtype=torch.long, device=x.device)
        return torch.empty_like(x), nothing, nothing.clone()
    return _unique(x, dim, consecutive, return_inverse, return_counts)


@kernel(aten.unique_dim.default)
def unique_dim(x, dim, sorted=True, return_inverse=False, return_counts=False):
    _refuse_complex(x, "unique_dim")
    return _unique_along(x, dim, False, return_inverse, return_counts)


@kernel(aten.unique_consecutive.default)
def unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    _refuse_complex(x, "unique")
    if dim is None:
        return _unique(x, None, True, return_inverse, return_counts)
    return _unique_along(x, dim, True, return_inverse, return_counts)


@kernel(aten.unique_dim_consecutive.default)
def unique_dim_consecutive(x, dim, return_inverse=False, return_counts=False):
    _refuse_complex(x, "unique")
    return _unique_along(x, dim, True, return_inverse, return_counts)


# ---------------------------------------------------------------- counts and repeats
@lowers(ops.bincount_static.default)
def bincount_static(x, weights, size):
    if weights is None:
        return jnp.zeros((size,), jnp.int64).at[x].add(1, mode="drop")
    dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return jnp.zeros((size,), dtype).at[x].add(weights.astype(dtype), mode="drop")


@kernel(aten.bincount.default)
def bincount(x, weights=None, minlength=0):
    # ATen's order: the dtype dispatch (integral types only), then minlength, then the values.
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise not_implemented("bincount_tpu", x.dtype)
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if x.dim() != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != x.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    largest = _size(x.max()) if x.numel() else -1
    if largest < -1 or (x.numel() and _size(x.min()) < 0):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    return ops.bincount_static(x, weights, max(largest + 1, minlength))


@prepare(aten.repeat_interleave.Tensor, only_on_miss=True)
def _repeat_interleave_arguments(repeats, output_size=None):
    # Only a None output_size changes (to a number): a call that gives one hits natively.
    if repeats.dtype not in (torch.int32, torch.int64):  # ATen's checks, in its order
        raise not_implemented("repeat_interleave_tpu", repeats.dtype)
    if repeats.dim() != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if output_size is None:
        output_size = 0
        if repeats.numel():  # one read for the size and ATen's check (the program checks it too)
            output_size, least = (int(v) for v in torch.stack((repeats.sum(), repeats.min())).tolist())
            if least < 0:
                raise RuntimeError("repeats can not be negative")
    return (repeats,), {"output_size": output_size}


@lowers(aten.repeat_interleave.Tensor)
@checked
def repeat_interleave(repeats, output_size=None):
    checks.require(repeats >= 0, checks.NEGATIVE_REPEATS)
    # Output element j is the index i whose cumulative repeat range holds j.
    ends = jnp.cumsum(repeats)
    return jnp.searchsorted(ends, jnp.arange(output_size), side="right").astype(jnp.int64)


# ---------------------------------------------------------------- comparisons that return Python values
@kernel(aten.equal.default)
def equal(a, b):
    if a.shape != b.shape:
        return False
    return bool(torch.eq(a, b).all().item())

