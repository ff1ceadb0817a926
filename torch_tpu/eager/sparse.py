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

from torch_tpu.eager import cpu_errors
from torch_tpu.runtime.dtypes import scalar_type_name

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
    aten.copy_sparse_to_sparse_.default,
    aten.clone.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.zero_.default,
    aten.conj_physical.out,  # conj() of a complex sparse tensor: the values' conj_physical, dispatched to tpu
)


def _redispatch(op, keys=_SPARSE_CPU):
    """`op`'s kernel for the CPU sparse key `keys`, called on tpu sparse tensors (device-generic kernels only)."""
    def kernel(*args, **kwargs):
        return op.redispatch(keys, *args, **kwargs)

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


def _broadcast_to(s, size):
    """ATen's sparse broadcast: new leading dims and broadcast size-1 sparse dims become sparse dims whose
    entries repeat each original entry over them (entry-major, row-major over the broadcast dims); dense
    dims broadcast in the values. (PyTorch's SparseCPU kernel reaches a CPU-only stub for some shapes.)"""
    size = [int(n) for n in size]
    extra = len(size) - s.dim()
    if extra < 0:
        raise RuntimeError("the requested broadcast shape has fewer dimensions than the input")
    for i, n in enumerate(s.shape):
        if n != 1 and n != size[i + extra]:
            raise RuntimeError(f"The input's length {n} at dimension {i} does not broadcast over the requested "
                               f"shape of length {size[i + extra]} at dimension {i + extra}")
    sparse_dim = extra + s.sparse_dim()
    broadcast = [d for d in range(sparse_dim) if d < extra or (s.shape[d - extra] == 1 and size[d] != 1)]
    indices, values = s._indices(), s._values()
    nnz, device = indices.shape[1], indices.device
    repeats = 1
    for d in broadcast:
        repeats *= size[d]
    rows, after = [], repeats
    for d in range(sparse_dim):
        if d in broadcast:  # this dim's coordinate in each of an entry's `repeats` copies
            after //= size[d]
            pattern = torch.arange(size[d], device=device).repeat_interleave(after).repeat(repeats // (after * size[d]))
            rows.append(pattern.repeat(nnz))
        else:
            rows.append(indices[d - extra].repeat_interleave(repeats))
    new_indices = torch.stack(rows) if rows else torch.zeros((0, nnz * repeats), dtype=torch.int64, device=device)
    new_values = values.expand(nnz, *size[sparse_dim:]).repeat_interleave(repeats, dim=0)
    return _make(new_indices, new_values, size, s.is_coalesced() and not broadcast)


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
    if layout == torch.sparse_csr and blocksize is None:
        return _dense_to_csr(x, dense_dim)
    if layout not in (None, torch.sparse_coo):
        raise NotImplementedError(
            f"to_sparse: conversion from Strided to {str(layout).replace('torch.', '').title().replace('_', '')} "
            "is not supported on the 'tpu' device (it stores sparse COO only)")
    if blocksize is not None:
        raise RuntimeError("to_sparse for Strided to SparseCoo conversion does not use specified blocksize")
    return _dense_to_sparse(x, x.dim() - (dense_dim or 0))


def _coo_to_csr(s, dense_dim=None):
    if s.dim() != 2 or s.dense_dim() or dense_dim:
        raise NotImplementedError("to_sparse_csr: only 2-D tensors with no dense dims are supported on the 'tpu' "
                                  f"device (got {s.dim()} dims, {s.dense_dim()} dense)")
    s = s if s.is_coalesced() else _coalesce(s)  # CSR needs row-major sorted, unique entries
    return _coordinates_to_csr(*s._indices(), s._values(), s.shape)


def _coordinates_to_csr(rows, cols, values, shape):
    """A 2-D CSR tpu tensor from row-major sorted (row, column, value) entries."""
    counts = torch.zeros(shape[0], dtype=torch.int64, device=values.device).index_add_(0, rows, torch.ones_like(rows))
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.sparse_csr_tensor(crow, cols.contiguous(), values, shape, device=values.device)


def _to_sparse_sparse(s, *, layout=None, blocksize=None, dense_dim=None):
    if layout == torch.sparse_csr and blocksize is None:
        return _coo_to_csr(s, dense_dim)
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
    if not (isinstance(b, torch.Tensor) and b.is_sparse) and a.is_sparse:  # sparse + dense or a number
        raise RuntimeError("add(sparse, dense) is not supported. Use add(dense, sparse) instead.")
    dtype = torch.result_type(a, b)
    if a.is_sparse and b.is_sparse:
        _check_same_size("add", a, b)
        if a.sparse_dim() != b.sparse_dim() or a.dense_dim() != b.dense_dim():
            raise RuntimeError("add: expected 'self' and 'other' to have the same sparse and dense dimensions")
        indices = torch.cat([a._indices(), b._indices()], 1)
        values = torch.cat([a._values().to(dtype), _scaled(b._values(), alpha, dtype)], 0)
        return _make(indices, values, a.shape, False)
    # dense + alpha * sparse
    _check_same_size("add", a, b)
    return _add_into_dense(a.to(dtype, copy=True), b, alpha)


def _add_(a, b, alpha=1):
    b_sparse = isinstance(b, torch.Tensor) and b.is_sparse  # b may be a Python number (add_.Scalar)
    if not a.is_sparse:
        _check_same_size("add_", a, b)
        if b_sparse:
            _check_in_place_cast(a, b, _ADD_CAST_WORDS)
            return _add_into_dense(a, b, alpha)
        raise RuntimeError("add_: in-place addition of a sparse tensor to a dense one needs a sparse 'other'")
    if not b_sparse:
        raise RuntimeError("add(sparse, dense) is not supported. Use add(dense, sparse) instead.")
    _check_in_place_cast(a, b, _ADD_CAST_WORDS)
    return a.copy_(_add(a, b, alpha))


# ATen's sparse kernels' words for an in-place result that self's dtype cannot hold (int += float).
_CAST_WORDS = "Can't convert result type {result} to output {out}"
_ADD_CAST_WORDS = _CAST_WORDS + " in add operation"
_SCALAR_CAST_WORDS = "dtype of values ({result}) must match dtype of sparse tensor ({out})"


def _check_in_place_cast(a, b, words):
    dtype = torch.result_type(a, b)
    if not torch.can_cast(dtype, a.dtype):
        raise RuntimeError(words.format(result=scalar_type_name(dtype), out=scalar_type_name(a.dtype)))


def _add_out(a, b, *, alpha=1, out):
    result = _add(a, b, alpha)
    if out.is_sparse != result.is_sparse:
        raise RuntimeError("add: the layout of 'out' does not match the result's")
    if out.is_sparse:
        return out.copy_(result)
    return out.resize_(result.shape).copy_(result)


def _check_sub(a, b):
    if a.dtype == torch.bool and isinstance(b, torch.Tensor) and b.dtype == torch.bool:
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                           "Use the `^` or `logical_xor()` operator instead.")


