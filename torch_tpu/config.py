"""Every TORCH_TPU_* environment variable, declared and read once, here.

Owns: parsing and validating the variables, and the Python setters that
override them. Does not own: what the settings do (each consumer reads them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected one of 1/0/true/false/yes/no/on/off")


def _choice(name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _path(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of seconds") from None
    if number < 0:
        raise ValueError(f"{name}={value!r}: expected a number of seconds >= 0")
    return number


# ---------------------------------------------------------------- TorchTPU's names (docs/compat.md)
# Read as aliases of ours: where both names are set and mean different things, an error names both.
def _agree(ours: str, ours_value, theirs: str, theirs_value):
    """The value of a setting given by our variable and TorchTPU's alias (None: that name is unset)."""
    if theirs_value is None:
        return ours_value
    if ours_value is not None and ours_value != theirs_value:
        raise ValueError(f"{ours}={os.environ[ours]!r} and {theirs}={os.environ[theirs]!r} are both set and disagree: "
                         f"set one of them")
    return theirs_value


def _set(name: str) -> bool:
    return bool(os.environ.get(name, "").strip())


def _aliased_flag(ours: str, theirs: str, default: bool) -> bool:
    value = _agree(ours, _flag(ours) if _set(ours) else None, theirs, _flag(theirs) if _set(theirs) else None)
    return default if value is None else value


def _aliased_path(ours: str, theirs: str) -> str | None:
    return _agree(ours, _path(ours), theirs, _path(theirs))


def _cache_enabled() -> bool:
    """TORCH_TPU_CACHE, or TorchTPU's TORCH_TPU_TIER2_COMPILATION_CACHE ("disabled" = off, a name = on)."""
    ours = _flag("TORCH_TPU_CACHE") if _set("TORCH_TPU_CACHE") else None
    value = os.environ.get("TORCH_TPU_TIER2_COMPILATION_CACHE", "").strip()
    theirs = value.lower() != "disabled" if value else None
    value = _agree("TORCH_TPU_CACHE", ours, "TORCH_TPU_TIER2_COMPILATION_CACHE", theirs)
    return True if value is None else value


def _cache_name() -> str | None:
    """The directory name TORCH_TPU_TIER2_COMPILATION_CACHE gives (resolved under the default directory by
    the compile cache, cache/levels.py, which also checks it against TORCH_TPU_CACHE_DIR)."""
    value = os.environ.get("TORCH_TPU_TIER2_COMPILATION_CACHE", "").strip()
    if not value or value.lower() == "disabled":
        return None
    if value in (".", "..") or "/" in value or "\\" in value:
        raise ValueError(f"TORCH_TPU_TIER2_COMPILATION_CACHE={value!r}: expected a name (no path separators) "
                         "or 'disabled'")
    return value


def _repeated_ops() -> bool:
    """TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS: "safe" or "aggressive" turn the heuristic on, any other value off."""
    ours = _flag("TORCH_TPU_DEFER_REPEATS") if _set("TORCH_TPU_DEFER_REPEATS") else None
    theirs = os.environ.get("TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS", "").strip().lower()
    theirs = theirs in ("safe", "aggressive") if theirs else None
    value = _agree("TORCH_TPU_DEFER_REPEATS", ours, "TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS", theirs)
    return True if value is None else value


def _int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer") from None
    if number < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return number


