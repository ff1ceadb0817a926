"""Streams and events on tpu, and the runtime answers the native device guard asks Python for.

What a stream means on XLA: PJRT runs the programs of one device in the order they are launched
(one queue per device), and every buffer carries its own ready event. A second stream
(`torch.Stream(device="tpu")`, `torch.tpu.Stream()`) is a real, distinct stream object (its own id,
current per thread, usable with `with stream:` and `torch.accelerator.set_stream`), but its work
joins the same per-device order: the order of launches is kept, and a second stream adds no
concurrency. So `wait_stream`/`wait_event` need no device work, and a stream has finished when its
device has.

A timing event (`enable_timing=True`) marks the device buffers that exist when it is recorded (every
storage's latest value on that device: the results of all work launched so far) and is stamped (host
monotonic clock) when they are ready: at once if they already are, else by one watcher thread that
waits for them, so `elapsed_time` measures from the completion of the work before the first event to
the completion of the work before the second, without blocking `record()`. Recording one is a
materialization point in DeferAndFuse (the recorded ops are launched, so there is work to mark).
An event without timing records in O(1) and flushes nothing (stream syncs must not cut fused
graphs); its `query()`/`synchronize()` cover all work launched on the device up to that call: never
done too early, at most later than the recorded point alone would be.

The native guard (csrc/native.cpp) calls the functions below, under the GIL, for
`torch.accelerator.synchronize`, `torch.Stream.query/synchronize`, `torch.Event.*`,
`torch.accelerator.empty_cache` and `torch.accelerator.get_memory_info`.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time

import torch

__all__ = ["Stream", "Event", "current_stream", "default_stream", "set_stream", "stream", "StreamContext"]


# ------------------------------------------------------------------ device work
def _device_arrays(index: int, reason: str) -> list:
    """The device buffers of every storage on tpu:`index`, after pending (deferred) work is launched."""
    from torch_tpu.runtime import platform, storage

    storage.materialize(reason)
    storage.drain()
    arrays = [value for value, _ in list(storage.buffers.values()) if hasattr(value, "block_until_ready")]
    devices = platform.get().devices
    if len(devices) == 1:
        return arrays
    target = devices[index]
    return [a for a in arrays if target in a.devices()]


def _ready(arrays) -> bool:
    try:
        return all(a.is_ready() for a in arrays)
    except RuntimeError:  # a deleted (donated) buffer: its program has run
        return True


def _wait(arrays) -> None:
    for a in arrays:
        try:
            a.block_until_ready()
        except RuntimeError:  # deleted: consumed by a program that has run; errors surface on read
            pass


def synchronize(index: int) -> None:
    """Wait until all work launched on tpu:`index` has finished."""
    _wait(_device_arrays(index, "synchronize"))


def query_device(index: int) -> bool:
    return _ready(_device_arrays(index, "synchronize"))


def empty_cache() -> None:
    """Release the device buffers of storages PyTorch has freed (no cache of our own to empty)."""
    from torch_tpu.runtime import storage

    storage.drain()


def memory_info(index: int) -> tuple[int, int]:
    """(free, total) bytes of tpu:`index`: PJRT's numbers where reported, else host memory (XLA:CPU)."""
    from torch_tpu import _native
    from torch_tpu.runtime import platform

    device = platform.get().devices[index]
    try:
        stats = device.memory_stats() or {}
    except Exception:
        stats = {}
    if "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return max(total - int(stats.get("bytes_in_use", 0)), 0), total
    # XLA:CPU: devices share host memory; free is what the OS reports available.
    total = platform._memory_limit(device)
    free = _host_available()
    if free is None:
        free = total - _native.memory_stats(index)["allocated_bytes.all.current"]
    return max(min(free, total), 0), total


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return None


def supported_dtypes(index: int) -> list:
    """The dtypes tpu tensors of this platform can hold (torch.accelerator.get_device_capability)."""
    from torch_tpu.runtime import dtypes, platform

    name = platform.get().platform
    out = []
    for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
        try:
            dtypes.check_supported(dtype, name)
        except (TypeError, KeyError, ValueError):
            continue
        out.append(dtype)
    return out


# ------------------------------------------------------------------ events (called by the native guard)
class _Mark:
    __slots__ = ("arrays", "device", "timing", "stamp_ns", "stamped")

    def __init__(self, arrays, device, timing):
        self.arrays = arrays  # None: marked lazily (an event without timing)
        self.device = device
        self.timing = timing
        self.stamp_ns = None
        self.stamped = threading.Event() if timing else None


