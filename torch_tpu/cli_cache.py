"""Inspect or empty the compile cache: `torch-tpu cache info|clear`."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    info = sub.add_parser("info", help="settings, state and size of each level")
    info.add_argument("--remote", action="store_true", help="also list the remote level (a network request)")
    clear = sub.add_parser("clear", help="remove every entry of the host-shared level")
    clear.add_argument("--remote", action="store_true", help="also remove every entry at the remote URL")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    from torch_tpu import cache

    settings = cache.settings()
    if not settings.enabled:
        print("compile cache: persistent levels off (TORCH_TPU_CACHE=0); level 1 is per process")
        return 0
    from torch_tpu.cache import store

    path = settings.dir or store.default_dir()
    host = cache.host_store()
    if args.action == "clear":
        if host is None:
            print(f"level 2 (host): {path}: off ({store.check_private(path) or 'unusable'}); nothing removed there")
        removed = cache.clear(remote=args.remote)
        where = "host directory and remote URL" if args.remote else "host directory"
        print(f"removed {removed} entries from the {where}")
        return 0 if host is not None else 1

    print("level 1 (process): in memory, one per process (torch_tpu.cache.stats() inside it)")
    if host is None:
        refused = store.check_private(path)
        print(f"level 2 (host): {path}: off ({refused or 'unusable'})")
    else:
        entries = host.entries()
        executables = sum(1 for name, _, _ in entries if name.endswith(".exe"))
        total = sum(size for _, size, _ in entries)
        print(f"level 2 (host): {host.path}")
        print(f"  executables: {executables}, program index records: {len(entries) - executables}")
        print(f"  size: {_size(total)} of {_size(host.max_bytes)} (least recently used evicted beyond)")
    if not settings.url:
        print("level 3 (remote): off (set TORCH_TPU_CACHE_URL)")
    else:
        print(f"level 3 (remote): {settings.url}")
        if args.remote:
            remote = cache.remote_store()
            if remote is None:
                print("  unreachable")
                return 1
            entries = remote.entries()
            if remote.error:
                print(f"  error: {remote.error}")
                return 1
            executables = sum(1 for name, _ in entries if name.endswith(".exe"))
            print(f"  executables: {executables}, program index records: {len(entries) - executables}, "
                  f"size: {_size(sum(size for _, size in entries))}")
    return 0
