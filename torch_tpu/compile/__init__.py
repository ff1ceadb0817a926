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

from torch_tpu.compile.backend import Options, tpu_backend
from torch_tpu.compile.decompositions import decompositions
from torch_tpu.compile.frames import skip_library_frames


def register() -> None:
    """Register `tpu_backend` with Dynamo as "tpu" (imports torch._dynamo; idempotent)."""
    from torch._dynamo.backends import registry

    from torch_tpu.compile import fake, optimizers

    skip_library_frames()
    optimizers.install()
    fake.install()
    if registry._COMPILER_FNS.get("tpu") is tpu_backend:
        return
    registry._COMPILER_FNS.pop("tpu", None)
    registry._BACKENDS.pop("tpu", None)  # an entry point's placeholder: replaced by the function itself
    registry.register_backend(tpu_backend, name="tpu")


def __getattr__(name):
    if name == "stats":  # graph.py imports JAX: only when asked
        from torch_tpu.compile.graph import stats

        return stats
    raise AttributeError(f"module 'torch_tpu.compile' has no attribute {name!r}")


if "torch._dynamo" in sys.modules:
    register()

__all__ = ["Options", "decompositions", "register", "skip_library_frames", "stats", "tpu_backend"]
