"""`spmd_safe`: a region whose collectives every rank promises to issue identically.

The first time a region runs (per call site), the ranks exchange a fingerprint of
each collective it issues on the default group (name, shapes, dtypes, options)
through the c10d store before the collective launches, and one more at the
region's end (so a rank that issues fewer collectives is caught too). A mismatch
raises `SpmdMismatchError` naming the ranks that differ from rank 0 and the first
differing operation; a rank that never arrives raises a timeout naming it. Later
runs of the region skip the handshake (like the modelled system's handshake before
a program's first use).

Under DeferAndFuse, a region's all_reduce on the default group is recorded with the
surrounding work instead of launched (`fuses`; process_group.py, compiled.py): its
segment becomes one SPMD program. Other collectives stay skinny (docs/distributed.md).

Owns: regions, fingerprints, the store handshake. Does not own: collectives.
"""
from __future__ import annotations

import functools
import hashlib
import sys
import types
import time
import warnings

# Process-wide, not per thread: a region covers the collectives its code issues, including those
# DDP's reducer issues from autograd's device threads during backward.
_local = types.SimpleNamespace(region=None)
_seen: dict[str, int] = {}  # call site -> times entered (handshake on the first)


class SpmdMismatchError(RuntimeError):
    """Ranks issued different collectives inside an spmd_safe region."""


class _Region:
    def __init__(self, site: str):
        self.site = site
        self.checking = False
        self.index = 0
        self.tag = hashlib.sha1(site.encode()).hexdigest()[:16]


class spmd_safe:
    """Decorator or context manager marking code that issues the same collectives on every rank.

    A region is known by its function (decorator) or its `with` line, or by `name=`.
    """

    def __init__(self, fn=None, *, name: str | None = None):
        self._fn, self._name = fn, name
        if fn is not None:
            functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self._fn is None:  # @spmd_safe() with parentheses
            return spmd_safe(args[0])
        with _enter(self._name or f"{self._fn.__module__}.{self._fn.__qualname__}"):
            return self._fn(*args, **kwargs)

    def __enter__(self):
        frame = sys._getframe(1)
        self._ctx = _enter(self._name or f"{frame.f_code.co_filename}:{frame.f_lineno}")
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class _enter:
    def __init__(self, site: str):
        self.site = site

    def __enter__(self):
        region = _Region(self.site)
        count = _seen.get(self.site, 0)
        _seen[self.site] = count + 1
        region.checking = count == 0
        self.outer = getattr(_local, "region", None)
        _local.region = region if self.outer is None else self.outer  # nested: the outer one decides
        self.region = _local.region
        return self

    def __exit__(self, exc_type, exc, tb):
        _local.region = self.outer
        if self.outer is None and exc_type is None and self.region.checking:
            group = _default_group()
            if group is not None:
                _handshake(group, self.region, "end of region")
        return False


def _default_group():
    import torch.distributed as dist

    # Looked up, not imported (process_group imports this module): no tpu_dist group exists before
    # process_group.py was imported.
    process_group = sys.modules.get("torch_tpu.distributed.process_group")
    if process_group is None or not dist.is_initialized():
        return None
    group = dist.group.WORLD
    return group if isinstance(group, process_group.ProcessGroupTPU) else None


_warned_subgroup = False


def fuses(group) -> bool:
    """Whether a collective on `group` is recorded into the pending DeferAndFuse graph instead of launched.

    Inside an spmd_safe region under DeferAndFuse, on the default group: every rank promised to
    issue it identically, so it may fuse with the work around it into one SPMD program.
    """
    from torch_tpu.config import config

    return config.defer_and_fuse and getattr(_local, "region", None) is not None and group is _default_group()


def before_collective(group, name: str, blocks, params) -> None:
    """Called by every tpu_dist collective before it launches (cheap outside a checking region)."""
    region = getattr(_local, "region", None)
    if region is None or not region.checking:
        return
    description = describe(name, blocks, params)
    world = _default_group()
    if group is not world:
        global _warned_subgroup
        if not _warned_subgroup:
            _warned_subgroup = True
            warnings.warn("spmd_safe: collectives on sub-groups are not part of the handshake", stacklevel=3)
        return
    _handshake(group, region, description)


def _handshake(group, region: _Region, description: str) -> None:
    store, rank, size = group._store, group._rank, group._size
    prefix = f"tpu_dist/spmd/{region.tag}/{region.index}/"
    region.index += 1
    store.set(prefix + str(rank), description)
    seconds = group._timeout.total_seconds()
    deadline = time.monotonic() + seconds
    keys = [prefix + str(r) for r in range(size)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if not store.check([prefix + str(r)])]
            raise SpmdMismatchError(
                f"spmd_safe region {region.site}: ranks {missing} did not reach operation #{region.index - 1} "
                f"({description}) within {seconds:.0f} s"
            )
        time.sleep(0.002)
    found = {r: store.get(prefix + str(r)).decode() for r in range(size)}
    differ = [r for r in range(size) if found[r] != found[0]]
    if differ:
        raise SpmdMismatchError(
            f"spmd_safe region {region.site}: ranks {differ} differ from rank 0 at operation "
            f"#{region.index - 1}: rank 0 runs {found[0]}; "
            + "; ".join(f"rank {r} runs {found[r]}" for r in differ)
        )


def describe(name: str, blocks, params) -> str:
    shapes = ",".join(f"{b.dtype}[{b.shape[0]}]" for b in blocks)
    return f"{name}({shapes}{', ' if params else ''}{', '.join(map(str, params))})"
