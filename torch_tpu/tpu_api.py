"""TorchTPU's names on `torch.tpu`, as thin faces over ours (docs/compat.md).

Code written for TorchTPU 0.2 (its docs, notebooks, vLLM plugin) runs
unchanged: `torch.tpu.EagerMode`, `torch.tpu.eager_mode`, `set_eager_mode`,
`Precision`, `precision`, `allow_excess_precision`, `device_of`,
`topology_aware_mesh`, the `_get_cache_stats` family and the
submodules `torch.tpu.compiler`, `.distributed`, `.profiler`, `.ops`,
`.optimizers` (and `.pallas` where the kernels package provides it). Each name calls our implementation:
modes.py, precision.py, xla_options.py, cache/, topology.py, device.py.

Owns: the name mapping, the module class that gives `torch.tpu` its two
settable properties, and the import hook for `import torch.tpu.<sub>`. Does
not own any behaviour. Importing this module does not start JAX.
"""
from __future__ import annotations

import datetime
import enum
import importlib
import importlib.abc
import importlib.util
import os
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass

import torch

from torch_tpu import modes, xla_options
from torch_tpu import precision as _precision

__all__ = [
    "EagerMode", "set_eager_mode", "Precision", "precision", "device_of", "topology_aware_mesh",
]
_PROPERTIES = ("eager_mode", "allow_excess_precision")

# torch.tpu.<name> -> the module it is (imported on first use).
_SUBMODULES = {
    "compiler": "torch_tpu._internal.compiler_options",
    "distributed": "torch_tpu.distributed",  # spmd_safe; topology_aware_mesh, set_tpu_launch_env (topology.py)
    "profiler": "torch_tpu._internal.profiler",
    "pallas": "torch_tpu.pallas",  # the kernels package (issue 19), where present
    "ops": "torch_tpu._internal.ops",  # TorchTPU's operators (ops/tpu_ops.py)
    "optimizers": "torch_tpu._internal.optimizers",
}


def forbid_in_compile(name: str) -> None:
    """Raise if called while torch.compile traces: these settings are not traceable."""
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{name} cannot be used inside torch.compile: set it outside the compiled function")


# ------------------------------------------------------------------ execution mode
class EagerMode(enum.Enum):
    """TorchTPU's execution modes; each value is our mode's name (torch_tpu.set_execution_mode)."""

    DEFER_NEVER = "strict"  # Strict eager, the default: one async program per op
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"  # Debug eager: every op waits for its result
    DEFER_AND_FUSE = "defer_and_fuse"  # ops recorded and run as fused programs at materialization points


def get_eager_mode() -> EagerMode:
    return EagerMode(modes.get_execution_mode())


def _set_eager_mode_global(mode) -> None:
    if not isinstance(mode, EagerMode):
        raise ValueError(f"eager_mode must be a torch.tpu.EagerMode, got {mode!r}")
    forbid_in_compile("torch.tpu.eager_mode")
    modes.set_execution_mode(mode.value)


class set_eager_mode:
    """`with torch.tpu.set_eager_mode(mode):` runs the block in `mode`, then restores the previous one.

    Over `torch_tpu.execution_mode`: the mode applies to every thread while the
    block runs (the autograd engine's backward threads must see it).
    """

    def __init__(self, mode: EagerMode):
        if not isinstance(mode, EagerMode):
            raise ValueError(f"set_eager_mode expects a torch.tpu.EagerMode, got {mode!r}")
        self.mode = mode
        self._previous: list[str] = []

    def __enter__(self):
        forbid_in_compile("torch.tpu.set_eager_mode")
        self._previous.append(modes.get_execution_mode())
        modes.set_execution_mode(self.mode.value)
        return self

    def __exit__(self, *exc):
        modes.set_execution_mode(self._previous.pop())
        return False


