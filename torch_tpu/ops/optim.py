"""Fused optimizer steps: `torch._fused_adamw_` / `_fused_adam_` / `_fused_sgd_` / `_fused_adagrad_`
(`torch.optim.AdamW/Adam/SGD/Adagrad(fused=True)`, the Hugging Face Trainer's default `adamw_torch_fused`).

Lowered on the functional overloads (new params, grads, moments); the in-place ops the optimizer
calls are derived from them (eager/opspec.py). Follows PyTorch's fused kernel: the step counts have
already been incremented, gradients are unscaled by `grad_scale` (and stored unscaled), and a
nonzero `found_inf` skips the step (every list unchanged). `lr` is a runtime input: a scheduler
changes it every step; the `tensor_lr` overloads take it as an array.
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers


def _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
          amsgrad, maximize, grad_scale, found_inf, decoupled):
    new_p, new_g, new_m, new_v, new_max = [], [], [], [], []
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        opmath, p32, g32, stored_grad = _gradient(p, g, grad_scale, maximize, 0 if decoupled else weight_decay)
        if decoupled and weight_decay != 0:
            p32 = p32 * (1 - lr * weight_decay)
        m32, v32 = m.astype(opmath), v.astype(opmath)
        m32 = m32 + (g32 - m32) * (1 - beta1)
        v32 = v32 * beta2 + (1 - beta2) * g32 * g32
        step = jnp.reshape(step, ()).astype(opmath)
        bias1 = 1 - jnp.power(jnp.asarray(beta1, opmath), step)
        bias2_sqrt = jnp.sqrt(1 - jnp.power(jnp.asarray(beta2, opmath), step))
        if amsgrad:
            vmax = jnp.maximum(max_exp_avg_sqs[i].astype(opmath), v32)
            denom = jnp.sqrt(vmax) / bias2_sqrt + eps
            new_max.append(vmax.astype(max_exp_avg_sqs[i].dtype))
        else:
            denom = jnp.sqrt(v32) / bias2_sqrt + eps
            if i < len(max_exp_avg_sqs):
                new_max.append(max_exp_avg_sqs[i])
        p32 = p32 - (lr / bias1) * m32 / denom
        out = _skipped(found_inf, (p, g, m, v),
                       (p32.astype(p.dtype), stored_grad, m32.astype(m.dtype), v32.astype(v.dtype)))
        for lst, x in zip((new_p, new_g, new_m, new_v), out):
            lst.append(x)
    return new_p, new_g, new_m, new_v, new_max


@lowers(aten._fused_adamw.default, runtime=("lr",))
def fused_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled=True)


@lowers(aten._fused_adam.default, runtime=("lr",))
def fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
               weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled=False)


def _lr(lr):
    """A `tensor_lr` overload's learning rate (a one-element tensor) as a scalar."""
    return jnp.reshape(lr, ())


@lowers(aten._fused_adamw.tensor_lr)
def fused_adamw_tensor_lr(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                          weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, _lr(lr), beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled=True)


@lowers(aten._fused_adam.tensor_lr)
def fused_adam_tensor_lr(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                         weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, _lr(lr), beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled=False)


def _gradient(p, g, grad_scale, maximize, weight_decay):
    """Every fused step's prologue: (opmath dtype, p in it, the gradient in it unscaled, negated for
    maximize and with L2 weight decay added, the unscaled gradient as the kernel stores it back)."""
    opmath = jnp.float32 if p.dtype in (jnp.bfloat16, jnp.float16) else p.dtype
    p32, g32 = p.astype(opmath), g.astype(opmath)
    if grad_scale is not None:
        g32 = g32 / jnp.reshape(grad_scale, ()).astype(opmath)
    stored_grad = g32.astype(g.dtype)
    if maximize:
        g32 = -g32
    if weight_decay != 0:
        g32 = g32 + weight_decay * p32
    return opmath, p32, g32, stored_grad


def _skipped(found_inf, old, new):
    """GradScaler found an inf/nan: the step leaves every list as it was."""
    if found_inf is None:
        return new
    skip = jnp.reshape(found_inf, ()) != 0
    return tuple(jnp.where(skip, o, n) for o, n in zip(old, new))


@lowers(aten._fused_sgd.default, runtime=("lr",))
def fused_sgd(params, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov, maximize,
              is_first_step, grad_scale=None, found_inf=None):
    new_p, new_g, new_buf = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        opmath, p32, g32, stored_grad = _gradient(p, g, grad_scale, maximize, weight_decay)
        old, new = [p, g], [None, stored_grad]
        if momentum != 0:
            buf = momentum_buffer_list[i]
            buf32 = g32 if is_first_step else buf.astype(opmath) * momentum + (1 - dampening) * g32
            g32 = g32 + momentum * buf32 if nesterov else buf32
            old.append(buf)
            new.append(buf32.astype(buf.dtype))
        new[0] = (p32 - lr * g32).astype(p.dtype)
        out = _skipped(found_inf, old, new)
        new_p.append(out[0])
        new_g.append(out[1])
        new_buf.append(out[2] if momentum != 0 else momentum_buffer_list[i] if i < len(momentum_buffer_list) else None)
    return new_p, new_g, [b for b in new_buf if b is not None]


@lowers(aten._fused_sgd.tensor_lr)
def fused_sgd_tensor_lr(params, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov,
                        maximize, is_first_step, grad_scale=None, found_inf=None):
    return fused_sgd(params, grads, momentum_buffer_list, weight_decay, momentum, _lr(lr), dampening, nesterov,
                     maximize, is_first_step, grad_scale, found_inf)


def _adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,
             found_inf):
    new_p, new_g, new_s = [], [], []
    for p, g, s, step in zip(params, grads, state_sums, state_steps):
        opmath, p32, g32, stored_grad = _gradient(p, g, grad_scale, maximize, weight_decay)
        s32 = s.astype(opmath)
        clr = lr / (1 + (jnp.reshape(step, ()).astype(opmath) - 1) * lr_decay)
        s32 = s32 + g32 * g32
        p32 = p32 - clr * g32 / (jnp.sqrt(s32) + eps)
        out = _skipped(found_inf, (p, g, s), (p32.astype(p.dtype), stored_grad, s32.astype(s.dtype)))
        for lst, x in zip((new_p, new_g, new_s), out):
            lst.append(x)
    return new_p, new_g, new_s


@lowers(aten._fused_adagrad.default, runtime=("lr",))
def fused_adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize,
                  grad_scale=None, found_inf=None):
    # This overload's schema marks state_steps written; the kernel leaves them as they are.
    return (*_adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize,
                      grad_scale, found_inf), list(state_steps))


@lowers(aten._fused_adagrad.tensor_lr)
def fused_adagrad_tensor_lr(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize,
                            grad_scale=None, found_inf=None):
    return _adagrad(params, grads, state_sums, state_steps, _lr(lr), lr_decay, weight_decay, eps, maximize,
                    grad_scale, found_inf)
