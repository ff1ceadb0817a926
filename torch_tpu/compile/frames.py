"""Which frames Dynamo traces: never torch_tpu's own (but its user-facing faces) or JAX's.

Used by `register()` and by the backend at each compile (compile/backend.py).
"""
from __future__ import annotations

_skipping = False


def skip_library_frames() -> None:
    """Tell Dynamo never to trace torch_tpu's and JAX's own frames (idempotent).

    Eager tpu kernels are Python: an op run by eager code between two graphs (a graph break:
    `loss.backward()` inside a compiled step, a first-seen op signature taking the Python path)
    would otherwise be a frame Dynamo tries to compile, down into JAX.
    """
    global _skipping
    if _skipping:
        return
    import pkgutil

    from torch._dynamo import trace_rules

    import torch_tpu

    for name in ("jax", "jaxlib"):
        trace_rules.add(name)
    # Every torch_tpu module but the user-facing faces: a `jax_op` call (torch_tpu.pallas, the
    # bundled kernels, _internal.pallas) is traced, so its operator lands in the graph instead of
    # breaking it, and TorchTPU's scoped settings (tpu_api, _internal) reach their own refusal.
    for module in pkgutil.iter_modules(torch_tpu.__path__):
        if module.name not in _TRACED:
            trace_rules.add(f"torch_tpu.{module.name}")
    _skipping = True


_TRACED = ("pallas", "kernels", "tpu_api", "_internal")
