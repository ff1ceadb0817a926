"""torch.compile on "tpu": the Dynamo backend "tpu" (docs/compile.md).

`torch.compile(model, backend="tpu")`: Dynamo captures graphs, AOTAutograd makes the
forward and backward ATen graphs, and each graph runs as one XLA program built from the
lowering table the eager executors use (graph.py). `torch.compile(model)` with the default
backend sends graphs over tpu tensors here too (routing.py, installed by `import torch_tpu`).

Dynamo finds the backend by name through the package's `torch_dynamo_backends` entry point;
`register()` registers it by hand (an uninstalled checkout). Importing this package is light
(no torch._dynamo, no JAX): it registers at once only if Dynamo is already imported.
"""
from __future__ import annotations

import sys

from torch_tpu.compile.backend import Options, decompositions, tpu_backend


def register() -> None:
    """Register `tpu_backend` with Dynamo as "tpu" (imports torch._dynamo; idempotent)."""
    from torch._dynamo.backends import registry

    skip_library_frames()
    if registry._COMPILER_FNS.get("tpu") is tpu_backend:
        return
    registry._COMPILER_FNS.pop("tpu", None)
    registry._BACKENDS.pop("tpu", None)  # an entry point's placeholder: replaced by the function itself
    registry.register_backend(tpu_backend, name="tpu")


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


def __getattr__(name):
    if name == "stats":  # graph.py imports JAX: only when asked
        from torch_tpu.compile.graph import stats

        return stats
    raise AttributeError(f"module 'torch_tpu.compile' has no attribute {name!r}")


if "torch._dynamo" in sys.modules:
    register()

__all__ = ["Options", "decompositions", "register", "skip_library_frames", "stats", "tpu_backend"]
