"""Storage-level truth: one device buffer per PyTorch storage.

A tpu storage is identified by its (fake, unique) data pointer, handed out by
the native allocator. This module maps that address to the storage's device
buffer: a flat 1-D jax.Array holding the storage's bytes as elements of some
dtype. Views never own buffers; they read and write their storage's buffer.
When PyTorch frees a storage, the native allocator queues its address and
`drain()` drops the buffer.

Owns: the address -> buffer map, reinterpretation of a buffer's element type,
and `materialize()`: the one gate every reader of buffer *values* passes
(DeferAndFuse keeps pending values here until then).
Does not own: memory accounting (native allocator) or programs (eager/).
"""
from __future__ import annotations

import torch

from torch_tpu import _native

# address -> (value, torch dtype of the value's elements). The value is a
# jax.Array, or an executor's pending value (DeferAndFuse). A storage that was
# allocated but never written has no entry: it reads as zeros.
buffers: dict[int, tuple] = {}

_drain_freed = _native.drain_freed

# Set by DeferAndFuse (eager/defer.py) while a recorded graph holds pending
# values: the function that runs it. None otherwise: materialize() is a no-op.
_flush = None
# Set by the value checks (eager/valuecheck.py) while error flags of launched programs are
# unchecked: the function that checks them (and raises). None otherwise.
_check = None


def drain() -> None:
    """Drop the buffers of storages PyTorch has freed since the last call."""
    freed = _drain_freed()
    if freed:
        pop = buffers.pop
        for address in freed:
            pop(address, None)


def live_buffer_count() -> int:
    drain()
    return len(buffers)


def storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def set_flush(flush) -> None:
    """Register the function that makes pending buffer values concrete (None: nothing pending)."""
    global _flush
    _flush = flush


def set_check(check) -> None:
    """Register the function that checks pending error flags at a materialization point (None: none pending)."""
    global _check
    _check = check


def flush_pending(reason: str) -> None:
    """Make pending buffer values concrete (DeferAndFuse runs what it recorded) without reading value-check
    flags: for points that need values on the device but raise nothing (a resize, a compiled graph's launch)."""
    flush = _flush
    if flush is not None:
        flush(reason)


def materialize(reason: str = "read") -> None:
    """Make every buffer value concrete before reading one (a materialization point).

    Every code path that needs a storage's value rather than its metadata
    calls this first: device->host copies (`.cpu()`, `.item()`, `print`,
    `bool()`), moves between devices, `torch.tpu.synchronize()`, CPU
    fallbacks and data-dependent shapes (through `.cpu()`), and skinny-mode
    collectives. In Strict mode it costs two global reads.
    """
    flush_pending(reason)
    check = _check
    if check is not None:
        check(reason)


def copied(dest_address: int, src_address: int, nbytes: int) -> None:
    """c10 copied a copy-on-write storage (`Tensor._lazy_clone`, then a write to either side): the new
    allocation holds the same value. Buffers are immutable values, so the copy shares the source's."""
    flush_pending("copy-on-write")
    entry = buffers.get(src_address)
    if entry is not None:
        buffers[dest_address] = entry


def resized(old_address: int, new_address: int, old_nbytes: int, new_nbytes: int) -> None:
    """`untyped_storage().resize_()` moved a storage to a new allocation: move its buffer too.

    Kept bytes keep their values; new bytes read as zeros; resize_(0) drops the buffer
    (FSDP2 frees unsharded parameters so and re-allocates them before its all-gathers).
    """
    flush_pending("resize")  # not value checks: a check's error is not to be raised inside resize_
    entry = buffers.pop(old_address, None)
    if entry is None or new_nbytes == 0:
        return
    import jax.numpy as jnp

    value, dtype = entry
    if not hasattr(value, "shape"):  # a lost value (a failed value check or deferred graph) stays lost
        buffers[new_address] = entry
        return
    n = new_nbytes // dtype.itemsize
    if n <= value.shape[0]:
        buffers[new_address] = (value[:n], dtype)
    else:
        buffers[new_address] = (jnp.pad(value, (0, n - value.shape[0])), dtype)
