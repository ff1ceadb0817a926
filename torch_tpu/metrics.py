"""Counters for everything the backend does, and a readable report.

Counters are plain integer attributes (an increment is one attribute store on
the hot path), plus per-name counters (CPU fallbacks and decompositions by op,
DeferAndFuse flushes by reason). `report()` renders them; `counters()` returns
a dict; `reset()` zeroes them. Other subsystems (compile cache, precision) add report sections
with `add_section`.
"""
from __future__ import annotations

import collections
from typing import Callable

from torch_tpu import _native


class _Counters:
    __slots__ = (
        "_ops_executed", "programs_compiled", "compile_seconds", "_cache_hits", "cache_misses",
        "h2d_transfers", "h2d_bytes", "d2h_transfers", "d2h_bytes", "d2d_transfers", "d2d_bytes",
        "decompositions", "materializations", "synchronous_waits",
        # DeferAndFuse: ops recorded, graphs run (one per materialization point with pending work),
        # fused programs run (a graph cut by the repeats heuristic runs several), graph plans reused / new.
        "_ops_deferred", "ops_recorded_python", "flushes", "fused_executions", "fused_cache_hits", "fused_cache_misses",
        # DeferAndFuse: buffers fused programs returned (live values only), inputs donated to them.
        "fused_outputs", "fused_donations",
        # DeferAndFuse: units run inside looped programs (one launch runs a whole run of equal units).
        "fused_loop_units",
        # Pallas kernels traced in interpret mode (platforms with no Pallas compiler, docs/kernels.md).
        "pallas_interpret",
    )

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, 0)
        _native.reset_fast_op_count()
        _native.reset_native_record_count()

    # Ops launched by the native cache-hit path are counted natively; both
    # counters add them (every such op is an executed op and a cache hit).
    @property
    def ops_executed(self) -> int:
        return self._ops_executed + _native.fast_op_count()

    @ops_executed.setter
    def ops_executed(self, value: int) -> None:
        self._ops_executed = value - _native.fast_op_count()

    @property
    def cache_hits(self) -> int:
        return self._cache_hits + _native.fast_op_count() + _native.native_record_count()

    @cache_hits.setter
    def cache_hits(self, value: int) -> None:
        self._cache_hits = value - _native.fast_op_count() - _native.native_record_count()

    # DeferAndFuse: ops the native recorder appended are counted natively (each is a program cache hit);
    # `ops_recorded_python` counts those the Python recorder took.
    @property
    def ops_deferred(self) -> int:
        return self._ops_deferred + _native.native_record_count()

    @ops_deferred.setter
    def ops_deferred(self, value: int) -> None:
        self._ops_deferred = value - _native.native_record_count()

    def names(self) -> list[str]:
        return [name.lstrip("_") for name in self.__slots__]


counts = _Counters()
fallbacks: collections.Counter = collections.Counter()  # CPU fallbacks by op name
decomposed: collections.Counter = collections.Counter()  # decompositions by op name
flush_reasons: collections.Counter = collections.Counter()  # DeferAndFuse flushes by materialization point
_sections: dict[str, Callable[[], dict]] = {}


def record_compile(seconds: float) -> None:
    counts.programs_compiled += 1
    counts.compile_seconds += seconds


def add_section(name: str, provider: Callable[[], dict]) -> None:
    """Add a section (name -> {label: value}) to the report, e.g. the compile cache's."""
    _sections[name] = provider


def counters() -> dict:
    """All counters as a flat dict (fallbacks as 'fallback::<op>')."""
    out = {name: getattr(counts, name) for name in counts.names()}
    out.update({f"fallback::{op}": n for op, n in fallbacks.items()})
    out.update({f"decomposed::{op}": n for op, n in decomposed.items()})
    out.update({f"flush::{reason}": n for reason, n in flush_reasons.items()})
    return out


def snapshot() -> dict:
    """Counters and every section's rows as plain data (what TORCH_TPU_METRICS_FILE holds)."""
    sections = {}
    for name, provider in _sections.items():
        try:
            sections[name] = {str(label): value for label, value in provider().items()}
        except Exception as err:  # a section must not break the others (e.g. at interpreter exit)
            sections[name] = {"error": f"{type(err).__name__}: {err}"}
    return {"counters": counters(), "sections": sections}


def reset() -> None:
    """Zero every counter."""
    counts.__init__()
    fallbacks.clear()
    decomposed.clear()
    flush_reasons.clear()


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def report() -> str:
    """A human-readable report of all counters."""
    c = counts
    lines = ["torch_tpu metrics", "-----------------"]
    rows = [
        ("ops executed", f"{c.ops_executed}"),
        ("programs compiled", f"{c.programs_compiled} ({c.compile_seconds:.2f} s compiling)"),
        ("program cache hits / misses", f"{c.cache_hits} / {c.cache_misses}"),
        ("host->device transfers", f"{c.h2d_transfers} ({_bytes(c.h2d_bytes)})"),
        ("device->host transfers", f"{c.d2h_transfers} ({_bytes(c.d2h_bytes)})"),
        ("device->device transfers", f"{c.d2d_transfers} ({_bytes(c.d2d_bytes)})"),
        ("materializations", f"{c.materializations}"),
        ("deferred ops / flushes", f"{c.ops_deferred} / {c.flushes}"),
        ("fused programs run", f"{c.fused_executions} (graph plans reused {c.fused_cache_hits}, "
                               f"new {c.fused_cache_misses}; {c.fused_outputs} outputs, "
                               f"{c.fused_donations} donated inputs; {c.fused_loop_units} units run in loops)"),
        ("decompositions", f"{c.decompositions}"),
        ("Pallas kernels interpreted", f"{c.pallas_interpret}"),
        ("CPU fallbacks", f"{sum(fallbacks.values())}"),
    ]
    for section, provider in _sections.items():
        for label, value in provider().items():
            rows.append((f"{section}: {label}", f"{value}"))
    width = max(len(label) for label, _ in rows)
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    for op, n in sorted(fallbacks.items(), key=lambda kv: -kv[1]):
        lines.append(f"  fallback {op}: {n}")
    for reason, n in sorted(flush_reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"  flushes at {reason}: {n}")
    return "\n".join(lines)
