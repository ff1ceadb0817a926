"""Value checks on the host: error flags of launched programs, raised at materialization points.

A program whose lowering checks values (ops/checks.py) returns an error flag
beside its results. The executors hand each flag here with the op's name, the
user line that launched it and the arrays it produced; nothing waits. At the
next materialization point (`storage.materialize()`: `.cpu()`, `.item()`,
`print`, `bool()`, `torch.tpu.synchronize()`...) every pending flag is read
(one device->host copy of a few int64s) and the first failed check raises
PyTorch's exception type and message, with the op and its line, as CUDA
raises a device-side assertion at the next synchronization. Debug mode
(TORCH_TPU_LAUNCH_BLOCKING=1) checks at the op itself.

A failed op's results are not values: the storages holding them are marked
lost (reading them raises, as after a failed DeferAndFuse graph), and their
device buffers are dropped. Everything else keeps working.

Owns: pending flags, checking them, lost results. Does not own: what is
checked (ops/), launching (executor.py, defer.py).
"""
from __future__ import annotations

import sys
import threading
import weakref

import jax
import numpy as np

from torch_tpu import _native, metrics, recompiles
from torch_tpu.config import config
from torch_tpu.ops import checks
from torch_tpu.runtime import storage


class Lost:
    """The buffer value of a storage whose results are lost (a failed value check or DeferAndFuse graph):
    reading it raises."""

    __slots__ = ("message", "__weakref__")  # weakref: _lose watches its markers (any_lost)

    def __init__(self, message: str):
        self.message = message

    def __str__(self):
        return self.message


_lock = threading.Lock()
# (flag array of shape (n, 4) or (4,), [(op name, user frame, [weakref to each result array])] * n)
_pending: list = []
# Programs launched with a flag / flags found failed (the metrics report's "value checks" section).
counts = {"checked ops": 0, "failed": 0}
metrics.add_section("value checks", lambda: dict(counts))


def _refs(arrays) -> list:
    return [weakref.ref(a) for a in arrays if isinstance(a, jax.Array)]


def launched(flag, op: str, results) -> None:
    """A strict program ran: `flag` is its error flag, `results` the arrays it produced.

    The native cache-hit path calls this too, from a thread that may have no Python frame (autograd's)."""
    counts["checked ops"] += 1
    _enqueue((flag, [(op, recompiles.user_code(sys._getframe(0).f_back), _refs(results))]))


def _enqueue(entry) -> None:
    """Debug raises at the op; otherwise the flag waits for the next materialization point."""
    if config.launch_blocking:
        _raise_first([entry])
        return
    with _lock:
        _pending.append(entry)
        storage.set_check(check)


def launched_fused(flags, nodes: list) -> None:
    """A fused program ran: `flags` has one row per checked node; `nodes` is [(op, where, results)]."""
    counts["checked ops"] += len(nodes)
    with _lock:
        _pending.append((flags, [(op, where, _refs(results)) for op, where, results in nodes]))
        storage.set_check(check)


def launched_graph(flags, ops: list, results) -> None:
    """A torch.compile graph ran: `flags` has one row per checked op (`ops`, their names, in order);
    `results` are the graph's output arrays, all lost if a check failed (each depends on the graph's ops)."""
    where = recompiles.user_code(sys._getframe(1))  # the line that called the compiled function
    counts["checked ops"] += len(ops)
    _enqueue((flags, [(f"{op} (in a torch.compile graph)", where, _refs(results)) for op in ops]))


def pending() -> int:
    """How many launched programs have flags not yet checked."""
    return len(_pending)


def check(reason: str = "read") -> None:
    """Read every pending flag; raise the first failed check's error (a materialization point calls this)."""
    with _lock:
        taken = list(_pending)
        _pending.clear()
        storage.set_check(None)
    if taken:
        _raise_first(taken)


def _raise_first(entries: list) -> None:
    hosts = jax.device_get([flag for flag, _ in entries])
    first = None
    for host, (_, nodes) in zip(hosts, entries):
        for row, (op, where, results) in zip(np.asarray(host).reshape(-1, checks.FLAG_SIZE), nodes):
            error = checks.error(row)
            if error is None:
                continue
            counts["failed"] += 1
            message = _message(error, op, where)
            _lose(results, message)
            if first is None:
                first = type(error)(message)
    if first is not None:
        try:
            raise first
        finally:  # no cycle through this frame: the traceback's frames (holding the lost tensors) die with it
            first = None


def _message(error: Exception, op: str, where) -> str:
    return (f"{error}\n[torch_tpu] a value check of {op} failed; the op was launched at:\n"
            f"  {recompiles.traceback_line(where)}\n"
            "(checked at the next materialization point, as CUDA reports a device-side assertion; "
            "TORCH_TPU_LAUNCH_BLOCKING=1 raises at the op itself)")


def _lose(results: list, message: str) -> None:
    """Mark the storages holding a failed op's results lost: reading them raises."""
    arrays = {id(a): a for a in (r() for r in results) if a is not None}
    if not arrays:
        return
    global any_lost
    lost = Lost(f"this tensor holds the result of an op that failed a value check:\n{message}")
    with _lost_lock:  # set before the buffers hold it: overwriting an older marker runs its callback here
        _lost_markers.add(weakref.ref(lost, _marker_freed))
        any_lost = True
        _native.set_any_lost(True)
    buffers = storage.buffers
    for address, (value, dtype) in list(buffers.items()):
        if arrays.get(id(value)) is value:
            # The Lost in the dtype field too: the native cache-hit path takes only torch dtypes there, so a
            # program reading the storage goes to the Python path, which raises (raise_if_lost).
            buffers[address] = (lost, lost)


# Whether a storage marked lost here may still be alive: the executor checks its inputs only then, and
# the native DeferAndFuse recorder hands every op to Python while it is set. It clears itself: each
# marker (one Lost per failed op, shared by its storages' buffer entries) is watched by a weakref whose
# callback runs when the last entry holding it is dropped (the storage freed, or its buffer overwritten),
# so nothing polls on the hot path.
any_lost = False
_lost_markers: set = set()  # weakrefs to the live markers
_lost_lock = threading.RLock()  # a callback can run inside _lose (an overwritten marker), on this thread


def _marker_freed(ref) -> None:
    global any_lost
    with _lost_lock:
        _lost_markers.discard(ref)
        any_lost = bool(_lost_markers)
        _native.set_any_lost(any_lost)


def raise_if_lost(slot_entries) -> None:
    """Raise the message of the first lost storage among an op's inputs."""
    for entry in slot_entries:
        if entry is not None and type(entry[0]) is Lost:
            raise RuntimeError(entry[0].message)
