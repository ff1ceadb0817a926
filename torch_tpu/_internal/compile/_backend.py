"""TorchTPU's `torch_tpu._internal.compile._backend.TpuBackend`: the "tpu" torch.compile backend as a class.

`TpuBackend(**options)(fx_graph, example_inputs)` is
`torch_tpu.compile.tpu_backend(fx_graph, example_inputs, **options)`, the
backend `torch.compile(backend="tpu")` uses (torch_tpu/compile, issue 14).
"""
from __future__ import annotations

__all__ = ["TpuBackend"]


class TpuBackend:
    """A Dynamo backend callable: `torch.compile(model, backend=TpuBackend())`."""

    def __init__(self, **options):
        self.options = options

    def __call__(self, fx_graph, example_inputs):
        from torch_tpu.compile import tpu_backend

        return tpu_backend(fx_graph, example_inputs, **self.options)

    def __repr__(self):
        return f"TpuBackend({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"
