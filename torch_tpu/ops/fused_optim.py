"""The fused optimizer steps (`torch.optim.Adam/AdamW/SGD/Adagrad(fused=True)`), one program each.

Registered on the functional ops (`_fused_adamw` ...); the in-place `_fused_adamw_` the
optimizers call is derived from them (eager/opspec.py). The math follows PyTorch's fused
CPU kernels element for element: `grad_scale` unscales the gradients and writes them back,
a `found_inf` of 1 leaves every list unchanged (GradScaler's skipped step), the step count
is read from `state_steps` (the optimizer increments it before the call), and the lists
are computed in float32 ("opmath") for low-precision parameters.
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers

_OPMATH = (jnp.float16, jnp.bfloat16)


def _up(x):
    return x.astype(jnp.float32) if x.dtype in _OPMATH else x


def _unscale(grad, grad_scale):
    return grad if grad_scale is None else grad / grad_scale.astype(grad.dtype)


def _skip(found_inf, old: list, new: list) -> list:
    """GradScaler skipped the step: every output is its input unchanged."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) == 1
    return [jnp.where(skip, o, n.astype(o.dtype)) for o, n in zip(old, new)]


def _adam(adamw, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
          weight_decay, eps, amsgrad, maximize, grad_scale, found_inf):
    outs = ([], [], [], [], [])
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        vmax = max_exp_avg_sqs[i] if amsgrad else None
        p32, m32, v32 = _up(p), _up(m), _up(v)
        lr_ = jnp.asarray(lr, p32.dtype).reshape(())
        g_out = _unscale(g, grad_scale)
        grad = _up(g_out)
        if maximize:
            grad = -grad
        if weight_decay != 0:
            if adamw:
                p32 = p32 - lr_ * weight_decay * p32
            else:
                grad = grad + p32 * weight_decay
        step = jnp.asarray(step, jnp.float32).reshape(())
        bias_correction1 = 1 - jnp.power(jnp.float32(beta1), step)
        bias_correction2_sqrt = jnp.sqrt(1 - jnp.power(jnp.float32(beta2), step))
        m32 = m32 + (1 - beta1) * (grad - m32)
        v32 = v32 * beta2 + (1 - beta2) * grad * grad
        if amsgrad:
            vmax32 = jnp.maximum(_up(vmax), v32)
            denom = jnp.sqrt(vmax32) / bias_correction2_sqrt.astype(p32.dtype) + eps
        else:
            denom = jnp.sqrt(v32) / bias_correction2_sqrt.astype(p32.dtype) + eps
        p32 = p32 - (lr_ / bias_correction1.astype(p32.dtype)) * m32 / denom
        old = [p, g, m, v] + ([vmax] if amsgrad else [])
        new = [p32, g_out, m32, v32] + ([vmax32] if amsgrad else [])
        for out, value in zip(outs, _skip(found_inf, old, new)):
            out.append(value)
    if not amsgrad:  # untouched (PyTorch passes an empty list then)
        outs[4].extend(max_exp_avg_sqs)
    return outs


# `lr` is a runtime scalar (schedulers change it every step); tensor_lr overloads get it as an array.
@lowers(aten._fused_adam.default, runtime=("lr",))
def fused_adam(*args):
    return _adam(False, *args)


@lowers(aten._fused_adam.tensor_lr)
def fused_adam_tensor_lr(*args):
    return _adam(False, *args)


@lowers(aten._fused_adamw.default, runtime=("lr",))
def fused_adamw(*args):
    return _adam(True, *args)


@lowers(aten._fused_adamw.tensor_lr)
def fused_adamw_tensor_lr(*args):
    return _adam(True, *args)


@lowers(aten._fused_sgd.default, runtime=("lr",))
def fused_sgd(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov, maximize,
              is_first_step, grad_scale, found_inf):
    outs = ([], [], [])
    for i, (p, g) in enumerate(zip(params, grads)):
        buf = momentum_buffers[i] if momentum != 0 else None
        p32 = _up(p)
        lr_ = jnp.asarray(lr, p32.dtype).reshape(())
        g_out = _unscale(g, grad_scale)
        grad = _up(g_out)
        if maximize:
            grad = -grad
        if weight_decay != 0:
            grad = grad + p32 * weight_decay
        if momentum != 0:
            buf32 = grad if is_first_step else _up(buf) * momentum + (1 - dampening) * grad
            grad = grad + momentum * buf32 if nesterov else buf32
        p32 = p32 - lr_ * grad
        old = [p, g] + ([buf] if momentum != 0 else [])
        new = [p32, g_out] + ([buf32] if momentum != 0 else [])
        for out, value in zip(outs, _skip(found_inf, old, new)):
            out.append(value)
    if momentum == 0:
        outs[2].extend(momentum_buffers)
    return outs


@lowers(aten._fused_sgd.tensor_lr)
def fused_sgd_tensor_lr(*args):
    return fused_sgd(*args)


def _adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,
             found_inf):
    outs = ([], [], [])
    for p, g, s, step in zip(params, grads, state_sums, state_steps):
        p32, s32 = _up(p), _up(s)
        lr_ = jnp.asarray(lr, p32.dtype).reshape(())
        g_out = _unscale(g, grad_scale)
        grad = _up(g_out)
        if maximize:
            grad = -grad
        if weight_decay != 0:
            grad = grad + p32 * weight_decay
        step = jnp.asarray(step, p32.dtype).reshape(())
        clr = lr_ / (1 + (step - 1) * lr_decay)
        s32 = s32 + grad * grad
        p32 = p32 - clr * grad / (jnp.sqrt(s32) + eps)
        for out, value in zip(outs, _skip(found_inf, [p, g, s], [p32, g_out, s32])):
            out.append(value)
    return outs


@lowers(aten._fused_adagrad.default, runtime=("lr",))
def fused_adagrad(*args):
    # This overload also lists state_steps as written; the kernel leaves them as they are.
    return (*_adagrad(*args), list(args[3]))


@lowers(aten._fused_adagrad.tensor_lr)
def fused_adagrad_tensor_lr(*args):
    return _adagrad(*args)
