"""Host <-> device and device <-> device copies of whole tensors.

Owns: turning a CPU tensor into a fresh tpu tensor (upload), a tpu tensor into
a CPU tensor (download: a materialization point), and moving a tpu tensor's
value to another tpu device. Copies into existing views go through the
executor's `copy_` program, which writes the view in place.
"""
from __future__ import annotations

import jax
import numpy as np
import torch

from torch_tpu import _native, metrics
from torch_tpu import profiler as _trace
from torch_tpu.runtime import strided
from torch_tpu.runtime import dtypes, platform, storage

aten = torch.ops.aten


def _fresh(array, sizes, dtype: torch.dtype, device: int) -> torch.Tensor:
    t, address = _native.new_tensor(sizes, strided.contiguous_strides(sizes), dtype, device)
    storage.buffers[address] = (array, dtype)
    return t


def upload(src: torch.Tensor, device: int) -> torch.Tensor:
    """A new contiguous tpu tensor on `device` holding a CPU tensor's value."""
    rt = platform.get()
    dtypes.check_supported(src.dtype, rt.platform)
    src = src.detach().resolve_conj().resolve_neg().contiguous()
    # Copy: the device buffer must not alias host memory the user may mutate.
    host = np.array(dtypes.tensor_to_numpy(src.reshape(-1)), copy=True)  # flat: NumPy holds at most 64 dims
    if _trace.active:  # torch.profiler memcpy row: until the copy is on the device
        start = _trace._clock()
        array = jax.device_put(host, rt.devices[device]).block_until_ready()
        _trace.copy("Memcpy HtoD", device, start, host.nbytes)
    else:
        array = jax.device_put(host, rt.devices[device])
    metrics.counts.h2d_transfers += 1
    metrics.counts.h2d_bytes += host.nbytes
    return _fresh(array, tuple(src.shape), src.dtype, device)


def dense_array(t: torch.Tensor, flat: bool = False):
    """The value of a tpu tensor as a dense device array of its shape, or flat (None if never written).

    A materialization point: pending (DeferAndFuse) values are computed first.
    """
    storage.drain()
    address = t.untyped_storage().data_ptr()
    entry = storage.buffers.get(address)
    if entry is None:
        return None
    buffer_dtype = entry[1]
    whole = (
        buffer_dtype == t.dtype and t.storage_offset() == 0 and t.is_contiguous()
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )
    if not whole:  # recorded with the pending work in DeferAndFuse: one flush runs both
        t = aten.clone.default(t, memory_format=torch.contiguous_format)
        address = t.untyped_storage().data_ptr()
    storage.materialize()
    array = storage.buffers[address][0]
    if not isinstance(array, jax.Array):  # a value lost to a failed deferred graph
        raise RuntimeError(str(array))
    return array if flat else array.reshape(tuple(t.shape))


def download(t: torch.Tensor) -> torch.Tensor:
    """A tpu tensor's value as a new CPU tensor (waits for the device)."""
    if t.numel() == 0:  # no value to read, but still a materialization point (pending work, value checks)
        storage.materialize()
        return torch.empty(tuple(t.shape), dtype=t.dtype)
    array = dense_array(t, flat=True)
    if array is None:  # never written: PyTorch would show uninitialised memory
        return torch.zeros(tuple(t.shape), dtype=t.dtype)
    # Reshaped on the host: a device reshape would queue behind all launched work
    # and wait for it, where the copy only waits for this value.
    start = _trace._clock() if _trace.active else 0
    host = np.asarray(array)
    if start:
        _trace.copy("Memcpy DtoH", t.device.index, start, host.nbytes)
    metrics.counts.d2h_transfers += 1
    metrics.counts.d2h_bytes += host.nbytes
    metrics.counts.materializations += 1
    return dtypes.numpy_to_tensor(host).reshape(tuple(t.shape))  # torch's reshape: NumPy holds at most 64 dims


def to_device(t: torch.Tensor, device: int) -> torch.Tensor:
    """A new contiguous tpu tensor on `device` with the value of tpu tensor `t`."""
    array = dense_array(t)
    if array is None:
        return torch.zeros(tuple(t.shape), dtype=t.dtype, device=torch.device("tpu", device))
    start = _trace._clock() if _trace.active else 0
    moved = jax.device_put(array.reshape(-1), platform.get().devices[device])
    if start:
        moved.block_until_ready()
        _trace.copy("Memcpy DtoD", device, start, t.numel() * t.element_size())
    metrics.counts.d2d_transfers += 1
    metrics.counts.d2d_bytes += t.numel() * t.element_size()
    return _fresh(moved, tuple(t.shape), t.dtype, device)
