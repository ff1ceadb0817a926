"""Activation functions and their backward kernels.

Activations PyTorch defines as composites (selu, relu6, softsign, tanhshrink,
silu/mish backward...) arrive here as their parts; the rest are lowered.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy import special as jsp

from torch_tpu.ops import _draws
from torch_tpu.ops.registry import Promote, aten, lowers


# ---------------------------------------------------------------- activations
@lowers(aten.relu.default, promote=Promote.DEFAULT)
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@lowers(aten.threshold.default)
def threshold(x, threshold, value):
    return jnp.where(x <= threshold, jnp.asarray(value).astype(x.dtype), x)


@lowers(aten.threshold_backward.default)
def threshold_backward(grad, x, threshold):
    return jnp.where(x <= threshold, jnp.zeros((), grad.dtype), grad)


@lowers(aten.gelu.default, promote=Promote.INT_TO_FLOAT)
def gelu(x, approximate="none"):
    if approximate == "tanh":
        return jax.nn.gelu(x, approximate=True)
    # PyTorch's formula, x/2 * (1 + erf(x/sqrt(2))), computed in float32 for half types as on CPU.
    # NOTE(xla-cpu): jax.nn.gelu's erfc form is more accurate in the far negative tail than
    # PyTorch (which rounds to 0 there), and XLA expands erfc into both of its branches for every
    # element: ~2.5x slower than erf on XLA:CPU, the most expensive pointwise op of a GPT block.
    wide = x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x
    return (wide * 0.5 * (1 + jsp.erf(wide * math.sqrt(0.5)))).astype(x.dtype)


@lowers(aten.gelu_backward.default, promote=Promote.INT_TO_FLOAT)
def gelu_backward(grad, x, approximate="none"):
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = k * (x + 0.044715 * x**3)
        t = jnp.tanh(inner)
        d_inner = k * (1 + 3 * 0.044715 * x**2)
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * d_inner)
    cdf = 0.5 * (1 + jsp.erf(x / math.sqrt(2)))
    pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return grad * (cdf + x * pdf)


@lowers(aten.silu.default, promote=Promote.INT_TO_FLOAT)
def silu(x):
    return x * jax.nn.sigmoid(x)


@lowers(aten.tanh_backward.default, promote=Promote.INT_TO_FLOAT)
def tanh_backward(grad, y):
    return grad * jnp.conj(1 - y * y)  # complex: the conjugate derivative (PyTorch's convention)


@lowers(aten.sigmoid_backward.default, promote=Promote.INT_TO_FLOAT)
def sigmoid_backward(grad, y):
    return grad * jnp.conj(y * (1 - y))


@lowers(aten.leaky_relu.default, promote=Promote.DEFAULT)
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


def _leaky_relu_backward_check(negative_slope, self_is_result):
    if self_is_result and negative_slope < 0:
        raise RuntimeError(
            "In-place leakyReLu backward calculation is triggered with a negative slope which is not supported. "
            "This is caused by calling in-place forward function with a negative slope, please call out-of-place "
            "version instead. File an issue at https://github.com/pytorch/pytorch if you do require supporting "
            "in-place leakRelu backward calculation with negative slope")


# Static scalars (a model's slope is a constant): the in-place check raises when the program is built.
@lowers(aten.leaky_relu_backward.default, promote=Promote.DEFAULT, promote_args=("grad_output", "self"),
        static_scalars=True)
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
    _leaky_relu_backward_check(negative_slope, self_is_result)
    return jnp.where(x > 0, grad, grad * negative_slope)


@lowers(aten.hardtanh.default, promote=Promote.DEFAULT)
def hardtanh(x, min_val=-1, max_val=1):
    return jnp.clip(x, min_val, max_val)


@lowers(aten.hardtanh_backward.default, promote=Promote.DEFAULT, promote_args=("grad_output", "self"))
def hardtanh_backward(grad, x, min_val, max_val):
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros((), grad.dtype), grad)


@lowers(aten.elu.default, promote=Promote.INT_TO_FLOAT)
def elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, alpha * scale * jnp.expm1(x * input_scale))


@lowers(aten.softplus.default, promote=Promote.INT_TO_FLOAT)
def softplus(x, beta=1, threshold=20):
    bx = x * beta
    return jnp.where(bx > threshold, x, jnp.log1p(jnp.exp(bx)) / beta)


@lowers(aten.mish.default, promote=Promote.INT_TO_FLOAT)
def mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@lowers(aten.hardsigmoid.default, promote=Promote.INT_TO_FLOAT)
def hardsigmoid(x):
    return jnp.clip(x / 6 + 0.5, 0, 1)


@lowers(aten.hardswish.default, promote=Promote.INT_TO_FLOAT)
def hardswish(x):
    return x * jnp.clip(x + 3, 0, 6) / 6



@lowers(aten.celu.default, promote=Promote.INT_TO_FLOAT)
def celu(x, alpha=1.0):
    return elu(x, alpha, 1, 1 / alpha)


@lowers(aten.softshrink.default, promote=Promote.DEFAULT)
def softshrink(x, lambd=0.5):
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, jnp.zeros((), x.dtype)))


@lowers(aten.hardshrink.default, promote=Promote.DEFAULT)
def hardshrink(x, lambd=0.5):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), x.dtype), x)


@lowers(aten.logit.default, promote=Promote.INT_TO_FLOAT)
def logit(x, eps=None):
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lowers(aten.glu.default)
def glu(x, dim=-1):
    a, b = jnp.split(x, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@lowers(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(x):
    # The second result is a CPU-kernel scratch buffer; nothing reads ours.
    return jax.nn.log_sigmoid(x), jnp.zeros(x.shape, x.dtype)


@lowers(aten._prelu_kernel.default, promote=Promote.DEFAULT)
def prelu_kernel(x, weight):
    return jnp.where(x > 0, x, weight * x)


@lowers(aten.rrelu_with_noise.default, rng=True, static_scalars=True)
def rrelu_with_noise(x, noise, lower=1 / 8, upper=1 / 3, training=False, generator=None, *, key):
    if not training:
        return jnp.where(x >= 0, x, x * ((lower + upper) / 2)), noise
    r = _draws.uniform(key, x.shape, jnp.float32, lower, upper).astype(x.dtype)
    r = jnp.where(x <= 0, r, jnp.ones((), x.dtype))
    return x * r, r.astype(noise.dtype)


@lowers(aten.rrelu_with_noise_.default, rng=True, static_scalars=True)
def rrelu_with_noise_(x, noise, lower=1 / 8, upper=1 / 3, training=False, generator=None, *, key):
    # In place on self and noise: the new values of both (the functionalization convention).
    return rrelu_with_noise(x, noise, lower, upper, training, key=key)


@lowers(aten.rrelu_with_noise_functional.default, rng=True, static_scalars=True)
def rrelu_with_noise_functional(x, noise, lower=1 / 8, upper=1 / 3, training=False, generator=None, *, key):
    return rrelu_with_noise(x, noise, lower, upper, training, key=key)


# ---------------------------------------------------------------- activation backward
_GRAD_SELF = ("grad_output", "self")


def _elu_backward_check(alpha, is_result):
    if is_result and alpha < 0:
        raise RuntimeError(
            "In-place elu backward calculation is triggered with a negative slope which is not supported. This is "
            "caused by calling in-place forward function with a negative slope, please call out-of-place version "
            "instead.")


@lowers(aten.elu_backward.default, promote=Promote.INT_TO_FLOAT, promote_args=("grad_output", "self_or_result"),
        static_scalars=True)
def elu_backward(grad, alpha, scale, input_scale, is_result, x):
    _elu_backward_check(alpha, is_result)
    if is_result:
        negative = grad * input_scale * (x + alpha * scale)
    else:
        negative = grad * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, negative, grad * scale)


@lowers(aten.softplus_backward.default, promote=Promote.INT_TO_FLOAT, promote_args=_GRAD_SELF)
def softplus_backward(grad, x, beta, threshold):
    return jnp.where(x * beta > threshold, grad, grad * jax.nn.sigmoid(x * beta))


@lowers(aten.hardsigmoid_backward.default, promote=Promote.INT_TO_FLOAT, promote_args=_GRAD_SELF)
def hardsigmoid_backward(grad, x):
    return jnp.where((x > -3) & (x < 3), grad / 6, jnp.zeros((), grad.dtype))


@lowers(aten.hardswish_backward.default, promote=Promote.INT_TO_FLOAT, promote_args=_GRAD_SELF)
def hardswish_backward(grad, x):
    # ATen's corners: 0 at x = -3, the incoming gradient at x = 3
    return jnp.where(x <= -3, jnp.zeros((), grad.dtype), jnp.where(x < 3, grad * (x / 3 + 0.5), grad))


@lowers(aten.softshrink_backward.default, promote=Promote.DEFAULT, promote_args=_GRAD_SELF)
def softshrink_backward(grad, x, lambd):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), grad.dtype), grad)


@lowers(aten.hardshrink_backward.default, promote=Promote.DEFAULT, promote_args=_GRAD_SELF)
def hardshrink_backward(grad, x, lambd):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), grad.dtype), grad)


@lowers(aten.glu_backward.default)
def glu_backward(grad, x, dim):
    return jax.vjp(lambda a: glu(a, dim), x)[1](grad.astype(x.dtype))[0]


@lowers(aten.log_sigmoid_backward.default, promote=Promote.INT_TO_FLOAT, promote_args=_GRAD_SELF)
def log_sigmoid_backward(grad, x, buffer):
    return grad * jax.nn.sigmoid(-x)


@lowers(aten._prelu_kernel_backward.default, promote=Promote.DEFAULT)
def prelu_kernel_backward(grad, x, weight):
    # The weight gradient keeps the input's (broadcast) shape; autograd sums it down to the weight's.
    zero = jnp.zeros((), grad.dtype)
    return jnp.where(x > 0, grad, weight * grad), jnp.where(x > 0, zero, x * grad)


@lowers(aten.rrelu_with_noise_backward.default, static_scalars=True)
def rrelu_with_noise_backward(grad, x, noise, lower, upper, training, self_is_result):
    if training and upper - lower > 1e-6:
        return grad * noise
    slope = (lower + upper) / 2  # ATen: leaky_relu_backward with that slope
    _leaky_relu_backward_check(slope, self_is_result)
    return jnp.where(x > 0, grad, grad * slope)