@dataclass
class Config:
    # PJRT platform: None = best available (tpu, then gpu, then cpu).
    platform: str | None = field(default_factory=lambda: _choice("TORCH_TPU_PLATFORM", ("tpu", "gpu", "cuda", "rocm", "cpu"), None))
    # Number of XLA:CPU devices to expose when the platform is cpu (testing multi-device code).
    num_cpu_devices: int | None = field(default_factory=lambda: _int("TORCH_TPU_NUM_CPU_DEVICES"))
    # torch.tpu.distributed.set_tpu_launch_env (topology.py): the master port of a multi-host job,
    # and the processes per host (None: WORLD_SIZE is left to the launcher).
    base_port: int = field(default_factory=lambda: _int("TORCH_TPU_BASE_PORT", 8476))
    devices_per_host: int | None = field(default_factory=lambda: _int("TORCH_TPU_DEVICES_PER_HOST"))
    # Debug eager: every op synchronous, errors at the Python line of the failing op.
    launch_blocking: bool = field(default_factory=lambda: _flag("TORCH_TPU_LAUNCH_BLOCKING"))
    # Ops with no lowering and no decomposition: "warn" (run on CPU, warn once per op) or "error".
    fallback: str = field(default_factory=lambda: _choice("TORCH_TPU_FALLBACK", ("warn", "error", "silent"), "warn"))
    # Compile cache (docs/cache.md): the persistent levels (host-shared directory, remote URL) on or off.
    # (TorchTPU's TORCH_TPU_TIER2_COMPILATION_CACHE=disabled is read as TORCH_TPU_CACHE=0.)
    cache: bool = field(default_factory=_cache_enabled)
    # Level 2 directory (None: a private directory on /dev/shm, else under ~/.cache).
    cache_dir: str | None = field(default_factory=lambda: _path("TORCH_TPU_CACHE_DIR"))
    # TorchTPU's TORCH_TPU_TIER2_COMPILATION_CACHE=<name>: level 2 in the directory <name> under the default one.
    cache_name: str | None = field(default_factory=_cache_name)
    # Level 3 URL, any filesystem fsspec knows (file://, s3://, gs://, ...); None: no remote level.
    # (TorchTPU's TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT is read as an alias.)
    cache_url: str | None = field(default_factory=lambda: _aliased_path("TORCH_TPU_CACHE_URL",
                                                                        "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"))
    # Level 2 size limit in MiB (least recently used entries are evicted beyond it).
    cache_max_mb: int | None = field(default_factory=lambda: _int("TORCH_TPU_CACHE_MAX_MB"))
    # Seconds a process waits for another one compiling the same program before compiling it itself.
    cache_lock_timeout: int | None = field(default_factory=lambda: _int("TORCH_TPU_CACHE_LOCK_TIMEOUT"))
    # DeferAndFuse (docs/defer.md): record ops, run them as fused programs at materialization points.
    # TORCH_TPU_LAUNCH_BLOCKING=1 wins over it (see modes.py); torch_tpu.set_execution_mode overrides both.
    defer_and_fuse: bool = field(default_factory=lambda: _flag("TORCH_TPU_DEFER_AND_FUSE"))
    # DeferAndFuse size cap: a recorded graph is flushed when it reaches this many ops.
    defer_max_ops: int = field(default_factory=lambda: _int("TORCH_TPU_DEFER_MAX_OPS", 10_000))
    # The repeated-operations heuristic (eager/repeats.py): cut recorded graphs at repeating blocks.
    # (TorchTPU's TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS is read as an alias: safe/aggressive on, else off.)
    defer_repeats: bool = field(default_factory=_repeated_ops)
    # Shortest unit (in ops) the heuristic cuts out; shorter periods are grouped up to this length.
    defer_min_period: int = field(default_factory=lambda: _int("TORCH_TPU_DEFER_MIN_PERIOD", 16))
    # Longest period (in ops) the heuristic looks for.
    defer_max_period: int = field(default_factory=lambda: _int("TORCH_TPU_DEFER_MAX_PERIOD", 1024))
    # Consecutive equal units whose values flow from one to the next (a loop body) run as one looped program.
    defer_loops: bool = field(default_factory=lambda: _flag("TORCH_TPU_DEFER_LOOPS", True))
    # Developer tools (docs/troubleshooting.md): log every recompile with its reason.
    explain_recompiles: bool = field(default_factory=lambda: _flag("TORCH_TPU_EXPLAIN_RECOMPILES"))
    # Recompiles of one site before a one-time RecompileWarning suggests the fix.
    recompile_warn_limit: int = field(default_factory=lambda: _int("TORCH_TPU_RECOMPILE_WARN_LIMIT", 8))
    # A compile running longer than this many seconds prints a one-line notice (0: never).
    compile_notice_seconds: float = field(default_factory=lambda: _seconds("TORCH_TPU_COMPILE_NOTICE_SECONDS", 10.0))
    # Where to write the metrics (JSON) when the process exits; `torch-tpu report FILE` renders it.
    metrics_file: str | None = field(default_factory=lambda: _path("TORCH_TPU_METRICS_FILE"))

    # tpu_dist: the host rank 0's JAX coordinator listens on (default: MASTER_ADDR, else 127.0.0.1).
    coordinator_host: str | None = field(default_factory=lambda: _path("TORCH_TPU_COORDINATOR_HOST"))
    # Pallas kernels (docs/kernels.md): "auto" interprets them where the platform cannot compile Pallas
    # (XLA:CPU), "1" always, "0" never, "tpu" always with Pallas's TPU interpreter.
    pallas_interpret: str = field(default_factory=lambda: _choice(
        "TORCH_TPU_PALLAS_INTERPRET", ("auto", "1", "0", "true", "false", "yes", "no", "on", "off", "tpu"), "auto"))
    # Bundled kernels (torch_tpu.kernels) behind SDPA and torch._grouped_mm: "auto" where Pallas compiles
    # natively, "always" (also interpreted: slow, for testing), "never" (always the XLA lowerings).
    kernels: str = field(default_factory=lambda: _choice("TORCH_TPU_KERNELS", ("auto", "always", "never"), "auto"))
    # torch.compile(backend="tpu") (docs/compile.md): dump every ATen FX graph and its StableHLO here.
    compile_dump_dir: str | None = field(default_factory=lambda: _path("TORCH_TPU_COMPILE_DUMP_DIR"))
    # Value checks (docs/reliability.md): programs of ops that PyTorch checks by value (indices, targets,
    # probabilities) compute an error flag, raised at the next materialization point; 0 turns them off.
    # (TorchTPU's TORCH_TPU_ENABLE_DEBUG_CHECKS is read as an alias: see docs/compat.md.)
    value_checks: bool = field(default_factory=lambda: _aliased_flag("TORCH_TPU_VALUE_CHECKS",
                                                                     "TORCH_TPU_ENABLE_DEBUG_CHECKS", True))

    def __post_init__(self):
        if self.launch_blocking and self.defer_and_fuse:
            import warnings

            warnings.warn(
                "TORCH_TPU_LAUNCH_BLOCKING=1 and TORCH_TPU_DEFER_AND_FUSE=1 are both set: debug mode wins "
                "(every op runs alone and waits for its result).",
                stacklevel=2,
            )
            self.defer_and_fuse = False


config = Config()


def reload() -> Config:
    """Re-read the environment (tests use this; programs read it once at import)."""
    global config
    fresh = Config()
    config.__dict__.update(fresh.__dict__)
    return config
