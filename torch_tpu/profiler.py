"""torch.profiler on tpu: device rows for programs, copies and compiles; and XLA's own trace.

`torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])` starts a
session of our Kineto activity profiler (csrc/profiler.cpp, registered through PyTorch's PrivateUse1
profiler registry). While it runs, `active` is true and the executors report here:

- each executed program (Strict: the ATen op's name, e.g. ``aten::addmm``; DeferAndFuse: a fused
  segment, ``fused[N ops] aten::first..aten::last``), as a kernel row on the device, lasting from its launch until
  its results are ready: programs run one at a time while a device trace runs (like
  CUDA_LAUNCH_BLOCKING), so a row's length is that program's own time;
- host<->device and device<->device copies (``Memcpy HtoD`` / ``DtoH`` / ``DtoD``), as memcpy rows;
- each compile-cache lookup that built an executable: ``XLA compile: <name>`` when XLA compiled it,
  ``compile cache hit: <name>`` when the compile cache had it.

The trace exports with `export_chrome_trace` (Chrome/Perfetto JSON) and
`torch.profiler.tensorboard_trace_handler`. With no session running, the executors pay one
attribute check per launch on their Python path (the native cache-hit path is untouched; a session
turns it off while it runs, so every op is seen).

`trace(dir)` runs such a session together with `jax.profiler.trace(dir)` (XLA's device trace, for
TensorBoard's profile plugin / Perfetto) and writes the PyTorch trace to ``dir/torch_trace.json``.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time

from torch_tpu import _native

__all__ = ["trace", "active", "is_active"]

active = False  # a device trace is running (read by the executors before each launch)
_saved_fast_path = True
_clock = time.time_ns  # Kineto's trace clock: Unix time in ns (c10::getTime)


def is_active() -> bool:
    """Whether a torch.profiler session with tpu device activity is recording."""
    return active


session_hooks: list = []  # fn(start: bool), called at each session start and stop (TpuProfilerConfig's XLA trace)


def _on_session(start: bool) -> None:
    global active, _saved_fast_path
    if start:
        _saved_fast_path = _native.fast_path_enabled()
        _native.set_fast_path(False)  # every op through the Python path, where launches are reported
        active = True
    else:
        active = False
        _native.set_fast_path(_saved_fast_path)
    for hook in session_hooks:
        hook(start)


def install() -> None:
    """Receive Kineto session starts and stops (called once at registration)."""
    _native.set_profiler_session_callback(_on_session)


@functools.lru_cache(maxsize=None)
def op_name(name: str) -> str:
    """"aten.addmm.default" -> "aten::addmm", "aten.add.Tensor" -> "aten::add.Tensor" (the profiler's op names)."""
    namespace, _, rest = name.partition(".")
    return f"{namespace}::{rest[:-len('.default')] if rest.endswith('.default') else rest}"


def run_program(name: str, device: int, executable, *args):
    """Launch `executable(*args)` and report it as a program row lasting until its results are ready."""
    import jax

    start = _clock()
    out = executable(*args)
    jax.block_until_ready(out)
    _native.profiler_record(op_name(name), start, _clock(), device, 0)
    return out


def segment_name(nodes, indices) -> str:
    """A fused segment's row name: its op count and first and last ops."""
    first, last = op_name(nodes[indices[0]].prog.spec.name), op_name(nodes[indices[-1]].prog.spec.name)
    return f"fused[{len(indices)} ops] {first}..{last}"


def copy(name: str, device: int, start_ns: int, nbytes: int) -> None:
    """Report a copy that started at `start_ns` and has just finished."""
    _native.profiler_record(f"{name} ({nbytes} bytes)", start_ns, _clock(), device, 1)


@contextlib.contextmanager
def compiling(name: str, device: int):
    """Report the executable lookup/compile inside the block (compile vs cache hit by XLA compile count)."""
    from torch_tpu import metrics

    compiled = metrics.counts.programs_compiled
    start = _clock()
    try:
        yield
    finally:
        kind = "XLA compile" if metrics.counts.programs_compiled > compiled else "compile cache hit"
        _native.profiler_record(f"{kind}: {op_name(name) if name.startswith('aten.') else name}", start, _clock(),
                                device, 2)


@contextlib.contextmanager
def trace(log_dir: str, *, record_shapes: bool = False, with_stack: bool = False, profile_memory: bool = False):
    """Profile the block with torch.profiler (CPU + tpu device rows) and jax.profiler into `log_dir`.

    Yields the `torch.profiler.profile` object (for `key_averages()`); on exit the PyTorch trace is
    written to ``log_dir/torch_trace.json`` and XLA's to ``log_dir/plugins/profile/<run>/``.
    """
    import jax
    import torch

    os.makedirs(log_dir, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.PrivateUse1]
    with jax.profiler.trace(log_dir):
        with torch.profiler.profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack,
                                    profile_memory=profile_memory) as prof:
            yield prof
    prof.export_chrome_trace(os.path.join(log_dir, "torch_trace.json"))