# ------------------------------------------------------------------ precision
class Precision(enum.Enum):
    """TorchTPU's float32 matmul precisions; each value is our level (torch_tpu.precision.use)."""

    DEFAULT = "medium"  # one bfloat16 pass, float32 accumulation
    HIGH = "high"  # bf16x3
    HIGHEST = "highest"  # full float32


def precision(mode: Precision):
    """`with torch.tpu.precision(torch.tpu.Precision.HIGHEST):` float32 products at `mode` (this thread)."""
    if not isinstance(mode, Precision):
        raise ValueError(f"torch.tpu.precision expects a torch.tpu.Precision, got {mode!r}")
    forbid_in_compile("torch.tpu.precision")
    return _precision.use(mode.value)


# ------------------------------------------------------------------ devices and streams
def device_of(obj):
    """Context manager: the current tpu device is `obj`'s (a tensor or storage) inside the block."""
    index = obj.get_device() if obj.device.type == "tpu" else None
    return _module.device(index)


def topology_aware_mesh(*args, **kwargs):
    """Deprecated: use torch.tpu.distributed.topology_aware_mesh (same arguments)."""
    warnings.warn("torch.tpu.topology_aware_mesh is deprecated; use torch.tpu.distributed.topology_aware_mesh",
                  FutureWarning, stacklevel=2)
    from torch_tpu import topology

    return topology.topology_aware_mesh(*args, **kwargs)


# ------------------------------------------------------------------ compile cache introspection
@dataclass(frozen=True)
class CacheEntryStats:
    """One compiled executable held by this process."""

    read_count: int  # times the compile cache served it: its compile (or load) is the first
    compilation_duration: datetime.timedelta  # compiling it in this process, µs resolution; zero: it was loaded
    last_read: datetime.datetime  # when it was last served


@dataclass(frozen=True)
class CacheStats:
    num_cache_reqs: int  # program lookups by the executors (Strict ops, DeferAndFuse graph plans)
    num_cache_hits: int
    num_compilations: int  # XLA compilations in this process
    per_entry_stats: tuple

    @property
    def num_cache_misses(self) -> int:
        return self.num_cache_reqs - self.num_cache_hits


def _counts():
    from torch_tpu import metrics

    c = metrics.counts
    return c.cache_hits + c.fused_cache_hits, c.cache_misses + c.fused_cache_misses


def _get_cache_stats() -> CacheStats:
    from torch_tpu import cache

    hits, misses = _counts()
    entries = tuple(
        CacheEntryStats(count, datetime.timedelta(microseconds=round(seconds * 1e6)),
                        datetime.datetime.fromtimestamp(last))
        for _, count, seconds, last in cache.entries()
    )
    return CacheStats(hits + misses, hits, cache.stats()["compiles"], entries)


def _get_cache_requests() -> int:
    return sum(_counts())


def _get_cache_hits() -> int:
    return _counts()[0]


def _get_cache_misses() -> int:
    return _counts()[1]


def _clear_cache() -> None:
    """Forget every compiled program of this process (the host-shared and remote levels keep theirs)."""
    from torch_tpu import cache

    defer = sys.modules.get("torch_tpu.eager.defer")  # imported with the kernels, once the runtime starts
    if defer is not None:
        defer.forget()
    cache.clear(host=False)


def _set_cache_only(enabled: bool) -> None:
    """With True, a program in no cache level raises instead of compiling."""
    from torch_tpu import cache

    cache.configure(cache_only=bool(enabled))


def _default_dump_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"torch_tpu-cache-misses-{os.geteuid()}")


def _set_dump_on_cache_miss(enabled: bool, path: str | None = None) -> None:
    """With True, the StableHLO of every program compiled is written to `path` (default: a temp directory)."""
    from torch_tpu import cache

    cache.configure(dump_dir=(path or _default_dump_dir()) if enabled else None)


def _get_dump_on_cache_miss() -> bool:
    from torch_tpu import cache

    return cache.settings().dump_dir is not None


