"""Autocast on "tpu": `torch.autocast("tpu", dtype=torch.bfloat16)` follows CUDA's rules.

Owns: the autocast defaults of the "tpu" device and the introspection of its
autocast kernels. The kernels themselves are C++ (csrc/autocast.cpp): PyTorch's
own CUDA op lists from ATen/autocast_mode.h, registered on the
AutocastPrivateUse1 dispatch key, with PyTorch's casting and weight cache:

    lower_precision_fp   matmul, linear, conv*, bmm, addmm, baddbmm, einsum,
                         scaled_dot_product_attention, rnn cells, prelu, ...
                         run in the autocast dtype
    fp32                 exp, log, pow, softmax, log_softmax, sum, cumsum, prod,
                         layer_norm, group_norm, norms, losses, upsampling, ...
                         run in float32
    promote              addcmul, addcdiv, atan2, dot, vdot, cross, index_put,
                         scatter_add, tensordot, ... run in the widest input dtype
    banned               binary_cross_entropy (use ..._with_logits), as on CUDA

Every other op runs unchanged. Does not own: the float32 matmul precision
(precision.py), which applies to whatever stays float32.
"""
from __future__ import annotations

import torch

# TPU matrix units take bfloat16 natively; float16 is accepted but not native.
DEFAULT_DTYPE = torch.bfloat16


def set_default_dtype() -> None:
    """Make bfloat16 the dtype of `torch.autocast("tpu")` without dtype= (PyTorch keeps it per thread)."""
    torch.set_autocast_dtype("tpu", DEFAULT_DTYPE)


def ops(key: str = "AutocastPrivateUse1") -> set[str]:
    """Names ("aten::mm", "aten::norm.Scalar", ...) of the ops with a kernel on an autocast dispatch key.

    The default lists the "tpu" autocast ops; `ops("AutocastCUDA")` lists CUDA's.
    """
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return {name for name in torch._C._dispatch_get_all_op_names() if has(name, key)}
