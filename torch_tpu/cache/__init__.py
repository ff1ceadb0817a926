"""The three-level compile cache: process, host-shared directory, remote URL.

Every program any executor runs is compiled through `compile(lowered, device)`:
it fingerprints the lowered StableHLO and looks in level 1 (this process),
level 2 (a private directory shared by the user's processes on this host, on
/dev/shm by default) and level 3 (an optional fsspec URL) before compiling.
docs/cache.md describes the levels, keys, entry format, security rules,
settings and the `torch-tpu cache` command.

Importing this package does not start JAX.
"""
from __future__ import annotations

from torch_tpu.cache.key import executable_key, program_key
from torch_tpu.cache.levels import (
    Settings,
    clear,
    compile,
    configure,
    configured,
    entries,
    flush,
    host_store,
    lookup,
    remote_store,
    reset_stats,
    settings,
    stats,
)

__all__ = [
    "Settings", "clear", "compile", "configure", "configured", "entries", "executable_key", "flush", "host_store",
    "lookup", "program_key", "remote_store", "reset_stats", "settings", "stats",
]
