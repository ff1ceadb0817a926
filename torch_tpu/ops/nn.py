"""Neural-network ops and their backward kernels: activations, softmax, layer norm, dropout, losses, embedding.

Backward ops that PyTorch implements as backend kernels (`*_backward`) are
lowered here too, so `loss.backward()` runs natively.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from torch_tpu.ops.registry import Promote, aten, lowers

_F32 = jnp.float32


def _opmath(x):
    return x.astype(_F32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


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
    return jax.nn.gelu(x, approximate=approximate == "tanh")


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
    return grad * (1 - y * y)


@lowers(aten.sigmoid_backward.default, promote=Promote.INT_TO_FLOAT)
def sigmoid_backward(grad, y):
    return grad * y * (1 - y)


@lowers(aten.leaky_relu.default, promote=Promote.DEFAULT)
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@lowers(aten.leaky_relu_backward.default, promote=Promote.DEFAULT, promote_args=("grad_output", "self"))
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
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


# ---------------------------------------------------------------- softmax
@lowers(aten._softmax.default)
def softmax(x, dim, half_to_float=False):
    return jax.nn.softmax(_opmath(x), axis=dim)


@lowers(aten._log_softmax.default)
def log_softmax(x, dim, half_to_float=False):
    return jax.nn.log_softmax(_opmath(x), axis=dim)


@lowers(aten._softmax_backward_data.default)
def softmax_backward(grad, y, dim, input_dtype):
    g, y = _opmath(grad), _opmath(y)
    return y * (g - jnp.sum(g * y, axis=dim, keepdims=True))


@lowers(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad, y, dim, input_dtype):
    g, y = _opmath(grad), _opmath(y)
    return g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True)


# ---------------------------------------------------------------- dropout
@lowers(aten.native_dropout.default, rng=True)
def native_dropout(x, p, train, *, key):
    if not train or p == 0:
        return x, jnp.ones(x.shape, jnp.bool_)
    if p == 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1 - p, x.shape)
    return jnp.where(keep, _opmath(x) / (1 - p), 0), keep


@lowers(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    return _opmath(grad) * mask * scale


# ---------------------------------------------------------------- losses
def _reduce(loss, reduction, weight_sum=None):
    if reduction == 1:  # mean
        return jnp.sum(loss) / weight_sum if weight_sum is not None else jnp.mean(loss)
    if reduction == 2:  # sum
        return jnp.sum(loss)
    return loss


def _nll_weights(x, target, weight, ignore_index, class_dim):
    n_classes = x.shape[class_dim]
    safe = jnp.where(target == ignore_index, 0, target)
    w = jnp.ones((n_classes,), x.dtype) if weight is None else weight.astype(x.dtype)
    wt = jnp.where(target == ignore_index, jnp.zeros((), x.dtype), w[safe])
    return safe, wt


@lowers(aten.nll_loss_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    class_dim = 0 if x.ndim == 1 else 1
    safe, wt = _nll_weights(x, target, weight, ignore_index, class_dim)
    picked = jnp.take_along_axis(x, jnp.expand_dims(safe, class_dim), axis=class_dim).squeeze(class_dim)
    loss = -picked * wt
    total = jnp.sum(wt)
    if reduction == 0:
        return loss, jnp.zeros((), x.dtype)
    return _reduce(loss, reduction, total), total


@lowers(aten.nll_loss_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    class_dim = 0 if x.ndim == 1 else 1
    safe, wt = _nll_weights(x, target, weight, ignore_index, class_dim)
    g = grad
    if reduction == 1:
        g = g / total_weight
    scale = -wt * g
    one_hot = jax.nn.one_hot(safe, x.shape[class_dim], dtype=x.dtype, axis=class_dim)
    return one_hot * jnp.expand_dims(scale, class_dim)


@lowers(aten.mse_loss.default, promote=Promote.DEFAULT, promote_args=("self", "target"))
def mse_loss(x, target, reduction=1):
    return _reduce(jnp.square(x - target), reduction)


@lowers(aten.mse_loss_backward.default, promote=Promote.DEFAULT, promote_args=("grad_output", "self", "target"))
def mse_loss_backward(grad, x, target, reduction):
    scale = 2.0 / math.prod(x.shape) if reduction == 1 else 2.0
    return scale * (x - target) * grad


# ---------------------------------------------------------------- embedding
@lowers(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@lowers(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat = indices.reshape(-1)
    g = _opmath(grad).reshape(flat.shape[0], -1)
    if padding_idx >= 0:
        g = jnp.where((flat == padding_idx)[:, None], 0, g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[flat].add(1)
        g = g / counts[flat][:, None]
    return jnp.zeros((num_weights, g.shape[1]), g.dtype).at[flat].add(g)
