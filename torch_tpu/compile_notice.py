"""A one-line notice when a compile takes long, saying what is compiling.

Every program compiles through `eager/program.py::compile_function`, inside
`watch(fn)`: if the compile is still running after
`TORCH_TPU_COMPILE_NOTICE_SECONDS` (default 10; 0 turns notices off), one line
goes to stderr naming the op or fused graph and the user line that asked for
it (said by one watcher thread). A compile that ends past the threshold before
the watcher could speak gets the line when it ends, so a long compile always
gets exactly one notice.
The torch.compile backend can wrap its own compiles in `watch("graph name")`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from torch_tpu import recompiles
from torch_tpu.config import config

notices = 0  # how many notices this process printed


def describe(fn) -> str:
    """What a traced function compiles, in words."""
    if isinstance(fn, str):
        return fn
    names = getattr(fn, "names", None)
    if names:  # a DeferAndFuse segment (eager/defer.py)
        distinct = list(dict.fromkeys(names))
        shown = ", ".join(distinct[:3]) + (", ..." if len(distinct) > 3 else "")
        return f"a fused graph of {len(names)} ops ({shown})"
    op = getattr(fn, "op_name", None)
    if op:
        return op
    return getattr(fn, "__qualname__", None) or repr(fn)


@contextlib.contextmanager
def watch(fn):
    """Run a compile; print one notice if it takes longer than the threshold."""
    threshold = config.compile_notice_seconds
    if not threshold:
        yield
        return
    where = recompiles.user_frame(sys._getframe(2))
    wheres = getattr(fn, "wheres", None)
    if wheres:  # a fused graph: the line of its first recorded op
        first = next((w for w in wheres if w is not None), None)
        where = None if first is None else (first[0].co_filename, first[1], first[0].co_name)
    state = {"done": False, "said": False}
    lock = threading.Lock()
    start = time.perf_counter()

    def say(finished: bool):
        global notices
        with lock:
            if state["said"] or (state["done"] and not finished):
                return
            state["said"] = True
        seconds = time.perf_counter() - start
        at = f" (from {os.path.basename(where[0])}:{where[1]})" if where else ""
        verb = f"compiled in {seconds:.1f} s" if finished else f"compiling for {seconds:.1f} s so far"
        print(f"[torch_tpu] {describe(fn)}{at}: {verb} (over TORCH_TPU_COMPILE_NOTICE_SECONDS={threshold:g}; "
              f"the compile cache keeps it for next time)", file=sys.stderr, flush=True)
        notices += 1

    token = object()
    _watch(token, start + threshold, say)
    try:
        yield
    finally:
        with _cond:
            _active.pop(token, None)
        with lock:
            state["done"] = True
        if time.perf_counter() - start >= threshold:
            say(True)


# One watcher thread for every compile (a timer thread per compile would cost ~0.1-0.4 ms each).
_active: dict = {}  # token -> (deadline, say)
_cond = threading.Condition()
_thread: threading.Thread | None = None


def _watch(token, deadline: float, say) -> None:
    global _thread
    with _cond:
        _active[token] = (deadline, say)
        if _thread is None or not _thread.is_alive():  # first use, or a forked child
            _thread = threading.Thread(target=_watcher, name="torch_tpu-compile-notice", daemon=True)
            _thread.start()
        _cond.notify()


def _watcher() -> None:
    while True:
        with _cond:
            if not _active:
                _cond.wait()
                continue
            token, (deadline, say) = min(_active.items(), key=lambda item: item[1][0])
            wait = deadline - time.perf_counter()
            if wait > 0:
                _cond.wait(wait)
                continue
            del _active[token]
        say(False)
