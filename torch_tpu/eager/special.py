"""Kernels that are not a lowering: copies across devices, resize_, item, set_().

Everything here either crosses the host/device boundary or changes which
storage a tensor uses; same-device value computation still goes through the
executor (copy_ between tpu tensors is the derived in-place of `aten.copy`).
"""
from __future__ import annotations

import torch

from torch_tpu.eager.opspec import spec
from torch_tpu.runtime import strided, transfer

aten = torch.ops.aten
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _copy_same_device(dst, src, non_blocking=False):
    from torch_tpu.eager.executor import execute
    from torch_tpu.ops import registry

    return execute(spec(aten.copy_.default), registry.get(aten.copy.default), True, dst, src, non_blocking)


# The dtype of a wrapped Python number (what PyTorch's argument parser makes of one).
_WRAPPED_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # copy_ sees tensors with lazy conjugate/negative bits (PyTorch lets them through to
    # copy_): resolve the source's, and store what dst's bits read back as the value.
    from torch_tpu.ops import bits

    if not isinstance(src, torch.Tensor):  # a Python number (`grad.copy_(torch.inf)`): as ATen wraps one
        src = torch.tensor(src, dtype=_WRAPPED_NUMBER_DTYPES.get(type(src)))
    if dst.device.type == "tpu":
        if src.device.type == "tpu":
            src = bits.resolved(src)
            if src.device != dst.device:
                src = transfer.to_device(src, dst.device.index)
        elif src.device.type == "cpu":
            src = transfer.upload(src, dst.device.index)  # upload resolves the bits itself
        else:
            raise RuntimeError(f"copy_ from {src.device} to {dst.device} is not supported")
        if bits.has_bits(dst):
            _copy_same_device(bits.stripped(dst), bits.apply_bits(src, dst), non_blocking)
            return dst
        return _copy_same_device(dst, src, non_blocking)
    if dst.device.type != "cpu":
        raise RuntimeError(f"copy_ from {src.device} to {dst.device} is not supported")
    # NOTE: device -> host is a materialization point; non_blocking is not honoured.
    host = transfer.download(bits.stripped(src))  # the stored values; the bits are applied on the host
    if src.is_conj():
        host = host.conj()
    if src.is_neg():
        host = host._neg_view()
    return dst.copy_(host)


def _local_scalar_dense(t: torch.Tensor):
    # ATen's kernel: the first element (Tensor.item() checks for exactly one before it gets here).
    if t.numel() == 0:
        raise RuntimeError("_local_scalar_dense: Empty tensor not supported")
    return transfer.download(t if t.dim() == 0 else t.as_strided((), ())).item()


def resize_(t: torch.Tensor, size, memory_format=None):
    size = tuple(size)
    numel = 1
    for s in size:
        numel *= s
    needed = (t.storage_offset() + numel) * t.element_size()
    if needed <= t.untyped_storage().nbytes():
        return aten.resize_.default.redispatch(_CPU, t, size, memory_format=memory_format)
    # Grow: a new storage holding the old bytes (PyTorch keeps them), then re-point t at it.
    old_bytes = t.untyped_storage().nbytes()
    fresh = torch.empty(needed // t.element_size(), dtype=t.dtype, device=t.device)
    if old_bytes:
        old = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), 0, (old_bytes // t.element_size(),), (1,)
        )
        fresh[: old.numel()].copy_(old)
    if memory_format is None or memory_format == torch.contiguous_format:
        strides = strided.contiguous_strides(size)
    else:
        strides = torch.empty(size, device="meta", memory_format=memory_format).stride()
    return t.set_(fresh.untyped_storage(), t.storage_offset(), size, strides)


def set_empty(t: torch.Tensor):
    fresh = torch.empty(0, dtype=t.dtype, device=t.device)
    return t.set_(fresh.untyped_storage(), 0, (0,), (1,))


def _has_compatible_shallow_copy_type(t: torch.Tensor, other: torch.Tensor) -> bool:
    # NOTE: PyTorch's own check lists CPU/CUDA/... but not PrivateUse1, so
    # `module.to("tpu")` would replace Parameters and silently untie tied
    # weights. CPU and tpu dense tensors swap data like CPU and CUDA do.
    dense = ("cpu", "tpu")
    return t.layout == other.layout == torch.strided and t.device.type in dense and other.device.type in dense


def _copy_from(src, dst, non_blocking=False):
    return copy_(dst, src, non_blocking)


def kernels() -> dict:
    return {
        aten.copy_.default: copy_,
        aten._copy_from.default: _copy_from,
        aten._has_compatible_shallow_copy_type.default: _has_compatible_shallow_copy_type,
        aten._local_scalar_dense.default: _local_scalar_dense,
        aten.resize_.default: resize_,
        aten.set_.default: set_empty,
        aten.set_.source_Storage: lambda t, s: aten.set_.source_Storage.redispatch(_CPU, t, s),
        aten.set_.source_Storage_storage_offset: lambda t, s, o, size, stride=(): (
            aten.set_.source_Storage_storage_offset.redispatch(_CPU, t, s, o, size, stride)
        ),
        aten.set_.source_Tensor: lambda t, s: aten.set_.source_Tensor.redispatch(_CPU, t, s),
        aten.is_set_to.default: lambda t, s: aten.is_set_to.default.redispatch(_CPU, t, s),  # metadata only
        aten.set_.source_Tensor_storage_offset: lambda t, s, o, size, stride=(): (
            aten.set_.source_Tensor_storage_offset.redispatch(_CPU, t, s, o, size, stride)
        ),
    }