def _sub(a, b, alpha=1):
    _check_sub(a, b)
    return _add(a, b, -alpha)


def _sub_(a, b, alpha=1):
    _check_sub(a, b)
    return _add_(a, b, -alpha)


def _neg(s):
    return _make(s._indices().clone(), -s._values(), s.shape, s.is_coalesced())


def _scalar_like(x) -> bool:
    """A Python number or a 0-dim dense tensor: it scales every value."""
    return not isinstance(x, torch.Tensor) or (not x.is_sparse and x.dim() == 0)


def _intersection(a, b):
    """(rows of a, rows of b) of the sparse indices both coalesced `a` and `b` hold."""
    sizes = list(a.shape[:a.sparse_dim()])
    la, lb = _linear(a._indices(), sizes), _linear(b._indices(), sizes)
    if la.shape[0] == 0 or lb.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=a.device)
        return empty, empty
    at = torch.searchsorted(lb, la).clamp_(max=lb.shape[0] - 1)  # coalesced: lb sorted and unique
    rows = torch.nonzero(lb[at] == la).squeeze(1)
    return rows, at[rows]


def _mul(a, b):
    dtype = torch.result_type(a, b)
    if not (isinstance(a, torch.Tensor) and a.is_sparse):  # dense * sparse: the same product
        a, b = b, a
    if isinstance(b, torch.Tensor) and b.is_sparse:  # sparse * sparse: the indices both hold
        _check_same_size("mul", a, b)
        a, b = a.coalesce(), b.coalesce()
        rows_a, rows_b = _intersection(a, b)
        values = a._values()[rows_a].to(dtype) * b._values()[rows_b].to(dtype)
        return _make(a._indices()[:, rows_a], values, a.shape, True)
    if _scalar_like(b):
        values = a._values() * b
    else:  # a dense tensor (broadcast to the sparse shape): its elements at the sparse indices
        values = a._values() * b.expand(a.shape)[tuple(a._indices())]
    return _make(a._indices().clone(), values.to(dtype), a.shape, a.is_coalesced())


