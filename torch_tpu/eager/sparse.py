"""Sparse COO tensors on "tpu": a storage format over dense tpu tensors.

A sparse tpu tensor is PyTorch's own `SparseTensorImpl` (dispatch key SparsePrivateUse1)
whose `indices` (int64, sparse_dim x nnz) and `values` (nnz x dense sizes) are ordinary
dense tpu tensors. Two kinds of kernels (registered by `kernels.register_all`):

- Metadata kernels (making the impl, reading its indices/values/nnz, resizing, copying
  between sparse tensors) are PyTorch's own SparseCPU kernels, redispatched: they are
  device-generic C++ that only move the indices/values tensors around, and every value
  operation inside them dispatches back to tpu.
- Kernels that compute (coalesce, dense <-> sparse, sparse + dense, sparse @ dense,
  sparse_mask) are written here with dense tpu ops (nonzero, unique, index_add, index_put),
  so they run through the executors like any other op (Strict and DeferAndFuse).

Any other op on a sparse tpu tensor has no SparsePrivateUse1 kernel: PyTorch raises its own
"Could not run 'aten::...' with arguments from the 'Sparsetpu' backend" error; nothing runs
on the CPU silently. docs/sparse.md lists what is supported.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_SPARSE_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCPU)

# PyTorch's SparseCPU kernels for these are device-generic (no raw data access).
_GENERIC = (
    aten._sparse_coo_tensor_with_dims_and_tensors.default,
    aten._sparse_coo_tensor_with_dims.default,
    aten._indices.default,
    aten._values.default,
    aten.indices.default,
    aten.values.default,
    aten._nnz.default,
    aten.is_coalesced.default,
    aten._coalesced_.default,
    aten.sparse_dim.default,
    aten.dense_dim.default,
    aten.sparse_resize_.default,
    aten.sparse_resize_and_clear_.default,
    aten.copy_.default,
    aten.clone.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.zero_.default,
)


def _redispatch(op):
    def kernel(*args, **kwargs):
        return op.redispatch(_SPARSE_CPU, *args, **kwargs)

    return kernel


def _make(indices, values, size, coalesced: bool):
    """A sparse COO tpu tensor over `indices` and `values` (no copy, no checks)."""
    sparse_dim = indices.shape[0]
    return aten._sparse_coo_tensor_with_dims_and_tensors.default(
        sparse_dim, len(size) - sparse_dim, list(size), indices, values,
        dtype=values.dtype, layout=torch.sparse_coo, device=values.device, pin_memory=None,
        is_coalesced=coalesced)


def _strides(size) -> list:
    out, step = [], 1
    for n in reversed(size):
        out.append(step)
        step *= n
    return out[::-1]


def _linear(indices, size):
    """Row-major linear position of each column of `indices` in the sparse dims `size`."""
    out = torch.zeros(indices.shape[1], dtype=torch.int64, device=indices.device)
    for k, stride in enumerate(_strides(size)):
        out = out + indices[k] * stride
    return out


# ------------------------------------------------------------------ computing kernels
def _coalesce(s):
    sparse_dim = s.sparse_dim()
    indices, values = s._indices(), s._values()
    if s._nnz() < 2:
        return _make(indices.clone(), values.clone(), s.shape, True)
    sizes = list(s.shape[:sparse_dim])
    unique, inverse = torch.unique(_linear(indices, sizes), sorted=True, return_inverse=True)
    summed = torch.zeros((unique.shape[0],) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    summed.index_add_(0, inverse, values)
    rows = [torch.remainder(torch.div(unique, stride, rounding_mode="floor"), n)
            for stride, n in zip(_strides(sizes), sizes)]
    new_indices = (torch.stack(rows) if rows else
                   torch.zeros((0, unique.shape[0]), dtype=torch.int64, device=values.device))
    return _make(new_indices, summed, s.shape, True)


def _dense_to_sparse(x, sparse_dim: int):
    if x.dim() > 0 and not 0 < sparse_dim <= x.dim():
        raise RuntimeError("dense_to_sparse: sparse_dim argument must be in >0 when self.dim()>0" if sparse_dim <= 0
                           else f"sparse_dim argument must be in [0,{x.dim()}] range, but {sparse_dim} is given")
    if x.dim() == 0:
        return _make(torch.zeros((0, 1), dtype=torch.int64, device=x.device), x.unsqueeze(0).clone(), (), True)
    nonzero = x != 0
    if sparse_dim < x.dim():
        nonzero = nonzero.flatten(sparse_dim).any(-1)
    indices = nonzero.nonzero().t().contiguous()  # row-major order: sorted, so coalesced
    values = x[tuple(indices)] if indices.shape[1] else x.new_zeros((0,) + tuple(x.shape[sparse_dim:]))
    return _make(indices, values, x.shape, True)


def _to_sparse_dense(x, *, layout=None, blocksize=None, dense_dim=None):
    if layout not in (None, torch.sparse_coo):
        raise NotImplementedError(
            f"to_sparse: conversion from Strided to {str(layout).replace('torch.', '').title().replace('_', '')} "
            "is not supported on the 'tpu' device (it stores sparse COO only)")
    if blocksize is not None:
        raise RuntimeError("to_sparse for Strided to SparseCoo conversion does not use specified blocksize")
    return _dense_to_sparse(x, x.dim() - (dense_dim or 0))


def _to_sparse_sparse(s, *, layout=None, blocksize=None, dense_dim=None):
    if layout not in (None, torch.sparse_coo) or blocksize is not None:
        raise NotImplementedError(f"to_sparse: conversion from SparseCoo to {layout} is not supported on the 'tpu' device")
    if dense_dim is not None and dense_dim != s.dense_dim():
        raise RuntimeError(f"to_sparse: conversion from Sparse to Sparse with dense_dim argument !={s.dense_dim()} "
                           "is not supported")
    return s


def _to_sparse_dim_sparse(s, sparse_dim):
    if sparse_dim != s.sparse_dim():
        raise RuntimeError(f"to_sparse: conversion from Sparse to Sparse with sparse_dim argument !={s.sparse_dim()} "
                           "is not supported")
    return s


def _to_dense(s, dtype=None, masked_grad=None):
    dtype = dtype or s.dtype
    out = torch.zeros(s.shape, dtype=dtype, device=s.device)
    if s._nnz() == 0:
        return out
    indices, values = s._indices(), s._values().to(dtype)
    if s.sparse_dim() == 0:
        return out + values.sum(0)
    return out.index_put_(tuple(indices), values, accumulate=True)


def _check_same_size(op: str, a, b):
    if a.shape != b.shape:
        raise RuntimeError(f"{op}: expected 'self' and 'other' to have same size, but self has size {list(a.shape)} "
                           f"while other has size {list(b.shape)} (FYI: dense-sparse addition does not currently "
                           "support broadcasting)")


def _scaled(values, alpha, dtype):
    values = values.to(dtype)
    return values if alpha == 1 else values * alpha


def _add_into_dense(dense, s, alpha):
    """dense += alpha * s, in place (dense has the result dtype)."""
    if s._nnz() == 0:
        return dense
    values = _scaled(s._values(), alpha, dense.dtype)
    if s.sparse_dim() == 0:
        return dense.add_(values.sum(0))
    return dense.index_put_(tuple(s._indices()), values, accumulate=True)


def _add(a, b, alpha=1):
    dtype = torch.result_type(a, b)
    if a.is_sparse and b.is_sparse:
        _check_same_size("add", a, b)
        if a.sparse_dim() != b.sparse_dim() or a.dense_dim() != b.dense_dim():
            raise RuntimeError("add: expected 'self' and 'other' to have the same sparse and dense dimensions")
        indices = torch.cat([a._indices(), b._indices()], 1)
        values = torch.cat([a._values().to(dtype), _scaled(b._values(), alpha, dtype)], 0)
        return _make(indices, values, a.shape, False)
    if b.is_sparse:  # dense + alpha * sparse
        _check_same_size("add", a, b)
        return _add_into_dense(a.to(dtype, copy=True), b, alpha)
    # sparse + alpha * dense
    _check_same_size("add", a, b)
    return _add_into_dense(b.to(dtype) * alpha if alpha != 1 else b.to(dtype, copy=True), a, 1)


def _add_(a, b, alpha=1):
    if not a.is_sparse:
        _check_same_size("add_", a, b)
        if b.is_sparse:
            return _add_into_dense(a, b, alpha)
        raise RuntimeError("add_: in-place addition of a sparse tensor to a dense one needs a sparse 'other'")
    if not b.is_sparse:
        raise RuntimeError("add(sparse, dense) is not supported. Use add(dense, sparse) instead.")
    return a.copy_(_add(a, b, alpha))


def _add_out(a, b, *, alpha=1, out):
    result = _add(a, b, alpha)
    if out.is_sparse != result.is_sparse:
        raise RuntimeError("add: the layout of 'out' does not match the result's")
    if out.is_sparse:
        return out.copy_(result)
    return out.resize_(result.shape).copy_(result)


def _check_mm(a, b, name="mm"):
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"{name}: both arguments must be 2D matrices, got {a.dim()}D and {b.dim()}D")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
                           f"{b.shape[0]}x{b.shape[1]})")
    for t in (a, b):
        if t.is_sparse and t.dense_dim() != 0:
            raise RuntimeError(f"{name}: expected a sparse matrix with 2 sparse dimensions and 0 dense dimensions, "
                               f"got {t.sparse_dim()} sparse and {t.dense_dim()} dense")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected mat1 and mat2 to have the same dtype, but got: {a.dtype} != {b.dtype}")


def _mm(a, b):
    _check_mm(a, b)
    if a.is_sparse and b.is_sparse:
        raise NotImplementedError("mm: sparse @ sparse is not supported on the 'tpu' device (sparse @ dense and "
                                  "dense @ sparse are)")
    if b.is_sparse:  # dense @ sparse = (sparse^T @ dense^T)^T
        return _mm(b.t(), a.t()).t().contiguous()
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=a.dtype, device=b.device)
    if a._nnz() == 0:
        return out
    rows, cols = a._indices()
    return out.index_add_(0, rows, a._values().unsqueeze(1) * b.index_select(0, cols))


def _addmm(self, mat1, mat2, *, beta=1, alpha=1):
    _check_mm(mat1, mat2, "addmm")
    product = _mm(mat1, mat2)
    if self.is_sparse:
        self = self.to_dense()
    self = self.expand(product.shape)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (self if beta == 1 else self * beta)


def _sparse_mask(self, mask):
    if self.shape != mask.shape:
        raise RuntimeError("sparse_mask(): operands have incompatible sizes; self has size "
                           f"{list(self.shape)} but mask has size {list(mask.shape)}")
    if self.is_sparse:
        self = self.to_dense()
    mask = mask if mask.is_coalesced() else mask.coalesce()
    indices = mask._indices()
    if mask._nnz() == 0:
        values = self.new_zeros((0,) + tuple(self.shape[mask.sparse_dim():]))
    else:
        values = self[tuple(indices)]
    return _make(indices.clone(), values, self.shape, True)


def _sum(s, *, dtype=None):
    values = s._values()
    return values.sum(dtype=dtype) if s._nnz() else torch.zeros((), dtype=dtype or values.dtype, device=values.device)


def sparse_kernels() -> dict:
    """aten op -> kernel for the SparsePrivateUse1 key."""
    out = {op: _redispatch(op) for op in _GENERIC}
    out.update({
        aten._coalesce.default: _coalesce,
        aten._to_dense.default: _to_dense,
        aten._to_sparse.default: _to_sparse_sparse,
        aten._to_sparse.sparse_dim: _to_sparse_dim_sparse,
        aten.add.Tensor: _add,
        aten.add_.Tensor: _add_,
        aten.add.out: _add_out,
        aten.mm.default: _mm,
        aten.addmm.default: _addmm,
        aten.sparse_mask.default: _sparse_mask,
        aten.sum.default: _sum,
    })
    return out


def dense_kernels() -> dict:
    """aten op -> kernel for the (dense) PrivateUse1 key: dense -> sparse conversion."""
    return {
        aten._to_sparse.default: _to_sparse_dense,
        aten._to_sparse.sparse_dim: _dense_to_sparse,
    }
