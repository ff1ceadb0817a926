"""DLPack for tpu tensors: `torch.from_dlpack(t)`, `torch.utils.dlpack.to_dlpack(t)`, `t.__dlpack__()`.

PyTorch exports a PrivateUse1 tensor as a kDLExtDev capsule and imports such a capsule as a
PrivateUse1 tensor whose storage wraps the capsule's data pointer. On tpu a data pointer names a
whole device buffer (runtime/storage.py), so a capsule shares memory with the exported tensor exactly
when that tensor spans its whole storage, which is the common case (`torch.from_dlpack(model_output)`).
A view of part of a storage is exported as a copy of its values: `copy=None` means "copy only if
necessary" in the DLPack protocol, and `copy=False` raises BufferError, as a producer that cannot
share must. Two PyTorch details are mended here: `Tensor.__dlpack_device__` compares the device type
with the literal "privateuse1", so a renamed backend got "Unknown device type", and
`torch.utils.dlpack.to_dlpack` is the C function, which knows nothing of whole storages.
Consumers other than PyTorch (JAX, NumPy, CuPy) do not read kDLExtDev capsules.
"""
from __future__ import annotations

import torch
import torch.utils.dlpack

_original = None


def spans_its_storage(t: torch.Tensor) -> bool:
    """Whether `t` starts at its storage's first byte and reaches its last (what DLPack's import keeps)."""
    if t.storage_offset() != 0:
        return False
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return span * t.element_size() == t.untyped_storage().nbytes()


def exportable(t: torch.Tensor, copy: bool | None = None) -> torch.Tensor:
    """The tensor whose memory a capsule of `t` describes: `t`, or a copy of a tpu view of part of a storage."""
    if t.device.type != "tpu" or t.requires_grad or t.is_conj() or t.layout != torch.strided or spans_its_storage(t):
        return t  # PyTorch's own checks raise for gradients, conjugate bits and layouts
    if copy is False:
        raise BufferError(
            "Can't export a tpu tensor that covers part of its storage without a copy (copy=False): "
            "a tpu capsule shares memory only with a whole storage")
    return t.clone(memory_format=torch.contiguous_format)


def install() -> None:
    """Wrap `Tensor.__dlpack_device__`, `Tensor.__dlpack__` and `torch.utils.dlpack.to_dlpack` for tpu (idempotent)."""
    global _original
    if _original is not None:
        return
    tensor = torch.Tensor
    _original = (tensor.__dlpack_device__, tensor.__dlpack__, torch.utils.dlpack.to_dlpack)
    dlpack_device, dlpack, to_dlpack = _original

    def __dlpack_device__(self):
        if self.device.type == "tpu" and not torch.overrides.has_torch_function_unary(self):
            return (torch.utils.dlpack.DLDeviceType.kDLExtDev, self.device.index or 0)
        return dlpack_device(self)

    def __dlpack__(self, *, stream=-1, max_version=None, dl_device=None, copy=None):
        source = exportable(self, copy)
        if source is not self and copy is None:
            copy = False  # already a copy: the C export need not make another
        return dlpack(source, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def to_dlpack_tpu(tensor):
        return to_dlpack(exportable(tensor))

    for new, old in ((__dlpack_device__, dlpack_device), (__dlpack__, dlpack), (to_dlpack_tpu, to_dlpack)):
        new.__doc__, new.__name__ = old.__doc__, old.__name__
    tensor.__dlpack_device__, tensor.__dlpack__ = __dlpack_device__, __dlpack__
    torch.utils.dlpack.to_dlpack = to_dlpack_tpu