def _mul_(a, b):
    if not a.is_sparse:  # dense *= sparse: the sparse product (zero where `b` holds nothing), written densely
        _check_in_place_cast(a, b, _ADD_CAST_WORDS)
        return a.copy_(_mul(a, b).to_dense())
    _check_in_place_cast(a, b, _SCALAR_CAST_WORDS if _scalar_like(b) else _CAST_WORDS)
    return a.copy_(_mul(a, b).to(a.dtype))


def _div(a, b, *, rounding_mode=None):
    if not _scalar_like(b):
        shape = list(b.shape)
        raise RuntimeError(f"Sparse division requires a scalar or zero-dim dense tensor divisor (got shape {shape} "
                           "for divisor)")
    if rounding_mode is not None:  # not linear: duplicates are summed first (as on CPU)
        a = a.coalesce()
    values = torch.div(a._values(), b, rounding_mode=rounding_mode)
    return _make(a._indices().clone(), values, a.shape, a.is_coalesced())


def _in_place(kernel):
    """The in-place form of a sparse kernel: the result copied into `a` (a sparse tensor)."""
    def in_place(a, *args, **kwargs):
        result = kernel(a, *args, **kwargs)
        cpu_errors.check_cast(result.dtype, a.dtype)
        return a.copy_(result.to(a.dtype))

    return in_place


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
    # mask's entries as they are, duplicates included (an uncoalesced mask gives an uncoalesced result, as on CPU)
    indices = mask._indices()
    if mask._nnz() == 0:
        values = self.new_zeros((0,) + tuple(self.shape[mask.sparse_dim():]))
    elif mask.sparse_dim() == 0:  # no sparse dims: each entry is the whole tensor
        values = self.unsqueeze(0).expand((mask._nnz(),) + tuple(self.shape)).clone()
    else:
        values = self[tuple(indices)]
    return _make(indices.clone(), values, self.shape, mask.is_coalesced())


def _sparse_mask_projection(self, mask, accumulate_matches=False):
    """sparse_mask's backward: self's entries, zeroed where mask has no entry at their index (times the number
    of mask's entries there with accumulate_matches), as ATen's intersection kernel gives them."""
    if self.shape != mask.shape:
        raise RuntimeError("sparse_mask_projection(): operands have incompatible sizes; self has size "
                           f"{list(self.shape)} but mask has size {list(mask.shape)}")
    sizes = self.shape[:self.sparse_dim()]
    ours = _linear(self._indices(), sizes)
    theirs, _ = torch.sort(_linear(mask._indices(), sizes))
    matches = torch.searchsorted(theirs, ours, right=True) - torch.searchsorted(theirs, ours)
    factor = matches if accumulate_matches else (matches > 0)
    values = self._values()
    values = values * factor.to(values.dtype).reshape((-1,) + (1,) * (values.dim() - 1))
    return _make(self._indices().clone(), values, self.shape, self.is_coalesced())


def _sum(s, *, dtype=None):
    values = s._values()
    return values.sum(dtype=dtype) if s._nnz() else torch.zeros((), dtype=dtype or values.dtype, device=values.device)


# ------------------------------------------------------------------ sparse CSR (2-D, no dense dims)
_SPARSE_CSR_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCsrCPU)
_CSR_GENERIC = (
    aten.crow_indices.default,
    aten.col_indices.default,
    aten.values.default,
    aten._nnz.default,
    aten.sparse_dim.default,
    aten.dense_dim.default,
    aten.copy_.default,
    aten.clone.default,
    aten.empty_like.default,
    aten.resize_as_sparse_.default,
)


def _csr_parts(s, name: str):
    """(row of each entry, column of each entry, values) of a 2-D CSR tensor with no dense dims."""
    if s.layout != torch.sparse_csr:
        raise NotImplementedError(f"{name}: only the sparse_csr layout is supported on the 'tpu' device "
                                  f"(got {s.layout})")
    if s.dim() != 2 or s.dense_dim() != 0:
        raise NotImplementedError(f"{name}: batched or hybrid sparse CSR tensors are not supported on the 'tpu' "
                                  f"device (got {s.dim()} dims, {s.dense_dim()} dense)")
    crow, col = s.crow_indices(), s.col_indices()
    positions = torch.arange(col.shape[0], dtype=crow.dtype, device=crow.device)
    rows = torch.searchsorted(crow[1:], positions, right=True)  # the row whose range holds each entry
    return rows, col, s.values()


