"""The three levels of the compile cache and the one path through them.

Level 1: this process (executable key -> executable). Level 2: the host-shared
directory. Level 3: the optional remote URL. A program is compiled only when
no level has it; while one process compiles it, the others on the host wait
for its entry (single-flight) instead of compiling it too.

Owns: settings (config.py's variables, overridable with `configure`), the
lookup order, single-flight, promotion of remote entries to level 2, stats.
Does not own keys (key.py), envelopes (entry.py), files (store.py) or the
executable format (executable.py).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field, replace

from torch_tpu import metrics, xla_options
from torch_tpu.cache import entry, executable, key, store

logger = logging.getLogger(__name__)

_DEFAULT_MAX_BYTES = 1 << 30
_DEFAULT_LOCK_TIMEOUT = 300.0
_EXIT_FLUSH_SECONDS = 30.0
# Programs with host callbacks or effect tokens call back into this process: never persisted.
_PROCESS_BOUND = ("!stablehlo.token", "xla_python_cpu_callback", "xla_python_gpu_callback", "xla_ffi_python")


@dataclass(frozen=True)
class Settings:
    """Where the persistent levels live (see docs/cache.md)."""

    enabled: bool = True  # levels 2 and 3 (level 1 is always on)
    dir: str | None = None  # level 2 directory; None = store.default_dir()
    url: str | None = None  # level 3 URL; None = no remote level
    max_bytes: int | None = None  # level 2 limit; None = 1 GiB (at most half of its filesystem)
    lock_timeout: float = _DEFAULT_LOCK_TIMEOUT  # seconds to wait for another process's compile
    storage_options: dict = field(default_factory=dict)  # passed to fsspec for the URL
    cache_only: bool = False  # a program no level has is an error, not a compile
    dump_dir: str | None = None  # write the StableHLO of every program compiled (a miss) here


def _from_config() -> Settings:
    from torch_tpu.config import config

    directory = config.cache_dir
    if config.cache_name:  # TorchTPU's TORCH_TPU_TIER2_COMPILATION_CACHE=<name>: a directory under the default one
        named = os.path.join(store.default_dir(), config.cache_name)
        if directory is not None and os.path.abspath(os.path.expanduser(directory)) != named:
            raise ValueError(f"TORCH_TPU_CACHE_DIR={directory!r} and TORCH_TPU_TIER2_COMPILATION_CACHE="
                             f"{config.cache_name!r} (the directory {named}) are both set and disagree: "
                             "set one of them")
        directory = named
    return Settings(
        enabled=config.cache,
        dir=directory,
        url=config.cache_url,
        max_bytes=config.cache_max_mb * (1 << 20) if config.cache_max_mb else None,
        lock_timeout=float(config.cache_lock_timeout or _DEFAULT_LOCK_TIMEOUT),
    )


@dataclass
class LevelStats:
    hits: int = 0
    misses: int = 0
    load_seconds: float = 0.0  # reading + checking + loading the hits
    saved_seconds: float = 0.0  # compile time the hits saved, less load time

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Stats:
    l1: LevelStats = field(default_factory=LevelStats)
    l2: LevelStats = field(default_factory=LevelStats)
    l3: LevelStats = field(default_factory=LevelStats)
    l1_evictions: int = 0  # times level 1 dropped its least recently served quarter (L1_LIMIT)
    index_hits: int = 0  # program keys that named their executable (no tracing, no lowering)
    index_misses: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    lowerings: int = 0  # programs traced and lowered to StableHLO to be fingerprinted
    waits: int = 0  # single-flight: waited for another process's compile
    wait_seconds: float = 0.0
    lock_timeouts: int = 0
    corrupt: int = 0  # entries refused (checksum, key, truncation) and dropped
    process_bound: int = 0  # programs kept in level 1 only (host callbacks, tokens)
    write_errors: int = 0


_lock = threading.RLock()
_settings = _from_config()
_stats = Stats()
_l1: dict[str, object] = {}  # executable key -> executable, least recently served first
# Level 1's size. Every live XLA:CPU executable holds memory mappings of its own (code and data: ~4
# for an elementwise op, ~45 for a boolean-mask write), and a process past the kernel's
# vm.max_map_count (65530 by default) crashes in its next mmap; a workload of ever new shapes (eager
# decoding without a static cache, PyTorch's test_view_ops) reached it. The least recently served
# executables beyond L1_LIMIT are dropped, and half of them whenever the process holds more than
# half of vm.max_map_count mappings (counted every _MAPS_EVERY stores); holders of executables
# (the executor's program table) drop theirs through `on_pressure` hooks. A dropped executable's
# next use loads it from level 2 (no compile).
L1_LIMIT = 4096
_MAPS_EVERY = 32
_puts = 0
_pressure_hooks: list = []
_compile_seconds: dict[str, float] = {}  # executable key -> its compile time (for "saved")
_indexed: set[str] = set()  # program keys recorded by this process
_unsaved: set[str] = set()  # executable keys kept in level 1 only (never worth an index record)
# executable key -> [times served (its compile or load, then level 1 hits), time.time() of the last,
# seconds compiling it in this process (0.0: loaded from level 2 or 3)]
_reads: dict[str, list] = {}
_host: store.HostStore | None = None
_host_opened = False
_remote: store.RemoteStore | None = None
_remote_opened = False
_warned: set[str] = set()


def _warn_once(tag: str, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    else:
        logger.warning(message)


def settings() -> Settings:
    """The settings in force."""
    return _settings


def configure(**changes) -> Settings:
    """Change settings (fields of `Settings`) from now on; returns the previous ones.

    Level 1 is kept; levels 2 and 3 are reopened with the new settings.
    """
    global _settings, _host, _host_opened, _remote, _remote_opened
    with _lock:
        previous = _settings
        _settings = replace(previous, **changes)
        if _remote is not None:
            _remote.flush(_EXIT_FLUSH_SECONDS)
        _host, _host_opened, _remote, _remote_opened = None, False, None, False
        _indexed.clear()
        return previous


@contextlib.contextmanager
def configured(**changes):
    """`configure(**changes)` for the duration of a `with` block."""
    previous = configure(**changes)
    try:
        yield _settings
    finally:
        configure(**previous.__dict__)


def host_store() -> store.HostStore | None:
    """Level 2 (opened on first use), or None if disabled or refused."""
    global _host, _host_opened
    if not _settings.enabled:
        return None
    if not _host_opened:
        _host_opened = True
        path = _settings.dir or store.default_dir()
        limit = _settings.max_bytes or _default_limit(path)
        host = store.HostStore(path, limit, _settings.lock_timeout)
        if host.usable:
            _host = host
        else:
            _warn_once("refused:" + host.path, f"torch_tpu: compile cache directory {host.path} refused: "
                       f"{host.refused}; the host-shared level is disabled")
    return _host


def remote_store() -> store.RemoteStore | None:
    """Level 3 (opened on first use), or None if there is no URL or it failed."""
    global _remote, _remote_opened
    if not _settings.enabled or not _settings.url:
        return None
    if not _remote_opened:
        _remote_opened = True
        _remote = store.RemoteStore(_settings.url, _settings.storage_options)
        atexit.register(_remote.flush, _EXIT_FLUSH_SECONDS)
    return _remote if _remote is not None and _remote.usable else None


def _default_limit(path: str) -> int:
    probe = path
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        fs = os.statvfs(probe)
        return min(_DEFAULT_MAX_BYTES, fs.f_blocks * fs.f_frsize // 2)
    except OSError:
        return _DEFAULT_MAX_BYTES


def _read(name: str, stored_key: str, level_names=("l2", "l3")):
    """(level, metadata, payload, blob) of the first intact entry, dropping corrupt ones; or None."""
    for level in level_names:
        where = host_store() if level == "l2" else remote_store()
        if where is None:
            continue
        blob = where.get(name)
        if blob is None:
            continue
        try:
            metadata, payload = entry.decode(stored_key, blob)
        except entry.CorruptEntry as err:
            _drop_corrupt(level, where, name, err)
            continue
        return level, metadata, payload, blob
    return None


def _drop_corrupt(level, where, name, err) -> None:
    _stats.corrupt += 1
    _warn_once("corrupt", f"torch_tpu: dropped a corrupt compile cache entry {name} ({err}); it will be recompiled")
    if level == "l2":
        where.drop(name)


def _write(name: str, blob: bytes, remote: bool = True) -> None:
    """Write an entry to level 2 now and queue it for level 3 (if `remote`)."""
    host = host_store()
    if host is not None:
        try:
            host.put(name, blob)
        except OSError as err:  # a full /dev/shm, a directory removed under us
            _stats.write_errors += 1
            _warn_once("write", f"torch_tpu: could not write to the compile cache directory {host.path} ({err})")
    far = remote_store() if remote else None
    if far is not None:
        far.put(name, blob)


def _load(fp: str, device, in_tree, out_tree, count_misses: bool = True):
    """The executable `fp` from level 2 or 3 (promoting a remote hit to level 2), or None."""
    for level in ("l2", "l3"):
        start = time.perf_counter()
        found = _read(fp + ".exe", fp, (level,))
        level_stats = getattr(_stats, level)
        if found is None:
            if count_misses and (host_store() if level == "l2" else remote_store()) is not None:
                level_stats.misses += 1
            continue
        _, metadata, payload, blob = found
        if metadata.get("in_tree") != str(in_tree) or metadata.get("out_tree") != str(out_tree):
            _drop_corrupt(level, host_store() if level == "l2" else remote_store(), fp + ".exe",
                          "its calling convention does not match the program")
            continue
        try:
            loaded = executable.deserialize(payload, device, in_tree, out_tree)
        except Exception as err:  # XLA refused the bytes: treat like a corrupt entry
            _drop_corrupt(level, host_store() if level == "l2" else remote_store(), fp + ".exe", err)
            continue
        seconds = time.perf_counter() - start
        compile_seconds = float(metadata.get("compile_seconds", 0.0))
        level_stats.hits += 1
        level_stats.load_seconds += seconds
        level_stats.saved_seconds += max(0.0, compile_seconds - seconds)
        _compile_seconds[fp] = compile_seconds
        _reads[fp] = [1, time.time(), 0.0]
        if level == "l3":
            _write(fp + ".exe", blob, remote=False)
        return loaded
    return None


def on_pressure(hook) -> None:
    """Register `hook(fraction)`: drop that fraction of the executables it holds (oldest first)."""
    _pressure_hooks.append(hook)


class ExecutableTable(dict):
    """A table of executables (or of objects holding them) bounded like level 1.

    Past L1_LIMIT entries (or `limit`, if lower) the oldest quarter is dropped, and under
    memory-mapping pressure the oldest half. A dropped entry's next use is a miss that finds its
    executable in level 2, with no compile. Insertion order is the age: a table's users re-insert
    nothing they serve, so this is first-in first-out.
    """

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit = limit
        on_pressure(lambda fraction: self.drop_oldest(int(len(self) * fraction)))

    def __setitem__(self, key, value):
        limit = L1_LIMIT if self.limit is None else min(self.limit, L1_LIMIT)
        if len(self) >= limit and key not in self:
            self.drop_oldest(len(self) - limit * 3 // 4)
        super().__setitem__(key, value)

    def drop_oldest(self, n: int) -> None:
        # dict's own pop: another thread may have dropped a key since the list was taken
        for old in list(self)[:n]:
            dict.pop(self, old, None)


@functools.cache
def _map_budget() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return None  # not Linux: L1_LIMIT alone


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def _l1_put(fp: str, executable) -> None:
    global _puts
    _l1.pop(fp, None)
    _l1[fp] = executable
    if len(_l1) > L1_LIMIT:
        _evict(len(_l1) - L1_LIMIT * 3 // 4)  # a quarter at once: evictions stay rare
    _puts += 1
    if _puts % _MAPS_EVERY == 0 and _map_budget() is not None and _mappings() > _map_budget():
        _evict(len(_l1) // 2)
        for hook in _pressure_hooks:
            hook(0.5)


def _evict(n: int) -> None:
    """Drop the n least recently served executables of level 1."""
    for old in list(_l1)[:n]:
        del _l1[old]
    _stats.l1_evictions += 1


def _l1_get(fp: str):
    found = _l1.pop(fp, None)
    if found is None:
        _stats.l1.misses += 1
    else:
        _l1[fp] = found  # now the most recently served
        _stats.l1.hits += 1
        _stats.l1.saved_seconds += _compile_seconds.get(fp, 0.0)
        reads = _reads.setdefault(fp, [0, None, 0.0])
        reads[0] += 1
        reads[1] = time.time()
    return found


def _dump(lowered, fp: str) -> None:
    path = os.path.join(_settings.dump_dir, fp[:16] + ".mlir")
    try:
        os.makedirs(_settings.dump_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(lowered.as_text())
    except OSError as err:
        _warn_once("dump", f"torch_tpu: could not dump a missed program to {path} ({err})")
        return
    logger.info("compile cache miss: StableHLO dumped to %s", path)


def entries() -> list[tuple[str, int, float, float]]:
    """Per executable of level 1: (executable key, times served, seconds compiling it in this process (0.0 if
    loaded from level 2 or 3), time.time() it was last served). Its compile or load is the first serving."""
    with _lock:
        out = []
        for fp in _l1:
            served, last, seconds = _reads.get(fp) or (1, time.time(), 0.0)
            out.append((fp, served, seconds, last))
        return out


def _remember(program_key: str | None, fp: str) -> None:
    """Record program key -> executable key in the persistent levels (once per process)."""
    if program_key is None or program_key in _indexed or fp in _unsaved or not _settings.enabled:
        return
    _indexed.add(program_key)
    _write(program_key + ".idx", entry.encode(program_key, fp.encode(), kind="program"))


def lookup(program_key: str, device, in_tree, out_tree):
    """The executable a program key was recorded with, from any level; None if unknown.

    `in_tree`/`out_tree` are the pytrees of `(args, kwargs)` and of the results
    (as `jax.stages.Lowered.in_tree`/`out_tree` would give them).

    No tracing, lowering or compiling happens here: on None the caller lowers
    the program and calls `compile` with the same `program_key`.
    """
    if not _settings.enabled:
        return None
    with _lock:
        found = _read(program_key + ".idx", program_key)
        if found is None:
            _stats.index_misses += 1
            return None
        level, _, payload, blob = found
        fp = payload.decode("ascii", "replace")
        result = _l1_get(fp)
        if result is None:
            result = _load(fp, device, in_tree, out_tree, count_misses=False)
        if result is None:
            _stats.index_misses += 1  # the executable itself is gone: lower and compile
            return None
        _stats.index_hits += 1
        _indexed.add(program_key)
        if level == "l3":
            _write(program_key + ".idx", blob, remote=False)
        _l1_put(fp, result)
        return result


def compile(lowered, device, program_key: str | None = None, options: tuple = ()):
    """The executable of a `jax.stages.Lowered` for `device`, from the cache or freshly compiled.

    `program_key` (from `key.program_key`) is recorded as naming this
    executable, for later `lookup`s. `options` are (name, value) pairs of XLA compile
    options the lowering is compiled with (`Lowered.compile(compiler_options=...)`); they are
    part of the key. torch.compile(backend="tpu") passes its `xla_flags` option here.
    """
    with _lock:
        _stats.lowerings += 1
        options = xla_options.merged(options)  # those of `with torch_tpu.xla_options.use(...)` blocks too
        text = lowered.as_text()
        in_tree, out_tree = lowered.in_tree, lowered.out_tree
        # The pytrees are the calling convention: equal text with other trees is another executable.
        fp = key.executable_key(text, device, (*options, str(in_tree), str(out_tree)))
        found = _l1_get(fp)
        if found is not None:
            _remember(program_key, fp)
            return found
        if any(marker in text for marker in _PROCESS_BOUND):
            _stats.process_bound += 1
            _unsaved.add(fp)
            result = _compile(lowered, fp, device, persist=False, options=options)
            _l1_put(fp, result)
            return result
        result = _load(fp, device, in_tree, out_tree) if _settings.enabled else None
        if result is None:
            host = host_store()
            flight = host.single_flight(fp) if host is not None else contextlib.nullcontext(None)
            with flight as outcome:
                if outcome is not None:
                    if outcome.waited:
                        _stats.waits += 1
                        _stats.wait_seconds += outcome.seconds
                    # Look again under the lock: another process may have stored it between our miss
                    # above and taking the lock, without us having to wait for it.
                    result = _load(fp, device, in_tree, out_tree, count_misses=False)
                if outcome is not None and not outcome.acquired:
                    _stats.lock_timeouts += 1
                if result is None:
                    result = _compile(lowered, fp, device, persist=_settings.enabled, options=options)
        _l1_put(fp, result)
        _remember(program_key, fp)
        return result


def _compile(lowered, fp: str, device, persist: bool, options: tuple = ()):
    if _settings.dump_dir:
        _dump(lowered, fp)
    if _settings.cache_only:
        raise RuntimeError(
            f"compile cache miss in cache-only mode: program {fp[:16]} is in no cache level and would be compiled "
            "(torch.tpu._set_cache_only(False) or torch_tpu.cache.configure(cache_only=False) allows compiling)")
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=dict(options)) if options else lowered.compile()
    seconds = time.perf_counter() - start
    _reads[fp] = [1, time.time(), seconds]
    metrics.record_compile(seconds)
    _stats.compiles += 1
    _stats.compile_seconds += seconds
    _compile_seconds[fp] = seconds
    if persist and (host_store() is not None or remote_store() is not None):
        try:
            if executable.parameter_count(compiled) != lowered.in_tree.num_leaves:
                raise ValueError("the executable does not take one parameter per flat argument")
            payload = executable.serialize(compiled)
        except Exception as err:  # a backend that cannot serialize: keep it in level 1
            _stats.process_bound += 1
            _unsaved.add(fp)
            logger.info("not persisting executable %s: %s", fp, err)
            return compiled
        blob = entry.encode(fp, payload, kind="executable", compile_seconds=seconds, in_tree=str(lowered.in_tree),
                            out_tree=str(lowered.out_tree), platform=device.platform,
                            device_kind=device.device_kind, created=time.time())
        _write(fp + ".exe", blob)
    return compiled


def flush(timeout: float | None = None) -> bool:
    """Wait for queued remote writes; False if `timeout` seconds passed first."""
    remote = _remote
    return True if remote is None else remote.flush(timeout)


def stats() -> dict:
    """Per-level hits, misses, load time and compile time saved, plus compiles, waits and errors."""
    s = _stats
    host, remote = _host, _remote
    out = {
        "l1": {**s.l1.as_dict(), "entries": len(_l1), "evictions": s.l1_evictions},
        "l2": {**s.l2.as_dict(), "enabled": host is not None, "path": None if host is None else host.path,
               "evictions": 0 if host is None else host.evictions},
        "l3": {**s.l3.as_dict(), "enabled": remote is not None and remote.usable, "url": _settings.url,
               "writes": 0 if remote is None else remote.writes, "pending": 0 if remote is None else remote.pending,
               "error": None if remote is None else remote.error},
    }
    for name in ("index_hits", "index_misses", "compiles", "compile_seconds", "lowerings", "waits", "wait_seconds",
                 "lock_timeouts", "corrupt", "process_bound", "write_errors"):
        out[name] = getattr(s, name)
    return out


def reset_stats() -> None:
    """Zero the counters (entries stay)."""
    global _stats
    _stats = Stats()
    if _host is not None:
        _host.evictions = 0


def clear(host: bool = True, remote: bool = False) -> int:
    """Forget level 1; empty level 2 if `host`, level 3 if `remote`. Returns the persistent entries removed.

    Programs the executors already hold keep their executables.
    """
    with _lock:
        _l1.clear()
        _compile_seconds.clear()
        _reads.clear()
        _indexed.clear()
        _unsaved.clear()
        removed = 0
        shared = host_store() if host else None
        if shared is not None:
            removed += shared.clear()
        if remote:
            far = remote_store()
            if far is not None:
                far.flush(_EXIT_FLUSH_SECONDS)
                removed += far.clear()
        return removed


def _report() -> dict:
    s = _stats
    rows = {
        "L1 process hits / misses": f"{s.l1.hits} / {s.l1.misses}",
        "L2 host hits / misses": f"{s.l2.hits} / {s.l2.misses}" + ("" if _host is not None else " (off)"),
        "L3 remote hits / misses": f"{s.l3.hits} / {s.l3.misses}" + (
            "" if _remote is not None and _remote.usable else " (off)"),
        "program index hits / misses": f"{s.index_hits} / {s.index_misses}",
        "load s / compile s saved": f"{s.l2.load_seconds + s.l3.load_seconds:.2f} / "
                                    f"{s.l1.saved_seconds + s.l2.saved_seconds + s.l3.saved_seconds:.2f}",
        "compiles": f"{s.compiles} ({s.compile_seconds:.2f} s)",
        "single-flight waits": f"{s.waits} ({s.wait_seconds:.2f} s, {s.lock_timeouts} timeouts)",
        "corrupt entries dropped": f"{s.corrupt}",
    }
    return rows


def _after_fork_in_child() -> None:
    # The remote writer thread and a lock held by another thread do not survive fork.
    global _lock, _remote, _remote_opened
    _lock = threading.RLock()
    _remote, _remote_opened = None, False


os.register_at_fork(after_in_child=_after_fork_in_child)
metrics.add_section("compile cache", _report)
