"""Normalization layers and their backward kernels: batch, layer and group norm.

`F.batch_norm` reaches the backend as `native_batch_norm` (through the
composite `_batch_norm_impl_index`); instance norm is batch norm over a
(1, N*C, ...) view. NOTE(torch-vs-xla): `native_batch_norm`'s schema does not
mark running_mean/running_var as written, but its kernels update them in
place; the lowering declares them (`mutates=`) so the executor writes the new
running statistics back in the same program. The torch.compile / export forms
(`_native_batch_norm_legit*`, `_batch_norm_with_update*`, `_batch_norm_no_update`)
share the same math. rms_norm is CompositeImplicitAutograd in PyTorch: it
decomposes into ops lowered elsewhere before reaching "tpu".

Statistics are computed in float32 for float16/bfloat16 inputs, like PyTorch.
The saved statistics they return follow PyTorch's CPU kernels, not its meta
kernels (which follow CUDA's): see `_cpu_stats`.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from torch_tpu.ops.registry import aten, lowers

_F32 = jnp.float32


def _opmath(x):
    return x.astype(_F32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _channel(v, ndim):
    """A per-channel (C,) vector shaped to broadcast against (N, C, ...)."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


# ---------------------------------------------------------------- saved statistics
# NOTE(torch-vs-xla): the meta kernels (our output metadata, eager and compiled) give CUDA's saved
# statistics: float32 for low-precision inputs, and (C,) in eval mode. PyTorch's CPU kernels save them
# in the parameters' dtype -- float32 only in "mixed type" (a bfloat16/float16 input with float32
# parameters), the input's dtype otherwise -- and save nothing ((0,)) in eval mode. We follow the CPU:
# the backward lowerings read only the running statistics in eval mode and upcast saved ones.
def _cpu_stats(results, x, params, eval_mode=False, running=()):
    """`results` (a meta run) with its saved statistics (results 1, 2) as PyTorch's CPU saves them, and
    the new running statistics of a functional form (its last results) in the running statistics' dtype."""
    import torch

    low = x.dtype in (torch.bfloat16, torch.float16)
    mixed = low and any(p is not None and p.dtype != x.dtype for p in params)
    results = list(results)
    for i in (1, 2):
        shape = (0,) if eval_mode else results[i].shape
        results[i] = results[i].new_empty(shape, dtype=torch.float32 if mixed else x.dtype)
    for i, stat in zip(range(len(results) - len(running), len(results)), running):
        results[i] = results[i].new_empty(results[i].shape, dtype=stat.dtype)
    return tuple(results)


def _functional(op):
    return op._schema.name.endswith("_functional")


def _meta_batch_norm(op):
    def meta(x, weight, bias, running_mean, running_var, training, momentum, eps):
        results = op(x, weight, bias, running_mean, running_var, training, momentum, eps)
        return _cpu_stats(results, x, (weight, bias, running_mean, running_var), eval_mode=not training,
                          running=(running_mean, running_var) if _functional(op) else ())

    return meta


def _meta_no_stats(x, weight, bias, training, momentum, eps):
    # No running statistics: normalized with the batch's own, whatever `training` says.
    return _cpu_stats(aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps), x,
                      (weight, bias))


def _meta_fixed_mode(op, eval_mode):
    def meta(x, weight, bias, running_mean, running_var, momentum, eps):
        results = op(x, weight, bias, running_mean, running_var, momentum, eps)
        return _cpu_stats(results, x, (weight, bias, running_mean, running_var),
                          eval_mode=eval_mode and running_mean is not None,
                          running=(running_mean, running_var) if _functional(op) else ())

    return meta


def _meta_out(op):
    def meta(x, weight, bias, running_mean, running_var, training, momentum, eps, out, save_mean, save_invstd):
        op(x, weight, bias, running_mean, running_var, training, momentum, eps, out=out, save_mean=save_mean,
           save_invstd=save_invstd)
        if not training:  # out= tensors keep their dtype; in eval mode CPU resizes the saved ones to (0,)
            save_mean.resize_(0)
            save_invstd.resize_(0)
        return out, save_mean, save_invstd

    return meta