def _csr_to_dense(s, dtype=None, masked_grad=None):
    rows, cols, values = _csr_parts(s, "to_dense")
    dtype = dtype or s.dtype
    out = torch.zeros(s.shape, dtype=dtype, device=s.device)
    if values.shape[0] == 0:
        return out
    return out.index_put_((rows, cols), values.to(dtype), accumulate=True)


def _dense_to_csr(x, dense_dim=None):
    if x.dim() != 2 or dense_dim:
        raise NotImplementedError("to_sparse_csr: only 2-D tensors with no dense dims are supported on the 'tpu' "
                                  f"device (got {x.dim()} dims, dense_dim={dense_dim})")
    coo = _dense_to_sparse(x, 2)
    return _coordinates_to_csr(*coo._indices(), coo._values(), x.shape)


def _csr_to_coo(s, *, layout=None, blocksize=None, dense_dim=None):
    if layout == torch.sparse_csr and blocksize is None:
        return s
    if layout not in (None, torch.sparse_coo) or blocksize is not None:
        raise NotImplementedError(f"to_sparse: conversion from SparseCsr to {layout} is not supported on the 'tpu' device")
    rows, cols, values = _csr_parts(s, "to_sparse")
    return _make(torch.stack([rows, cols]), values, s.shape, True)  # CSR entries are in row-major order


def _csr_to_coo_dim(s, sparse_dim):
    if sparse_dim != 2:
        raise RuntimeError("sparse_compressed_to_sparse: conversion from SparseCsr to Sparse with sparse_dim argument !=2 "
                           "is not supported")
    return _csr_to_coo(s)


def _csr_reduction(kind: str):
    """`_sparse_csr_sum` / `_sparse_csr_prod` (masked reductions over CSR masks): ATen's rule, over the stored
    entries only (a prod ignores implicit zeros); the result is CSR with an entry per reduced row or column
    that holds any, the dims kept."""
    def kernel(s, dim, keepdim=False, *, dtype=None):
        if not keepdim:
            raise RuntimeError("reduction operations on CSR tensors with keepdim=False is unsupported")
        rows, cols, values = _csr_parts(s, f"_sparse_csr_{kind}")
        if dtype is None and not (values.dtype.is_floating_point or values.dtype.is_complex):
            dtype = torch.int64  # sum's and prod's integer promotion
        values = values.to(dtype or values.dtype)
        dims = sorted({d % 2 for d in dim})
        key = cols if dims == [0] else rows if dims == [1] else torch.zeros_like(rows)
        n = s.shape[1] if dims == [0] else s.shape[0] if dims == [1] else 1
        shape = (1, s.shape[1]) if dims == [0] else (s.shape[0], 1) if dims == [1] else (1, 1)
        start = (torch.zeros if kind == "sum" else torch.ones)(n, dtype=values.dtype, device=values.device)
        reduced = start.index_add(0, key, values) if kind == "sum" else start.index_reduce(0, key, values, "prod")
        held = torch.zeros(n, dtype=torch.int64, device=values.device).index_add_(0, key, torch.ones_like(key))
        which = (held > 0).nonzero().squeeze(1)  # the reduced rows/columns that hold entries (sorted)
        if dims == [1]:
            crow = torch.cat([held.new_zeros(1), (held > 0).to(torch.int64).cumsum(0)])
            col = torch.zeros_like(which)
        else:
            crow = torch.stack([which.new_zeros(()), which.new_tensor(which.shape[0])])
            col = which
        return torch.sparse_csr_tensor(crow, col, reduced[which], shape, device=values.device)

    return kernel


def _dense_to_other(layout_name):
    def kernel(x, *args, **kwargs):
        raise NotImplementedError(f"to_sparse: conversion from Strided to {layout_name} is not supported on the "
                                  "'tpu' device (it stores sparse COO and 2-D sparse CSR)")

    return kernel


def _check_sampled(self, mat1, mat2):
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise RuntimeError(f"sampled_addmm: Expected mat1 and mat2 to be matrices, got {mat1.dim()}D and {mat2.dim()}D")
    if mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({mat1.shape[0]}x{mat1.shape[1]} and "
                           f"{mat2.shape[0]}x{mat2.shape[1]})")
    if tuple(self.shape) != (mat1.shape[0], mat2.shape[1]):
        raise RuntimeError(f"sampled_addmm: self.shape {list(self.shape)} does not match the product's "
                           f"{[mat1.shape[0], mat2.shape[1]]}")


