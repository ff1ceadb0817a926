"""out= arguments that overlap inputs: PyTorch's "unsupported operation" errors.

Gathers, index_select, take, masked_select and cat refuse an `out=` tensor
that shares memory with an input, or whose elements overlap each other (an
expanded tensor): written in place, the result would read what it already
overwrote. Their out= variants run here as torch-level kernels: the checks
(on metadata only: storage, offset, sizes, strides), then the functional op,
then a resize and copy into `out`.

NOTE(torch-vs-xla): a program never reads what it writes (XLA's values are
immutable), so these calls would compute the "right" answer; PyTorch refuses
them, and so do we, so that code moved from CPU or CUDA behaves the same.
"""
from __future__ import annotations

import functools

import torch

from torch_tpu.ops.registry import aten, kernel
from torch_tpu.runtime.dtypes import cpp_name, scalar_type_name

_INPUT_OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                  "single memory location. Please clone() the tensor before performing the operation.")
_INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single "
                     "memory location. Please clone() the tensor before performing the operation.")


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte of the storage a tensor's elements occupy."""
    start = t.storage_offset()
    end = start + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return start * t.element_size(), end * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    return a0 < b1 and b0 < a1


def _check(out: torch.Tensor, inputs) -> None:
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride())):
        raise RuntimeError(_INTERNAL_OVERLAP)
    for t in inputs:
        if isinstance(t, torch.Tensor) and _overlap(out, t):
            raise RuntimeError(_INPUT_OVERLAP)


def _same_dtype(out: torch.Tensor, dtype: torch.dtype) -> None:
    if out.dtype != dtype:
        raise RuntimeError(f"Expected out tensor to have dtype {cpp_name(dtype)}, but got "
                           f"{cpp_name(out.dtype)} instead")


def _write(out: torch.Tensor, result: torch.Tensor, inputs=()) -> torch.Tensor:
    """Resize `out` to the result (as PyTorch's out= ops do, first), check it, copy the result in.

    Checked before the resize too: growing a view keeps its overlaps, but a grown storage may move.
    """
    _check(out, inputs)
    if out.shape != result.shape:
        if out.numel() != 0:
            import warnings

            warnings.warn(
                f"An output with one or more elements was resized since it had shape {list(out.shape)}, which does "
                f"not match the required output shape {list(result.shape)}. This behavior is deprecated, and in a "
                "future PyTorch release outputs will not be resized unless they have zero elements. You can "
                "explicitly reuse an out tensor t by resizing it, inplace, to zero elements with t.resize_(0).",
                UserWarning, stacklevel=3)
        out.resize_(result.shape)
    _check(out, inputs)
    return out.copy_(result)


@kernel(aten.gather.out)
def gather_out(x, dim, index, *, sparse_grad=False, out):
    _same_dtype(out, x.dtype)
    _check(out, (x,))
    return _write(out, aten.gather.default(x, dim, index, sparse_grad=sparse_grad), (x, index))


@kernel(aten.index_select.out)
def index_select_out(x, dim, index, *, out):
    _check(out, (x, index))
    if out.dtype != x.dtype:
        raise RuntimeError("index_select(): self and result must have the same scalar type")
    return _write(out, aten.index_select.default(x, dim, index), (x, index))


@kernel(aten.take.out)
def take_out(x, index, *, out):
    _check(out, (x, index))
    if out.dtype != x.dtype:
        raise RuntimeError(f"take(): self and out expected to have the same dtype, but got self.dtype = "
                           f"{scalar_type_name(x.dtype)} and out.dtype = {scalar_type_name(out.dtype)}")
    return _write(out, aten.take.default(x, index), (x, index))


@kernel(aten.masked_select.out)
def masked_select_out(x, mask, *, out):
    _check(out, (x, mask))
    if out.dtype != x.dtype:
        raise RuntimeError("masked_select(): self and result must have the same scalar type")
    return _write(out, aten.masked_select.default(x, mask), (x, mask))


@kernel(aten.cat.out)
def cat_out(tensors, dim=0, *, out):
    _check(out, ())
    result = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    if not torch.can_cast(result, out.dtype):  # PyTorch's TypeError, from its CPU kernel on empty tensors
        torch.cat([torch.empty(0, dtype=result)], out=torch.empty(0, dtype=out.dtype))
    return _write(out, aten.cat.default(tensors, dim), tensors)


@kernel(aten.aminmax.out)
def aminmax_out(x, *, dim=None, keepdim=False, min, max):
    _same_dtype(min, x.dtype)
    _same_dtype(max, x.dtype)
    dims = [] if dim is None else [dim]
    low, high = aten.amin.default(x, dims, keepdim), aten.amax.default(x, dims, keepdim)
    return _write(min, low, (x,)), _write(max, high, (x,))
