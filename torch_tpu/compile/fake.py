"""Fake tensors on "tpu": output metadata where PyTorch's meta kernel checks another backend's limits.

Dynamo and AOTAutograd run every op on fake tensors first. For most ops PyTorch's meta kernel
describes the output, but a few check one backend's rules: `torch._grouped_mm` accepts bfloat16
only (CUDA's kernel), while CPU and tpu take every float dtype, so Transformers' MoE experts in
float32 failed in Dynamo before reaching the backend. The lowering table already says so for the
eager executors (`Lowering.meta`, ops/registry.py); `install()` gives Dynamo's fake tensors the
same answer for tpu inputs. Other devices keep PyTorch's meta kernel.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

_installed = False


def _lowering_meta(func):
    from torch_tpu.ops import registry

    lowering = registry.get(func) if isinstance(func, torch._ops.OpOverload) else None
    return None if lowering is None else lowering.meta


def _has_override(func) -> bool:
    return _lowering_meta(func) is not None


def _fake_on_tpu(fake_mode, func, *args, **kwargs):
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    flat = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]
    if not flat or any(t.fake_device.type != "tpu" for t in flat):
        return NotImplemented  # PyTorch's own meta kernel
    with in_kernel_invocation_manager(fake_mode):
        out = _lowering_meta(func)(*args, **kwargs)
    return fake_mode.wrap_meta_outputs_with_default_device_logic(out, func, flat, device=flat[0].fake_device)


def install() -> None:
    """Register the tpu fake-tensor rule with PyTorch's fake tensor mode (idempotent)."""
    global _installed
    if _installed:
        return
    from torch._subclasses import fake_impls

    fake_impls.op_implementations_checks.insert(0, (_has_override, _fake_on_tpu))
    _installed = True