def _sampled_addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """beta * self + alpha * (mat1 @ mat2), computed only at self's (CSR) entries."""
    _check_sampled(self, mat1, mat2)
    rows, cols, values = _csr_parts(self, "sampled_addmm")
    product = (mat1.index_select(0, rows) * mat2.index_select(1, cols).t()).sum(-1)
    new = product * alpha if alpha != 1 else product
    if beta != 0:
        new = new + (values * beta if beta != 1 else values)
    return torch.sparse_csr_tensor(self.crow_indices().clone(), cols.clone(), new.to(values.dtype), self.shape,
                                   device=self.device)


def _mm_reduce(self, other, reduce):
    """(CSR self @ dense other, reduced per row with `reduce`; the empty argmax tensor PyTorch's forward returns)."""
    rows, cols, values = _csr_parts(self, "sparse.mm")
    if other.dim() != 2 or self.shape[1] != other.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({self.shape[0]}x{self.shape[1]} and "
                           f"{'x'.join(str(n) for n in other.shape)})")
    if reduce not in ("sum", "mean", "amax", "amin"):
        raise RuntimeError(f"reduce argument must be either sum, mean, amax or amin, got {reduce}")
    out = torch.zeros((self.shape[0], other.shape[1]), dtype=other.dtype, device=other.device)
    empty = torch.zeros(0, dtype=torch.int64, device=other.device)
    if values.shape[0] == 0:
        return out, empty
    terms = values.unsqueeze(1).to(other.dtype) * other.index_select(0, cols)
    if reduce in ("sum", "mean"):
        out.index_add_(0, rows, terms)
        if reduce == "mean":
            counts = (self.crow_indices()[1:] - self.crow_indices()[:-1]).clamp(min=1)
            out = out / counts.unsqueeze(1).to(out.dtype)
        return out, empty
    return out.index_reduce_(0, rows, terms, reduce, include_self=False), empty


def _csr_sparse_mask(self, mask):
    if self.shape != mask.shape:
        raise RuntimeError("sparse_mask(): operands have incompatible sizes; self has size "
                           f"{list(self.shape)} but mask has size {list(mask.shape)}")
    rows, cols, _ = _csr_parts(mask, "sparse_mask")
    if self.layout != torch.strided:
        self = self.to_dense()
    return torch.sparse_csr_tensor(mask.crow_indices().clone(), cols.clone(), self[rows, cols], self.shape,
                                   device=self.device)


def _csr_product(rows, cols, values, dense, m: int):
    """(sparse with entries (rows, cols, values) and m rows) @ dense."""
    out = torch.zeros((m, dense.shape[1]), dtype=dense.dtype, device=dense.device)
    if values.shape[0] == 0:
        return out
    return out.index_add_(0, rows, values.unsqueeze(1).to(dense.dtype) * dense.index_select(0, cols))


def _csr_mm(a, b):
    _check_mm(a, b)
    if a.layout != torch.strided and b.layout != torch.strided:
        raise NotImplementedError("mm: sparse @ sparse is not supported on the 'tpu' device (sparse @ dense and "
                                  "dense @ sparse are)")
    if a.layout != torch.strided:
        rows, cols, values = _csr_parts(a, "mm")
        return _csr_product(rows, cols, values, b, a.shape[0])
    rows, cols, values = _csr_parts(b, "mm")  # dense @ csr = (csr^T @ dense^T)^T
    return _csr_product(cols, rows, values, a.t(), b.shape[1]).t().contiguous()


def _csr_addmm(self, mat1, mat2, *, beta=1, alpha=1):
    if self.layout != torch.strided:
        raise NotImplementedError("addmm: a sparse CSR 'self' is not supported on the 'tpu' device")
    product = _csr_mm(mat1, mat2)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    self = self.expand(product.shape)
    return product + (self if beta == 1 else self * beta)