# ------------------------------------------------------------------ runtime and autocast helpers
def _lazy_init() -> None:
    """Start the runtime now (it otherwise starts on the first tpu tensor)."""
    from torch_tpu.runtime import platform

    platform.get()


def _is_autocast_enabled() -> bool:
    return torch.is_autocast_enabled("tpu")


def _get_autocast_dtype() -> torch.dtype:
    return torch.get_autocast_dtype("tpu")


def _set_autocast_dtype(dtype: torch.dtype) -> None:
    """The dtype of `torch.autocast("tpu")` without dtype= (this thread); one of get_amp_supported_dtype()'s."""
    if not isinstance(dtype, torch.dtype) or dtype not in _module.get_amp_supported_dtype():
        raise ValueError(f"unsupported autocast dtype for 'tpu': {dtype!r} (supported: "
                         f"{_module.get_amp_supported_dtype()})")
    torch.set_autocast_dtype("tpu", dtype)


# ------------------------------------------------------------------ the module class and import hook
class TpuModule(types.ModuleType):
    """`torch.tpu`'s class: two settable properties and the lazily imported submodules."""

    @property
    def eager_mode(self) -> EagerMode:
        return get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        _set_eager_mode_global(mode)

    @property
    def allow_excess_precision(self) -> bool:
        return xla_options.allow_excess_precision()

    @allow_excess_precision.setter
    def allow_excess_precision(self, value: bool) -> None:
        xla_options.set_allow_excess_precision(value)

    def __getattr__(self, name: str):
        target = _SUBMODULES.get(name)
        if target is None:
            raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}")
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            if err.name is not None and target.startswith(err.name):
                raise AttributeError(f"module 'torch.tpu' has no attribute {name!r} ({target} is not installed)") \
                    from None
            raise
        setattr(self, name, module)
        return module

    def __dir__(self):
        names = set(super().__dir__()) | set(_PROPERTIES)
        names.update(name for name, target in _SUBMODULES.items() if importlib.util.find_spec(target) is not None)
        return sorted(names)


class _SubmoduleLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    _KEPT = ("__name__", "__spec__", "__loader__", "__package__")

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.saved = {name: module.__dict__[name] for name in self._KEPT if name in module.__dict__}
        return module

    def exec_module(self, module):
        # Already imported: give back the identity the import system stamped with "torch.tpu.<name>".
        for name in self._KEPT:
            if name in self.saved:
                setattr(module, name, self.saved[name])


class _SubmoduleFinder(importlib.abc.MetaPathFinder):
    """`import torch.tpu.compiler` (and the other submodules) imports the module `torch.tpu.compiler` names."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != "torch.tpu" or name not in _SUBMODULES:
            return None
        if importlib.util.find_spec(_SUBMODULES[name]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _SubmoduleLoader(_SUBMODULES[name]))


_PRIVATE = ("_get_cache_stats", "_get_cache_requests", "_get_cache_hits", "_get_cache_misses", "_clear_cache",
            "_set_cache_only", "_set_dump_on_cache_miss", "_get_dump_on_cache_miss", "_lazy_init",
            "_is_autocast_enabled", "_get_autocast_dtype", "_set_autocast_dtype")


_module: types.ModuleType | None = None  # the torch.tpu module (device.py), once installed


def install(module: types.ModuleType) -> None:
    """Give the torch.tpu module (device.py) the names it lacks, its class and the submodule import hook.

    A name the module defines itself is kept: ours win.
    """
    global _module
    _module = module  # device.py installs this module: its functions are reached through `_module`
    for name in (*__all__, *_PRIVATE):
        if name not in module.__dict__:
            setattr(module, name, globals()[name])
            if not name.startswith("_"):
                module.__all__.append(name)
    module.__class__ = TpuModule
    module.__path__ = []  # a package to the import system (the finder below supplies its submodules)
    if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
        sys.meta_path.append(_SubmoduleFinder())
