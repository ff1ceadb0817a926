"""FlexAttention (`torch.nn.attention.flex_attention`) on "tpu" (docs/compile.md).

PyTorch checks a fixed list of devices before it runs FlexAttention (`_validate_device`: cuda, cpu,
xpu, hpu, mps) and raises ValueError for any other, although the dense implementation of its
higher-order ops (their CompositeExplicitAutograd kernels: PyTorch's own math over ATen ops, forward
and backward, score_mod and block masks included) runs on every device. `install()` lets "tpu"
through that one check; every other device is checked as before. Eager runs the dense implementation
op by op (DeferAndFuse fuses it); under torch.compile the higher-order ops are planned inline as that
implementation (compile/plan.py), in the same XLA program as the rest of the graph.

Owns: the device check's exception for "tpu". Importing this module imports nothing heavy.
"""
from __future__ import annotations

_original = None


def install() -> bool:
    """Let tpu tensors through FlexAttention's device check (idempotent); False where PyTorch has none."""
    global _original
    if _original is not None:
        return True
    from torch.nn.attention import flex_attention as flex

    original = getattr(flex, "_validate_device", None)
    if original is None:
        return False

    def _validate_device(query, key, value):
        if query.device.type != "tpu":
            original(query, key, value)

    _original = original
    flex._validate_device = _validate_device
    return True