def _mm_reduce_backward(self, grad_out, weight, reduce, arg_out, output_mask):
    """Gradients of `_mm_reduce` for self's values (a CSR tensor with self's pattern) and for `weight`."""
    rows, cols, values = _csr_parts(self, "sparse.mm")
    grad = grad_out
    if reduce == "mean":
        counts = (self.crow_indices()[1:] - self.crow_indices()[:-1]).clamp(min=1)
        grad = grad / counts.unsqueeze(1).to(grad.dtype)
    per_entry = grad.index_select(0, rows)  # nnz x n: the output gradient each entry contributes to
    if reduce in ("amax", "amin"):  # only the entry that gave each output (the first one, as PyTorch's kernel)
        terms = values.unsqueeze(1).to(weight.dtype) * weight.index_select(0, cols)
        out, _ = _mm_reduce(self, weight, reduce)
        nnz = values.shape[0]
        position = torch.arange(nnz, device=values.device).unsqueeze(1).expand_as(terms)
        candidate = torch.where(terms == out.index_select(0, rows), position, nnz)
        first = torch.full(out.shape, nnz, dtype=torch.int64, device=values.device)
        first.index_reduce_(0, rows, candidate, "amin", include_self=True)
        per_entry = torch.where(first.index_select(0, rows) == position, per_entry, 0)
    grad_self = grad_weight = None
    if output_mask[0]:
        grad_values = (per_entry * weight.index_select(0, cols)).sum(-1).to(values.dtype)
        grad_self = torch.sparse_csr_tensor(self.crow_indices().clone(), cols.clone(), grad_values, self.shape,
                                            device=self.device)
    if output_mask[1]:
        grad_weight = torch.zeros_like(weight).index_add_(0, cols, values.unsqueeze(1).to(weight.dtype) * per_entry)
    return grad_self, grad_weight


def csr_kernels() -> dict:
    """aten op -> kernel for the SparseCsrPrivateUse1 key."""
    out = {op: _redispatch(op, _SPARSE_CSR_CPU) for op in _CSR_GENERIC}
    out.update({
        aten._to_dense.default: _csr_to_dense,
        aten._to_sparse.default: _csr_to_coo,
        aten._sparse_csr_sum.dim_dtype: _csr_reduction("sum"),
        aten.sum.dim_IntList: _csr_reduction("sum"),  # as ATen's SparseCsrCPU kernel: the same reduction
        aten.sum.default: lambda s, *, dtype=None: s.values().sum(dtype=dtype),  # a dense 0-d tensor, as ATen's
        aten._sparse_csr_prod.dim_dtype: _csr_reduction("prod"),
        aten._to_sparse.sparse_dim: _csr_to_coo_dim,
        aten.sparse_sampled_addmm.default: _sampled_addmm,
        aten._sparse_mm_reduce_impl.default: _mm_reduce,
        aten._sparse_mm_reduce_impl_backward.default: _mm_reduce_backward,
        aten.sparse_mask.default: _csr_sparse_mask,
        aten.mm.default: _csr_mm,
        aten.addmm.default: _csr_addmm,
    })
    return out


def sparse_kernels() -> dict:
    """aten op -> kernel for the SparsePrivateUse1 key."""
    out = {op: _redispatch(op) for op in _GENERIC}
    out.update({
        aten._coalesce.default: _coalesce,
        aten._sparse_broadcast_to.default: _broadcast_to,
        aten._to_dense.default: _to_dense,
        aten._to_sparse.default: _to_sparse_sparse,
        aten._to_sparse.sparse_dim: _to_sparse_dim_sparse,
        aten._to_sparse_csr.default: _coo_to_csr,
        aten.add.Tensor: _add,
        aten.add_.Tensor: _add_,
        aten.add.out: _add_out,
        aten.sub.Tensor: _sub,
        aten.sub_.Tensor: _sub_,
        aten.neg.default: _neg,
        aten.mul.Tensor: _mul,
        aten.mul_.Tensor: _mul_,
        aten.div.Tensor: _div,
        aten.div.Tensor_mode: _div,
        aten.div_.Tensor: _in_place(_div),
        aten.div_.Tensor_mode: _in_place(_div),
        aten.mm.default: _mm,
        aten.addmm.default: _addmm,
        aten.sparse_mask.default: _sparse_mask,
        aten._sparse_mask_projection.default: _sparse_mask_projection,
        aten.sum.default: _sum,
    })
    return out


def dense_kernels() -> dict:
    """aten op -> kernel for the (dense) PrivateUse1 key: dense -> sparse conversion."""
    return {
        aten._to_sparse.default: _to_sparse_dense,
        aten._to_sparse.sparse_dim: _dense_to_sparse,
        aten._to_sparse_csr.default: _dense_to_csr,
        aten._to_sparse_csc.default: _dense_to_other("SparseCsc"),
        aten._to_sparse_bsr.default: _dense_to_other("SparseBsr"),
        aten._to_sparse_bsc.default: _dense_to_other("SparseBsc"),
    }
