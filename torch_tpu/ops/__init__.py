"""The lowering table, one module per op family (see registry.py).

Every module in this package except `registry` is a family; `load_all`
imports them all (each registers its lowerings at import).
"""
from __future__ import annotations

import importlib
import pkgutil

_loaded = False


def families() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "registry" and not m.name.startswith("_"))


def load_all() -> None:
    """Import every family module."""
    global _loaded
    if _loaded:
        return
    for family in families():
        importlib.import_module(f"{__name__}.{family}")
    _loaded = True
