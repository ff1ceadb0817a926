"""Convolutions: 1d/2d/3d, grouped, dilated, transposed, and their backward.

PyTorch routes every convolution through `aten.convolution` (autograd's
formula calls `aten.convolution_backward`); on a PrivateUse1 device its
composite kernel would call `convolution_overrideable`. We lower all four, so
`F.conv*d` and `F.conv_transpose*d` are one program forward and one backward.

The backward is written as convolutions itself (input grad = transposed conv,
weight grad = a conv that contracts over the batch), so every float32 product
runs at the float32 matmul precision (precision.conv_general_dilated), as on a TPU.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
from torch._prims_common import suggest_memory_format

from torch_tpu import precision
from torch_tpu.ops.registry import aten, lowers

# lax dimension numbers: PyTorch's layouts, and the batch<->channel swap the weight grad needs.
_LAYOUT = {1: ("NCH", "OIH", "NCH"), 2: ("NCHW", "OIHW", "NCHW"), 3: ("NCDHW", "OIDHW", "NCDHW")}
_WEIGHT_GRAD = {1: ("CNH", "IOH", "CNH"), 2: ("CNHW", "IOHW", "CNHW"), 3: ("CNDHW", "IODHW", "CNDHW")}


def _product(lhs, rhs, **kwargs):
    """lax.conv_general_dilated at the precision policy (bfloat16/float16: float32 results, rounded once later)."""
    return precision.conv_general_dilated(lhs, rhs, accumulator=True, **kwargs)


def _conv(x, w, stride, padding, dilation, groups):
    nd = x.ndim - 2
    return _product(x, w, window_strides=tuple(stride), padding=[(p, p) for p in padding],
                    rhs_dilation=tuple(dilation), dimension_numbers=_LAYOUT[nd], feature_group_count=groups)


def _conv_transpose(x, w, stride, padding, dilation, output_padding, groups):
    """The adjoint of a strided conv: dilate the input by the stride, convolve with the flipped kernel."""
    nd = x.ndim - 2
    kernel = w.shape[2:]
    c_in, c_out_g = w.shape[0], w.shape[1]
    # (C_in, O/g, k...) -> (O, C_in/g, k...), flipped in space.
    w = w.reshape(groups, c_in // groups, c_out_g, *kernel).swapaxes(1, 2)
    w = w.reshape(groups * c_out_g, c_in // groups, *kernel)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op) for k, p, d, op in zip(kernel, padding, dilation, output_padding)]
    return _product(x, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=tuple(stride),
                    rhs_dilation=tuple(dilation), dimension_numbers=_LAYOUT[nd], feature_group_count=groups)


def _weight_grad(x, grad, kernel, stride, padding, dilation, groups):
    """d/dw of conv(x, w): dW[o, c, k] = sum over batch and positions of grad[n, o, pos] * x[n, c, pos*s + k*d - p]."""
    nd = x.ndim - 2
    pads = [(p, (k - 1) * d + s * (y - 1) + 1 - n - p)
            for k, s, p, d, y, n in zip(kernel, stride, padding, dilation, grad.shape[2:], x.shape[2:])]
    return _product(x, grad, window_strides=tuple(dilation), padding=pads, rhs_dilation=tuple(stride),
                    dimension_numbers=_WEIGHT_GRAD[nd], batch_group_count=groups)


def _spatial(nd, *params):
    """stride/padding/dilation/output_padding, one number per spatial dim.

    PyTorch's kernels accept a single number for every dim (`padding=(1,)` on a conv3d) and
    expand it (expand_param_if_needed); lax wants one per dim.
    """
    out = []
    for p in params:
        p = tuple(p) if isinstance(p, (tuple, list)) else (p,)
        out.append(p * nd if len(p) == 1 else p)
    return out


def _bias_shape(x):
    return (1, -1) + (1,) * (x.ndim - 2)


def _meta_convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """PyTorch's meta kernel, with CUDA's output layout: channels-last when the input or the weight is
    (cudnn_conv_suggest_memory_format; the meta kernel follows the input only on other devices)."""
    out = aten.convolution.default(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(out.ndim)
    if layout is not None and layout in (suggest_memory_format(x), suggest_memory_format(w)):
        out = out.contiguous(memory_format=layout)
    return out


@lowers(aten.convolution.default, aten.convolution_overrideable.default, precision=True, meta=_meta_convolution)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    stride, padding, dilation, output_padding = _spatial(x.ndim - 2, stride, padding, dilation, output_padding)
    # ATen's shape check (PyTorch's meta kernel lets a short negative padding list through).
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if transposed and any(p < 0 for p in output_padding):
        raise RuntimeError("negative output_padding is not supported")
    if transposed:
        out = _conv_transpose(x, w, stride, padding, dilation, output_padding, groups)
    else:
        out = _conv(x, w, stride, padding, dilation, groups)
        if x.shape[1] == 0:  # ATen: an input with no channels gives an output with none (and no bias)
            return out[:, :0].astype(x.dtype)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape(_bias_shape(out))
    # Rounded once, to the input's dtype (convolution_overrideable has no meta kernel to say so).
    return out.astype(x.dtype)


@lowers(aten.convolution_backward.default, precision=True)
def convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask):
    stride, padding, dilation, output_padding = _spatial(x.ndim - 2, stride, padding, dilation, output_padding)
    kernel = w.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if not transposed and x.shape[1] == 0:  # the output has no channels (see convolution): zero gradients
        zeros = lambda shape, dtype, wanted: jnp.zeros(shape, dtype) if wanted else None
        return (zeros(x.shape, x.dtype, output_mask[0]), zeros(w.shape, w.dtype, output_mask[1]),
                zeros((w.shape[0],), grad.dtype, output_mask[2]))
    if transposed:
        if output_mask[0]:
            # An output_padding >= stride (allowed when < dilation) adds output rows no input reaches.
            grad_input = _conv(grad, w, stride, padding, dilation, groups)
            grad_input = grad_input[(Ellipsis,) + tuple(slice(0, n) for n in x.shape[2:])]
        if output_mask[1]:
            grad_weight = _weight_grad(grad, x, kernel, stride, padding, dilation, groups)
    else:
        if output_mask[0]:
            # The output_padding that makes the transposed conv give back the input's size.
            fit = [n - ((y - 1) * s - 2 * p + d * (k - 1) + 1)
                   for n, y, s, p, d, k in zip(x.shape[2:], grad.shape[2:], stride, padding, dilation, kernel)]
            grad_input = _conv_transpose(grad, w, stride, padding, dilation, fit, groups)
        if output_mask[1]:
            grad_weight = _weight_grad(x, grad, kernel, stride, padding, dilation, groups)
    if output_mask[2]:
        acc = jnp.float32 if grad.dtype in (jnp.bfloat16, jnp.float16) else grad.dtype
        grad_bias = jnp.sum(grad.astype(acc), axis=(0,) + tuple(range(2, grad.ndim))).astype(grad.dtype)
    return _cast(grad_input, x.dtype), _cast(grad_weight, w.dtype), grad_bias


def _cast(value, dtype):
    return None if value is None else value.astype(dtype)


@lowers(aten.convolution_backward_overrideable.default, precision=True)
def convolution_backward_overrideable(grad, x, w, stride, padding, dilation, transposed, output_padding, groups,
                                      output_mask):
    return convolution_backward(grad, x, w, None, stride, padding, dilation, transposed, output_padding, groups,
                                output_mask)
