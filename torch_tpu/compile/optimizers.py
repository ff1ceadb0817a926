"""Compiled optimizers on "tpu" keep their step counts on the device, as on CUDA.

When Dynamo traces an optimizer whose state is not initialized yet, it sets `capturable=True`
on every param group whose parameters are all on CUDA or XPU (OptimizerVariable._set_capturable,
torch/_dynamo/variables/optimizer.py): the state's `step` counts are then created on the device
and the whole update, bias corrections included, is one graph. Its test is `p.is_cuda or
p.is_xpu`, so a tpu optimizer kept its step counts on the CPU, and every compiled step computed
their bias corrections with PyTorch CPU ops between graph launches (the plan's host steps,
plan.py), ~1.4 ms of CPU per step of the demo GPT's AdamW on a 2-core host. A tpu group gets
what a CUDA group gets: `install()` wraps that method to set `capturable=True` on groups whose
parameters are all on "tpu" (a capturable device for torch.optim: the PrivateUse1 backend is in
`torch.optim.optimizer._get_capturable_supported_devices()`), under the same condition.

As on CUDA, the group keeps `capturable=True` after compiling (an eager step afterwards takes the
capturable path), and an optimizer whose state already exists (an eager step before compiling, a
loaded checkpoint) keeps its CPU step counts: those run as host steps.

Imports torch._dynamo: called by `torch_tpu.compile.register()`.
"""
from __future__ import annotations

_original = None


def install() -> bool:
    """Make Dynamo set `capturable=True` on uninitialized tpu param groups (idempotent); False if the
    torch version has no such hook."""
    global _original
    if _original is not None:
        return True
    try:
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:
        return False
    original = getattr(OptimizerVariable, "_set_capturable", None)
    if original is None:
        return False

    def _set_capturable(self, tx):
        optimizer = self.value
        for group in optimizer.param_groups:
            params = group.get("params", [])
            if ("capturable" in group and params and all(p.device.type == "tpu" for p in params)
                    and all(p not in optimizer.state for p in params)):
                group["capturable"] = True
        return original(self, tx)

    _set_capturable.__wrapped__ = original
    OptimizerVariable._set_capturable = _set_capturable
    _original = original
    return True


def uninstall() -> None:
    """Dynamo's own choice again (CUDA and XPU groups only)."""
    global _original
    if _original is not None:
        from torch._dynamo.variables.optimizer import OptimizerVariable

        OptimizerVariable._set_capturable = _original
        _original = None
