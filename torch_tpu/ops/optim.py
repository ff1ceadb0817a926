"""Fused optimizer steps: `torch._fused_adamw_` / `torch._fused_adam_` (`torch.optim.AdamW(fused=True)`,
the Hugging Face Trainer's default `adamw_torch_fused`).

Lowered on the functional overloads (new params, grads, moments); the in-place ops the optimizer
calls are derived from them (eager/opspec.py). Follows PyTorch's fused kernel: the step counts have
already been incremented, gradients are unscaled by `grad_scale` (and stored unscaled), and a
nonzero `found_inf` skips the step. `lr` is a runtime input: a scheduler changes it every step.
"""
from __future__ import annotations

import jax.numpy as jnp

from torch_tpu.ops.registry import aten, lowers


def _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
          amsgrad, maximize, grad_scale, found_inf, decoupled):
    new_p, new_g, new_m, new_v, new_max = [], [], [], [], []
    skip = None if found_inf is None else jnp.reshape(found_inf, ()) != 0
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        opmath = jnp.float32 if p.dtype in (jnp.bfloat16, jnp.float16) else p.dtype
        p32, g32, m32, v32 = (x.astype(opmath) for x in (p, g, m, v))
        if grad_scale is not None:
            g32 = g32 / jnp.reshape(grad_scale, ()).astype(opmath)
        stored_grad = g32.astype(g.dtype)
        if maximize:
            g32 = -g32
        if weight_decay != 0:
            if decoupled:
                p32 = p32 * (1 - lr * weight_decay)
            else:
                g32 = g32 + weight_decay * p32
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
        out = (p32.astype(p.dtype), stored_grad, m32.astype(m.dtype), v32.astype(v.dtype))
        if skip is not None:
            out = tuple(jnp.where(skip, old, new) for old, new in zip((p, g, m, v), out))
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
