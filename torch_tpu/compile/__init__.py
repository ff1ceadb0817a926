"""torch.compile on "tpu": the Dynamo backend "tpu" (docs/compile.md).

`torch.compile(model, backend="tpu")`: Dynamo captures graphs, AOTAutograd makes the
forward and backward ATen graphs, and each graph runs as one XLA program built from the
lowering table the eager executors use. `torch.compile(model)` with the default backend
sends graphs over tpu tensors here too (routing.py).

Importing this module registers the backend with Dynamo (the `torch_dynamo_backends`
entry point does it for an installed package); it imports torch._dynamo.
"""
from __future__ import annotations

from torch_tpu.compile.backend import Options, decompositions, tpu_backend
from torch_tpu.compile.graph import stats


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if _BACKENDS.get("tpu") is not tpu_backend:
        _BACKENDS.pop("tpu", None)  # an entry point placeholder: replaced by the function itself
        register_backend(tpu_backend, name="tpu")


_register()

__all__ = ["Options", "decompositions", "stats", "tpu_backend"]