_marks: dict[int, _Mark] = {}
_watch_queue: "queue.SimpleQueue[_Mark]" = queue.SimpleQueue()
_watcher: threading.Thread | None = None
_watcher_lock = threading.Lock()
_stamp_lock = threading.Lock()


def _watch() -> None:
    while True:
        mark = _watch_queue.get()
        _wait(mark.arrays)
        _stamp(mark)


def _stamp(mark: _Mark) -> None:
    """Stamp once: by the recording thread, the watcher, or a query that finds the work done first."""
    with _stamp_lock:
        if mark.stamped.is_set():
            return
        mark.stamp_ns = time.perf_counter_ns()
        mark.arrays = ()  # done: hold no device memory
        mark.stamped.set()


def event_record(event_id: int, index: int, timing: bool) -> None:
    global _watcher
    if not timing:
        # Recorded in O(1), with no flush of DeferAndFuse's graph (events sync streams every layer in
        # FSDP-style code): query/synchronize then cover all work launched on the device up to that
        # call. Never done too early; at most later than the recorded point alone would be.
        _marks[event_id] = _Mark(None, index, False)
        return
    mark = _Mark(_device_arrays(index, "event"), index, True)
    _marks[event_id] = mark
    if _ready(mark.arrays):
        _stamp(mark)
        return
    with _watcher_lock:
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="torch_tpu-event-watcher", daemon=True)
            _watcher.start()
    _watch_queue.put(mark)


def event_query(event_id: int) -> bool:
    mark = _marks.get(event_id)
    if mark is None:
        return True
    if mark.timing:
        if not mark.stamped.is_set() and _ready(mark.arrays):
            _stamp(mark)
        return mark.stamped.is_set()
    if mark.arrays == () or query_device(mark.device):
        mark.arrays = ()
        return True
    return False


def event_synchronize(event_id: int) -> None:
    mark = _marks.get(event_id)
    if mark is None:
        return
    if mark.timing:
        mark.stamped.wait()
    elif mark.arrays != ():
        synchronize(mark.device)
        mark.arrays = ()


def event_elapsed(start_id: int, end_id: int) -> float:
    start, end = _marks.get(start_id), _marks.get(end_id)
    if start is None or end is None:
        raise RuntimeError("Both events must be recorded before calculating elapsed time.")
    if not (start.timing and end.timing):
        raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
    start.stamped.wait()
    end.stamped.wait()
    return (end.stamp_ns - start.stamp_ns) / 1e6


def event_destroy(event_id: int) -> None:
    _marks.pop(event_id, None)


# ------------------------------------------------------------------ torch.tpu.Stream / Event
def _index(device) -> int:
    # torch.tpu's own device-argument check (device.py, which imports this module and is always
    # loaded with torch_tpu): looked up, not imported.
    return sys.modules["torch_tpu.device"]._index(device)


class Stream(torch.Stream):
    """A tpu stream: `torch.Stream` on device "tpu" (see the module docstring for what it orders)."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if kwargs:  # stream_id=, device_index=, device_type=: wrap an existing stream
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("tpu", _index(device)), priority=priority)

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        """Later work on this stream runs after the work now on `stream` (always so on one device)."""
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event


class _EventType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.Event) and obj.device.type == "tpu"


class Event(metaclass=_EventType):
    """A tpu event: makes a `torch.Event` on device "tpu" (and `isinstance(e, torch.tpu.Event)` holds for them).

    Not a subclass: torch.Event.elapsed_time accepts only torch.Event itself.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return torch.Event(device="tpu", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device=None) -> Stream:
    """This thread's current stream on the tpu device (default: the current device)."""
    return _wrap(torch.accelerator.current_stream(_index(device)))


def default_stream(device=None) -> Stream:
    """The default stream (id 0) of the tpu device."""
    s = torch.accelerator.current_stream(_index(device))
    return Stream(stream_id=0, device_index=s.device_index, device_type=s.device_type)


def set_stream(stream: torch.Stream) -> None:
    """Make `stream` the current stream of its device (and its device the current device)."""
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """`with torch.tpu.stream(s):` makes `s` current inside the block (None: no change)."""

    def __init__(self, stream: torch.Stream | None):
        self.stream = stream
        self.previous: list = []

    def __enter__(self):
        if self.stream is not None:
            self.previous.append((torch.accelerator.current_device_index(), torch.accelerator.current_stream(
                self.stream.device_index)))
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            device, stream = self.previous.pop()
            torch.accelerator.set_stream(stream)
            torch.accelerator.set_device_index(device)
        return False


def stream(stream: torch.Stream | None) -> StreamContext:
    return StreamContext(stream)
