"""Execution modes: which executor runs the ops dispatched to "tpu".

- "strict" (default): every op is one cached program, launched asynchronously.
- "debug" (TORCH_TPU_LAUNCH_BLOCKING=1): strict, but every op waits for its
  result, so an error surfaces at the Python line of the failing op.
- "defer_and_fuse" (TORCH_TPU_DEFER_AND_FUSE=1): ops are recorded and run as
  fused programs at materialization points (eager/defer.py, docs/defer.md).

Debug wins over DeferAndFuse when both variables are set: it is the mode for
finding the op that fails. The mode is process-wide (not per thread): the
autograd engine runs backward ops on its own threads, and they must record
into the same graph as the forward. Leaving defer_and_fuse flushes.

Owns: the setter, the getter, the context managers and DeferAndFuse's
options. Does not own: the executors (eager/). Importing this module does
not start JAX.
"""
from __future__ import annotations

import contextlib
import sys

from torch_tpu.config import config

MODES = ("strict", "debug", "defer_and_fuse")


def get_execution_mode() -> str:
    """The mode ops run in now: "strict", "debug" or "defer_and_fuse"."""
    if config.launch_blocking:
        return "debug"
    return "defer_and_fuse" if config.defer_and_fuse else "strict"


def set_execution_mode(mode: str) -> None:
    """Switch every thread to `mode` ("strict", "debug" or "defer_and_fuse"); leaving defer_and_fuse flushes."""
    if mode not in MODES:
        raise ValueError(f"unknown execution mode {mode!r}: expected one of {', '.join(MODES)}")
    defer = sys.modules.get("torch_tpu.eager.defer")
    if defer is None:  # nothing can be pending before the recorder was ever imported
        _set(mode)
        return
    with defer.lock:
        if mode != "defer_and_fuse":
            defer.flush("mode change")
        _set(mode)


def _set(mode: str) -> None:
    config.launch_blocking = mode == "debug"
    config.defer_and_fuse = mode == "defer_and_fuse"
    executor = sys.modules.get("torch_tpu.eager.executor")
    if executor is not None:  # the native cache-hit path runs in Strict only
        executor.update_fast_path()


@contextlib.contextmanager
def execution_mode(mode: str):
    """Run the block in `mode`, then return to the previous mode (flushing if defer_and_fuse ends)."""
    previous = get_execution_mode()
    set_execution_mode(mode)
    try:
        yield
    finally:
        set_execution_mode(previous)


# DeferAndFuse options: Python name -> config field (environment variable in docs/defer.md).
_OPTIONS = {
    "max_ops": "defer_max_ops",  # TORCH_TPU_DEFER_MAX_OPS: size cap of a recorded graph
    "repeats": "defer_repeats",  # TORCH_TPU_DEFER_REPEATS: the repeated-operations heuristic on/off
    "min_period": "defer_min_period",  # TORCH_TPU_DEFER_MIN_PERIOD: shortest unit the heuristic cuts out
    "max_period": "defer_max_period",  # TORCH_TPU_DEFER_MAX_PERIOD: longest period it looks for
    "loops": "defer_loops",  # TORCH_TPU_DEFER_LOOPS: equal chained units run as one looped program
}


def set_defer_options(**options) -> dict:
    """Set DeferAndFuse options (max_ops, repeats, min_period, max_period, loops); return the previous values."""
    previous = {}
    for name, value in options.items():
        if name not in _OPTIONS:
            raise TypeError(f"unknown DeferAndFuse option {name!r}: expected one of {', '.join(_OPTIONS)}")
        if name in ("repeats", "loops"):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in options.items():
        previous[name] = getattr(config, _OPTIONS[name])
        setattr(config, _OPTIONS[name], value)
    return previous


@contextlib.contextmanager
def defer_and_fuse(**options):
    """`with torch_tpu.defer_and_fuse():` records the block's ops and flushes them when it ends.

    Keyword options (max_ops, repeats, min_period, max_period, loops) apply inside the block only.
    """
    previous_options = set_defer_options(**options)
    try:
        with execution_mode("defer_and_fuse"):
            yield
    finally:
        set_defer_options(**previous_options)
