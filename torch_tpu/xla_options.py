"""The XLA compile options programs on "tpu" are compiled with.

Owns: the options of `with torch_tpu.xla_options.use({...}):` blocks (nested
blocks merge, the inner value wins), the `allow_excess_precision` setting,
the options tuple every compile passes to XLA (`current`, merged in by
cache.compile) and the part of it that differs from the defaults (`key`, in
the executors' signatures and the cache's program keys, so that a program
compiled with other options is never reused). Does not own compiling
(cache/) or the executors (eager/).

Option names are XLA's: a DebugOptions field (`xla_cpu_enable_fast_math`, ...)
or one of the two build-level efforts `xla_optimization_level` and
`xla_memory_fitting_level`, each "O0".."O3". Blocks are process-wide, like
the execution mode (modes.py): the autograd engine runs backward ops on its
own threads, and they compile with the forward's options.

Importing this module does not start JAX.
"""
from __future__ import annotations

import contextlib
import sys
import threading

# The two build-level options and jax's EffortLevel numbers for O0..O3 (the build options take ints).
_LEVELS = {"xla_optimization_level": "optimization_level", "xla_memory_fitting_level": "memory_fitting_level"}
_EFFORT = {"O0": 9, "O1": 19, "O2": 29, "O3": 39}

_lock = threading.RLock()
_stack: list[dict] = []  # the merged options of each open block, innermost last
_allow_excess_precision = False
_checked: set = set()  # option sets XLA accepted
active = False  # options differ from the defaults: executors add `key()` to program keys, no native cache hits


def allow_excess_precision() -> bool:
    """Whether XLA may keep values at a higher precision than their type inside a program (default False)."""
    return _allow_excess_precision


def set_allow_excess_precision(value: bool) -> None:
    """Allow (True) or forbid (False, the default) excess precision in programs compiled from now on."""
    global _allow_excess_precision
    if not isinstance(value, bool):
        raise TypeError(f"allow_excess_precision must be a bool, got {type(value).__name__}")
    if value != _allow_excess_precision:
        with _changing():
            _allow_excess_precision = value


def custom() -> dict:
    """The options of the open blocks, merged (inner wins); {} outside any block."""
    return dict(_stack[-1]) if _stack else {}


def current() -> tuple:
    """(name, value) pairs for XLA's compile, sorted: the block options and allow_excess_precision."""
    options = {"xla_allow_excess_precision": _allow_excess_precision}
    for name, value in custom().items():
        if name in _LEVELS:
            options[_LEVELS[name]] = _EFFORT[value]
        else:
            options[name] = value
    return tuple(sorted(options.items()))


def merged(options: tuple = ()) -> tuple:
    """`current()` with explicit (name, value) `options` (a torch.compile backend's) on top, sorted."""
    if not options:
        return current()
    return tuple(sorted({**dict(current()), **dict(options)}.items()))


def key() -> tuple:
    """What differs from the default options, as a key suffix: () at the defaults."""
    if not active:
        return ()
    return (("xla", current()),)


def _validate(options) -> dict:
    if not isinstance(options, dict):
        raise TypeError(f"compiler options must be a dict of XLA option names to values, got {type(options).__name__}")
    for name, value in options.items():
        if not isinstance(name, str):
            raise TypeError(f"compiler option names must be strings, got {name!r}")
        if name in _LEVELS and value not in _EFFORT:
            raise ValueError(f"{name} must be one of {', '.join(_EFFORT)}, got {value!r}")
        if not isinstance(value, (bool, int, float, str)):
            raise TypeError(f"compiler option {name} must be a bool, int, float or str, got {type(value).__name__}")
    return dict(options)


def _check_with_xla(options: tuple) -> None:
    """Compile a trivial program with `options` so an unknown name fails here, not at some later op."""
    if options in _checked:
        return
    import jax
    import jax.numpy as jnp

    from torch_tpu.runtime import platform

    sharding = jax.sharding.SingleDeviceSharding(platform.process_device())  # the platform the programs compile for
    probe = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)
    try:
        jax.jit(lambda x: x + 1, out_shardings=sharding).lower(probe).compile(compiler_options=dict(options))
    except jax.errors.JaxRuntimeError as err:
        raise ValueError(f"XLA refused the compiler options {dict(options)}: {err}") from None
    _checked.add(options)


@contextlib.contextmanager
def _changing():
    """Flush what DeferAndFuse recorded under the old options, then switch the native cache-hit path."""
    defer = sys.modules.get("torch_tpu.eager.defer")
    with (defer.lock if defer is not None else _lock):
        if defer is not None:
            defer.flush("compiler options change")
        yield
        global active
        active = bool(_stack) or _allow_excess_precision
        executor = sys.modules.get("torch_tpu.eager.executor")
        if executor is not None:
            executor.update_fast_path()


@contextlib.contextmanager
def use(options: dict):
    """Compile the programs of the block with the XLA `options` (merged into those of enclosing blocks)."""
    options = _validate(options)
    with _lock:
        merged = {**custom(), **options}
    saved = list(_stack)
    with _changing():
        _stack.append(merged)
    try:
        _check_with_xla(current())
    except BaseException:
        with _changing():
            _stack[:] = saved
        raise
    try:
        yield merged
    finally:
        with _changing():
            _stack[:] = saved