# ---------------------------------------------------------------- batch norm
def _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var); running stats None if absent."""
    a = _opmath(x)
    axes = (0,) + tuple(range(2, x.ndim))
    if training:
        mean = jnp.mean(a, axis=axes)
        var = jnp.mean(jnp.square(a - _channel(mean, x.ndim)), axis=axes)
        invstd = lax.rsqrt(var + eps)
        n = math.prod(x.shape[d] for d in axes)
        new_mean = new_var = None
        if running_mean is not None:
            new_mean = ((1 - momentum) * _opmath(running_mean) + momentum * mean).astype(running_mean.dtype)
        if running_var is not None:
            unbiased = var * (n / max(n - 1, 1))
            new_var = ((1 - momentum) * _opmath(running_var) + momentum * unbiased).astype(running_var.dtype)
    else:
        mean = _opmath(running_mean)
        invstd = lax.rsqrt(_opmath(running_var) + eps)
        new_mean, new_var = running_mean, running_var
    out = (a - _channel(mean, x.ndim)) * _channel(invstd, x.ndim)
    if weight is not None:
        out = out * _channel(_opmath(weight), x.ndim)
    if bias is not None:
        out = out + _channel(_opmath(bias), x.ndim)
    if not training:  # CPU saves no statistics in eval mode (_cpu_stats)
        mean = invstd = jnp.zeros((0,), _F32)
    return out.astype(x.dtype), mean, invstd, new_mean, new_var


@lowers(aten.native_batch_norm.default, mutates=("running_mean", "running_var"), runtime=("momentum",),
        meta=_meta_batch_norm(aten.native_batch_norm.default))
def native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)


@lowers(aten._native_batch_norm_legit.default, runtime=("momentum",),
        meta=_meta_batch_norm(aten._native_batch_norm_legit.default))
@lowers(aten._native_batch_norm_legit_functional.default, runtime=("momentum",),
        meta=_meta_batch_norm(aten._native_batch_norm_legit_functional.default))
def native_batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)


@lowers(aten._native_batch_norm_legit.out, runtime=("momentum",), meta=_meta_out(aten._native_batch_norm_legit.out))
@lowers(aten.native_batch_norm.out, mutates=("running_mean", "running_var"), runtime=("momentum",),
        meta=_meta_out(aten.native_batch_norm.out))
def batch_norm_out(x, weight, bias, running_mean, running_var, training, momentum, eps, out, save_mean, save_invstd):
    # Out= ops that also write the running statistics (no functional counterpart to derive them from):
    # registered directly, they return each written argument's new value, in argument order.
    out, mean, invstd, new_mean, new_var = _batch_norm(x, weight, bias, running_mean, running_var, training, momentum,
                                                       eps)
    return new_mean, new_var, out, mean, invstd


@lowers(aten._native_batch_norm_legit.no_stats, runtime=("momentum",), meta=_meta_no_stats)
def native_batch_norm_legit_no_stats(x, weight, bias, training, momentum, eps):
    return _batch_norm(x, weight, bias, None, None, True, momentum, eps)[:3]


@lowers(aten._native_batch_norm_legit_no_training.default, runtime=("momentum",),
        meta=_meta_fixed_mode(aten._native_batch_norm_legit_no_training.default, eval_mode=True))
def native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


def _no_reserve():
    return jnp.zeros((0,), jnp.uint8)  # the cuDNN reserve space PyTorch's schema carries


@lowers(aten._batch_norm_with_update.default, runtime=("momentum",),
        meta=_meta_fixed_mode(aten._batch_norm_with_update.default, eval_mode=False))
@lowers(aten._batch_norm_with_update_functional.default, runtime=("momentum",),
        meta=_meta_fixed_mode(aten._batch_norm_with_update_functional.default, eval_mode=False))
def batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, invstd, new_mean, new_var = _batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, invstd, _no_reserve(), new_mean, new_var


@lowers(aten._batch_norm_no_update.default, runtime=("momentum",),
        meta=_meta_fixed_mode(aten._batch_norm_no_update.default, eval_mode=True))
def batch_norm_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None:  # no running statistics: normalize with the batch's own
        return (*_batch_norm(x, weight, bias, None, None, True, momentum, eps)[:3], _no_reserve())
    return (*_batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)[:3], _no_reserve())


def _batch_norm_grads(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    g, a = _opmath(grad), _opmath(x)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = _opmath(running_mean), lax.rsqrt(_opmath(running_var) + eps)
    xhat = (a - _channel(mean, x.ndim)) * _channel(invstd, x.ndim)
    w = jnp.ones((x.shape[1],), _F32) if weight is None else _opmath(weight)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        gw = g * _channel(w * invstd, x.ndim)
        if train:
            n = math.prod(x.shape[d] for d in axes)
            mean_g = jnp.sum(g, axis=axes) / n
            mean_gx = jnp.sum(g * xhat, axis=axes) / n
            gw = (g - _channel(mean_g, x.ndim) - xhat * _channel(mean_gx, x.ndim)) * _channel(w * invstd, x.ndim)
        grad_input = gw
    if output_mask[1]:
        grad_weight = jnp.sum(g * xhat, axis=axes)
    if output_mask[2]:
        grad_bias = jnp.sum(g, axis=axes)
    return grad_input, grad_weight, grad_bias


def _meta_masked_backward(op):
    """PyTorch's meta result with None where `output_mask` (argument 9) is False: ATen's CPU and CUDA kernels leave
    those gradients undefined (an input that does not require grad), where the meta kernel allocates them."""
    def meta(*args):
        return tuple(r if wanted else None for r, wanted in zip(op(*args), args[9]))

    return meta


@lowers(aten.native_batch_norm_backward.default, meta=_meta_masked_backward(aten.native_batch_norm_backward.default))
def native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                               output_mask):
    return _batch_norm_grads(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                             output_mask)


@lowers(aten.batch_norm_backward.default, meta=_meta_masked_backward(aten.batch_norm_backward.default))
def batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask,
                        reserve):
    # `update` is False only for _batch_norm_no_update with running statistics (eval mode).
    train = update or running_mean is None
    return _batch_norm_grads(grad, x, weight, running_mean, running_var, save_mean, save_var, train, eps,
                             output_mask)


# ---------------------------------------------------------------- layer norm
def _meta_layer_norm(x, normalized_shape, weight, bias, eps):
    return _cpu_stats(aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps), x, (weight, bias))


@lowers(aten.native_layer_norm.default, meta=_meta_layer_norm)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    a = _opmath(x)
    mean = jnp.mean(a, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(a - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (a - mean) * rstd
    if weight is not None:
        out = out * _opmath(weight)
    if bias is not None:
        out = out + _opmath(bias)
    return out, mean, rstd


@lowers(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    n_norm = len(normalized_shape)
    axes = tuple(range(x.ndim - n_norm, x.ndim))
    batch_axes = tuple(range(x.ndim - n_norm))
    g, a = _opmath(grad), _opmath(x)
    xhat = (a - mean) * rstd
    gw = g * _opmath(weight) if weight is not None else g
    n = math.prod(x.shape[d] for d in axes)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = rstd / n * (n * gw - jnp.sum(gw, axis=axes, keepdims=True)
                                 - xhat * jnp.sum(gw * xhat, axis=axes, keepdims=True))
    if output_mask[1] and weight is not None:
        grad_weight = jnp.sum(g * xhat, axis=batch_axes)
    if output_mask[2] and bias is not None:
        grad_bias = jnp.sum(g, axis=batch_axes)
    return grad_input, grad_weight, grad_bias


# ---------------------------------------------------------------- group norm
def _grouped(x, n, c, hxw, group):
    """(N, C, *) -> (N, group, C/group * HxW); sizes spelled out: a batch of 0 leaves no -1 to infer."""
    return x.reshape(n, group, c // group * hxw)


def _meta_group_norm(x, weight, bias, n, c, hxw, group, eps):
    return _cpu_stats(aten.native_group_norm.default(x, weight, bias, n, c, hxw, group, eps), x, (weight, bias))


@lowers(aten.native_group_norm.default, meta=_meta_group_norm)
def native_group_norm(x, weight, bias, n, c, hxw, group, eps):
    a = _grouped(_opmath(x), n, c, hxw, group)
    mean = jnp.mean(a, axis=-1)
    var = jnp.mean(jnp.square(a - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    out = ((a - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    if weight is not None:
        out = out * _channel(_opmath(weight), x.ndim)
    if bias is not None:
        out = out + _channel(_opmath(bias), x.ndim)
    return out, mean, rstd


def _meta_group_norm_backward(grad, x, mean, rstd, weight, n, c, hxw, group, output_mask):
    """Shapes as ATen's kernel (PyTorch's decomposition divides by HxW, so a 0-size spatial input raised)."""
    return (x.new_empty(x.shape) if output_mask[0] else None,
            x.new_empty((c,)) if output_mask[1] else None, x.new_empty((c,)) if output_mask[2] else None)


@lowers(aten.native_group_norm_backward.default, meta=_meta_group_norm_backward)
def native_group_norm_backward(grad, x, mean, rstd, weight, n, c, hxw, group, output_mask):
    g, a = _opmath(grad).reshape(n, c, hxw), _opmath(x).reshape(n, c, hxw)
    per_group = c // group
    mean_c = jnp.repeat(mean, per_group, axis=1)[..., None]  # (N, C, 1)
    rstd_c = jnp.repeat(rstd, per_group, axis=1)[..., None]
    xhat = (a - mean_c) * rstd_c
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        gw = g if weight is None else g * _opmath(weight)[None, :, None]
        m = per_group * hxw
        sum_gw = jnp.repeat(jnp.sum(_grouped(gw, n, c, hxw, group), axis=-1), per_group, axis=1)[..., None]
        sum_gwx = jnp.repeat(jnp.sum(_grouped(gw * xhat, n, c, hxw, group), axis=-1), per_group, axis=1)[..., None]
        grad_input = (rstd_c / m * (m * gw - sum_gw - xhat * sum_gwx)).reshape(x.shape)
    if output_mask[1]:
        grad_weight = jnp.sum(g * xhat, axis=(0, 2))
    if output_mask[2]:
        grad_bias = jnp.sum(g, axis=(0, 2))
    return grad_input, grad_weight, grad_bias
