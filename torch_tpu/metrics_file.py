"""The metrics of a finished run, written as JSON when the process exits.

With `TORCH_TPU_METRICS_FILE=PATH` the runtime writes `metrics.snapshot()`
plus the top recompiling sites to PATH at exit (atexit); `torch-tpu report
PATH` renders it. `{pid}` in PATH is replaced by the process id, so every
rank of a multi-process run writes its own file.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time

FORMAT = 1
_registered = False


def data() -> dict:
    """What the file holds: format, when, the command, counters, sections, recompiling sites."""
    from torch_tpu import metrics, recompiles

    out = {"format": FORMAT, "written": time.time(), "argv": list(sys.argv), "pid": os.getpid()}
    out.update(metrics.snapshot())
    out["recompiles"] = recompiles.summary(20)
    return out


def write(path: str) -> str:
    """Write the metrics now (atomically: a temporary file renamed into place); return the path."""
    path = path.replace("{pid}", str(os.getpid()))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(data(), f, indent=1, default=str)
    os.replace(temporary, path)
    return path


def _at_exit(path: str) -> None:
    try:
        write(path)
    except Exception as err:  # exit must not fail because of metrics
        print(f"torch_tpu: could not write TORCH_TPU_METRICS_FILE={path}: {err}", file=sys.stderr)


def register(path: str | None) -> None:
    """Write the metrics to `path` at exit (once per process)."""
    global _registered
    if path and not _registered:
        _registered = True
        atexit.register(_at_exit, path)
