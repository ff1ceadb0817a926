"""`torch.compile(model)` with the default backend: graphs over tpu tensors go to the "tpu" backend.

The default backend is Inductor, and Inductor's code generator for device "tpu" (Pallas)
imports modules of the system we model; graphs over tpu tensors must not reach it. The
system we model routes them to its own backend, and so do we: `torch.compile` wraps its
default backend in `torch._TorchCompileInductorWrapper` (also for `backend="inductor"`),
whose `__call__(gm, example_inputs)` is the one place every such graph passes. `install()`
wraps that method: a graph with a tensor input on "tpu" goes to `tpu_backend`, any other
graph to Inductor, unchanged. PyTorch has no public per-device hook for this (Inductor's
`register_backend_for_device` picks a code generator, below AOTAutograd and graph
partitioning), so this one private method is wrapped, only on the torch versions it was
checked on; its `__init__` (run by `torch.compile`, before tracing) is wrapped to register
"tpu" with Dynamo, whose hooks act while tracing (compile/optimizers.py).
`torch._dynamo.optimize("inductor")` calls Inductor directly and is not routed.

Importing this module imports nothing heavy (no torch._dynamo, no JAX).
"""
from __future__ import annotations

import torch

# Checked on these torch versions (major, minor); elsewhere the default backend is left alone.
SUPPORTED = ((2, 11), (2, 12), (2, 13))

_original = None


def supported() -> bool:
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    return version in SUPPORTED and wrapper is not None and callable(getattr(wrapper, "__call__", None))


def on_tpu(example_inputs) -> bool:
    """Whether a graph's inputs include a tensor on "tpu" (Dynamo hands FakeTensors with their device)."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in example_inputs)


def install() -> bool:
    """Route the default backend's tpu graphs to the "tpu" backend (idempotent); False where unsupported."""
    global _original
    if _original is not None:
        return True
    if not supported():
        return False
    wrapper = torch._TorchCompileInductorWrapper
    original, original_init = wrapper.__call__, wrapper.__init__

    def __init__(self, *args, **kwargs):
        # torch.compile(...) made this wrapper, so Dynamo is imported: register "tpu" now, before
        # tracing (its Dynamo hooks, such as capturable tpu optimizers, act while tracing).
        from torch_tpu.compile import register

        register()
        original_init(self, *args, **kwargs)

    def __call__(self, model_, inputs_, **kwargs):
        if on_tpu(inputs_):
            from torch_tpu.compile import register, tpu_backend

            register()  # idempotent (a wrapper made before `import torch_tpu` skipped __init__'s)
            return tpu_backend(model_, inputs_)
        return original(self, model_, inputs_, **kwargs)

    __call__.__wrapped__ = original
    __init__.__wrapped__ = original_init
    wrapper.__call__, wrapper.__init__ = __call__, __init__
    _original = original, original_init
    return True


def uninstall() -> None:
    """Give Inductor every graph again."""
    global _original
    if _original is not None:
        torch._TorchCompileInductorWrapper.__call__, torch._TorchCompileInductorWrapper.__init__ = _original
        _original = None


def installed() -> bool:
    return _original is not None
