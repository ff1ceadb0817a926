"""The lowering table, one module per op family (see registry.py)."""
from __future__ import annotations

import importlib

FAMILIES = ("elementwise", "reduction", "linalg", "shape", "indexing", "nn", "random", "factory", "foreach")
_loaded = False


def load_all() -> None:
    """Import every family module (each registers its lowerings)."""
    global _loaded
    if _loaded:
        return
    for family in FAMILIES:
        importlib.import_module(f"torch_tpu.ops.{family}")
    _loaded = True
