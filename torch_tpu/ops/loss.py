"""Loss functions and their backward kernels.

The losses of `torch.nn.functional` that are not composites of other ops:
nll (1d and 2d), mse, binary cross entropy (+ with logits), smooth L1, Huber,
soft margin, multi-margin, multilabel margin, CTC. The rest (cross_entropy,
l1, kl_div, poisson/gaussian nll, hinge, cosine/triplet/margin-ranking,
multilabel soft margin) are CompositeImplicitAutograd in PyTorch and arrive
here as their parts. `reduction` is PyTorch's enum: 0 none, 1 mean, 2 sum.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from torch_tpu.ops import checks
from torch_tpu.ops.registry import Promote, aten, lowers
from torch_tpu.runtime import dtypes

_NONE, _MEAN, _SUM = 0, 1, 2
_PAIR = ("self", "target")
_GRAD_PAIR = ("grad_output", "self", "target")


def _reduce(loss, reduction, weight_sum=None):
    if reduction == _MEAN:
        return jnp.sum(loss) / weight_sum if weight_sum is not None else jnp.mean(loss)
    if reduction == _SUM:
        return jnp.sum(loss)
    return loss


def _grad_scale(grad, x, reduction):
    """The incoming gradient spread over the elements of x (mean divides by numel)."""
    return grad / math.prod(x.shape) if reduction == _MEAN else grad


# ---------------------------------------------------------------- negative log likelihood
def _nll_weights(x, target, weight, ignore_index, class_dim):
    n_classes = x.shape[class_dim]
    safe = jnp.where(target == ignore_index, 0, target)
    w = jnp.ones((n_classes,), x.dtype) if weight is None else weight.astype(x.dtype)
    wt = jnp.where(target == ignore_index, jnp.zeros((), x.dtype), w[safe])
    return safe, wt


def _nll_target_meta(op, byte: bool, at: int = 1):
    """ATen's target dtype rule (its structured meta function, on every device): Long, or Byte for the
    1-D/2-D kernels, which PyTorch's reference meta kernel refuses (its gather wants int64) and whose Int
    it accepts; and a weight of the input's dtype."""
    import torch

    def meta(*args):
        x, target, weight = args[at - 1], args[at], args[at + 1]
        if weight is not None and weight.dtype != x.dtype:  # the reference casts it
            raise RuntimeError(f"expected scalar type {dtypes.scalar_type_name(x.dtype)} but found "
                               f"{dtypes.scalar_type_name(weight.dtype)}")
        if target.dtype not in (torch.int64, torch.uint8):
            raise RuntimeError(f"expected target dtype to be Long or Byte, but got {dtypes.scalar_type_name(target.dtype)}")
        if target.dtype == torch.uint8:
            if not byte:
                raise RuntimeError("expected scalar type Long but found Byte")
            args = (*args[:at], target.long(), *args[at + 1:])
        return op(*args)

    return meta


@lowers(aten.nll_loss_forward.default, meta=_nll_target_meta(aten.nll_loss_forward.default, byte=True))
@lowers(aten.nll_loss2d_forward.default, meta=_nll_target_meta(aten.nll_loss2d_forward.default, byte=False))
@checks.checked
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    target = target.astype(jnp.int64)  # a Byte target: the ignore_index (-100) comparison needs a signed type
    class_dim = 0 if x.ndim == 1 else 1
    n_classes = x.shape[class_dim]
    checks.require((target == ignore_index) | ((target >= 0) & (target < n_classes)), checks.TARGET, target)
    safe, wt = _nll_weights(x, target, weight, ignore_index, class_dim)
    picked = jnp.take_along_axis(x, jnp.expand_dims(safe, class_dim), axis=class_dim).squeeze(class_dim)
    loss = -picked * wt
    total = jnp.sum(wt)
    if reduction == _NONE:
        return loss, jnp.zeros((), x.dtype)
    return _reduce(loss, reduction, total), total


@lowers(aten.nll_loss_backward.default, meta=_nll_target_meta(aten.nll_loss_backward.default, byte=True, at=2))
@lowers(aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    target = target.astype(jnp.int64)
    class_dim = 0 if x.ndim == 1 else 1
    safe, wt = _nll_weights(x, target, weight, ignore_index, class_dim)
    g = grad / total_weight if reduction == _MEAN else grad
    one_hot = jax.nn.one_hot(safe, x.shape[class_dim], dtype=x.dtype, axis=class_dim)
    return one_hot * jnp.expand_dims(-wt * g, class_dim)


# ---------------------------------------------------------------- regression losses
@lowers(aten.mse_loss.default, promote=Promote.DEFAULT, promote_args=_PAIR)
def mse_loss(x, target, reduction=_MEAN):
    return _reduce(jnp.square(x - target), reduction)


@lowers(aten.mse_loss_backward.default, promote=Promote.DEFAULT, promote_args=_GRAD_PAIR)
def mse_loss_backward(grad, x, target, reduction):
    return 2 * (x - target) * _grad_scale(grad, x, reduction)


@lowers(aten.smooth_l1_loss.default, promote=Promote.DEFAULT, promote_args=_PAIR)
def smooth_l1_loss(x, target, reduction=_MEAN, beta=1.0):
    d = jnp.abs(x - target)
    if beta == 0:
        return _reduce(d, reduction)
    return _reduce(jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta), reduction)


@lowers(aten.smooth_l1_loss_backward.default, promote=Promote.DEFAULT, promote_args=_GRAD_PAIR)
def smooth_l1_loss_backward(grad, x, target, reduction, beta):
    d = x - target
    slope = jnp.sign(d) if beta == 0 else jnp.where(jnp.abs(d) < beta, d / beta, jnp.sign(d))
    return slope * _grad_scale(grad, x, reduction)


@lowers(aten.huber_loss.default, promote=Promote.DEFAULT, promote_args=_PAIR)
def huber_loss(x, target, reduction=_MEAN, delta=1.0):
    d = jnp.abs(x - target)
    return _reduce(jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


@lowers(aten.huber_loss_backward.default, promote=Promote.DEFAULT, promote_args=_GRAD_PAIR)
def huber_loss_backward(grad, x, target, reduction, delta):
    d = x - target
    slope = jnp.where(d < -delta, -delta, jnp.where(d > delta, delta, d))
    return slope * _grad_scale(grad, x, reduction)


# ---------------------------------------------------------------- binary classification
_LOG_FLOOR = -100.0  # PyTorch clamps log(x) and log(1 - x) at -100 so the loss stays finite
_EPSILON = 1e-12


@lowers(aten.binary_cross_entropy.default, promote=Promote.DEFAULT, promote_args=_PAIR)
def binary_cross_entropy(x, target, weight=None, reduction=_MEAN):
    loss = -(target * jnp.maximum(jnp.log(x), _LOG_FLOOR) + (1 - target) * jnp.maximum(jnp.log1p(-x), _LOG_FLOOR))
    if weight is not None:
        loss = loss * weight.astype(loss.dtype)
    return _reduce(loss, reduction)


@lowers(aten.binary_cross_entropy_backward.default, promote=Promote.DEFAULT, promote_args=_GRAD_PAIR)
def binary_cross_entropy_backward(grad, x, target, weight=None, reduction=_MEAN):
    g = (x - target) / jnp.maximum((1 - x) * x, _EPSILON) * _grad_scale(grad, x, reduction)
    return g * weight.astype(g.dtype) if weight is not None else g


@lowers(aten.binary_cross_entropy_with_logits.default, promote=Promote.DEFAULT, promote_args=_PAIR)
def binary_cross_entropy_with_logits(x, target, weight=None, pos_weight=None, reduction=_MEAN):
    log_sigmoid = jax.nn.log_sigmoid(x)
    if pos_weight is not None:
        loss = (1 - target) * x - ((pos_weight.astype(x.dtype) - 1) * target + 1) * log_sigmoid
    else:
        loss = (1 - target) * x - log_sigmoid
    if weight is not None:
        loss = loss * weight.astype(loss.dtype)
    return _reduce(loss, reduction)


@lowers(aten.soft_margin_loss.default, promote=Promote.DEFAULT, promote_args=_PAIR)
def soft_margin_loss(x, target, reduction=_MEAN):
    return _reduce(jnp.log1p(jnp.exp(-target * x)), reduction)


@lowers(aten.soft_margin_loss_backward.default, promote=Promote.DEFAULT, promote_args=_GRAD_PAIR)
def soft_margin_loss_backward(grad, x, target, reduction):
    z = jnp.exp(-target * x)
    return -target * z / (1 + z) * _grad_scale(grad, x, reduction)


# ---------------------------------------------------------------- margin losses over classes
def _as_batch(x, target):
    """(N, C) scores and their (N, ...) targets (0-d and 1-d inputs are one sample)."""
    return (x.reshape(1, -1), target.reshape(1, -1)) if x.ndim <= 1 else (x, target)


def _multi_margin_terms(x, target, p, margin, weight):
    x2, t = _as_batch(x, target)
    t = t.reshape(-1)
    picked = jnp.take_along_axis(x2, t[:, None], axis=1)
    z = margin - picked + x2
    active = (z > 0) & (jnp.arange(x2.shape[1])[None, :] != t[:, None])
    w = weight.astype(x2.dtype)[t][:, None] if weight is not None else jnp.ones((), x2.dtype)
    return x2, t, z, active, w


@lowers(aten.multi_margin_loss.default, static_scalars=True)
def multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=_MEAN):
    x2, _, z, active, w = _multi_margin_terms(x, target, p, margin, weight)
    h = jnp.where(active, (z if p == 1 else z * z) * w, 0)
    loss = jnp.sum(h, axis=1) / x2.shape[1]
    loss = loss.reshape(()) if x.ndim <= 1 and reduction == _NONE else loss
    return _reduce(loss, reduction)


@lowers(aten.multi_margin_loss_backward.default, static_scalars=True)
def multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=_MEAN):
    x2, t, z, active, w = _multi_margin_terms(x, target, p, margin, weight)
    n, c = x2.shape
    g = grad.reshape(-1, 1) if reduction == _NONE else (grad / n if reduction == _MEAN else grad)
    d = jnp.where(active, (1 if p == 1 else 2 * z) * w, 0) / c
    d = d - jax.nn.one_hot(t, c, dtype=d.dtype) * jnp.sum(d, axis=1, keepdims=True)
    return (d * g).reshape(x.shape)


def _multilabel_terms(x, target):
    x2, t = _as_batch(x, target)
    valid = jnp.cumprod(t != -1, axis=1).astype(bool)  # targets stop at the first -1
    safe = jnp.where(valid, t, 0)
    c = x2.shape[1]
    is_target = jnp.any(jax.nn.one_hot(safe, c, dtype=jnp.bool_) & valid[..., None], axis=1)
    picked = jnp.take_along_axis(x2, safe, axis=1)  # (N, K)
    z = 1 - picked[:, :, None] + x2[:, None, :]  # (N, K, C)
    active = (z > 0) & valid[:, :, None] & ~is_target[:, None, :]
    return x2, safe, is_target, z, active


def _multilabel_meta(x, target, reduction):
    """Output shapes as ATen's kernel: a 1-D input's unreduced loss is 0-d (the reference meta gives [1])."""
    loss_shape = (() if x.dim() <= 1 else (x.shape[0],)) if reduction == _NONE else ()
    return x.new_empty(loss_shape), x.new_empty(x.shape)


@lowers(aten.multilabel_margin_loss_forward.default, meta=_multilabel_meta)
def multilabel_margin_loss_forward(x, target, reduction):
    x2, _, is_target, z, active = _multilabel_terms(x, target)
    loss = jnp.sum(jnp.where(active, z, 0), axis=(1, 2)) / x2.shape[1]
    if x.ndim <= 1:
        loss = loss.reshape(())
    return _reduce(loss, reduction), is_target.astype(x.dtype).reshape(x.shape)


@lowers(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    x2, safe, _, _, active = _multilabel_terms(x, target)
    n, c = x2.shape
    a = active.astype(x2.dtype) / c
    d = jnp.sum(a, axis=1)  # +1/c for each active (k, j) at j
    d = d - jnp.sum(jax.nn.one_hot(safe, c, dtype=x2.dtype) * jnp.sum(a, axis=2)[..., None], axis=1)
    g = grad.reshape(-1, 1) if reduction == _NONE else (grad / n if reduction == _MEAN else grad)
    return (d * g).reshape(x.shape)


# ---------------------------------------------------------------- connectionist temporal classification
def _logaddexp3(a, b, c):
    """log(e^a + e^b + e^c), finite gradients when every term is -inf (unreachable CTC states)."""
    m = jnp.maximum(jnp.maximum(a, b), c)
    m = jnp.where(jnp.isfinite(m), m, 0)
    s = jnp.exp(a - m) + jnp.exp(b - m) + jnp.exp(c - m)
    return jnp.where(s > 0, m + jnp.log(jnp.where(s > 0, s, 1)), -jnp.inf)


def _ctc_alpha(log_probs, targets, target_lengths, blank, max_target):
    """log alpha (T, N, 2S+1) over the blank-extended targets."""
    t_len, n, _ = log_probs.shape
    if targets.ndim == 2:
        labels = targets[:, :max_target]
    else:  # concatenated targets
        offsets = jnp.cumsum(target_lengths) - target_lengths
        labels = targets[jnp.clip(offsets[:, None] + jnp.arange(max_target)[None, :], 0, max(targets.shape[0] - 1, 0))]
    labels = jnp.clip(labels, 0, log_probs.shape[2] - 1).astype(jnp.int32)
    s = 2 * max_target + 1
    extended = jnp.full((n, s), blank, jnp.int32).at[:, 1::2].set(labels)
    # Skipping a blank is allowed between two different labels.
    skip = jnp.zeros((n, s), bool).at[:, 2:].set((extended[:, 2:] != blank) & (extended[:, 2:] != extended[:, :-2]))
    neg_inf = jnp.asarray(-jnp.inf, log_probs.dtype)

    def emit(t):
        return jnp.take_along_axis(log_probs[t], extended, axis=1)

    first = jnp.full((n, s), neg_inf).at[:, 0].set(emit(0)[:, 0])
    first = first.at[:, 1].set(jnp.where(target_lengths > 0, emit(0)[:, 1], neg_inf)) if s > 1 else first

    def step(alpha, lp_t):
        prev1 = jnp.concatenate([jnp.full((n, 1), neg_inf), alpha[:, :-1]], axis=1)
        shifted2 = jnp.concatenate([jnp.full((n, 2), neg_inf), alpha[:, :-2]], axis=1)[:, :s]  # s is 1 for empty targets
        prev2 = jnp.where(skip, shifted2, neg_inf)
        new = _logaddexp3(alpha, prev1, prev2) + jnp.take_along_axis(lp_t, extended, axis=1)
        return new, new

    _, rest = lax.scan(step, first, log_probs[1:])
    return jnp.concatenate([first[None], rest], axis=0)


def _ctc_nll(log_probs, targets, input_lengths, target_lengths, blank, max_target):
    alpha = _ctc_alpha(log_probs, targets, target_lengths, blank, max_target)
    n = log_probs.shape[1]
    last = alpha[jnp.clip(input_lengths - 1, 0, alpha.shape[0] - 1), jnp.arange(n)]  # (N, 2S+1)
    end = jnp.take_along_axis(last, (2 * target_lengths)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(2 * target_lengths - 1, 0)[:, None], axis=1)[:, 0]
    before = jnp.where(target_lengths > 0, before, -jnp.inf)
    return -_logaddexp3(end, before, jnp.full_like(end, -jnp.inf)), alpha


@lowers(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    il, tl = jnp.asarray(input_lengths, jnp.int32), jnp.asarray(target_lengths, jnp.int32)
    nll, alpha = _ctc_nll(log_probs, targets, il, tl, blank, max(target_lengths, default=0))
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0, nll)
    return nll, jnp.transpose(alpha, (1, 0, 2))


@lowers(aten._ctc_loss_backward.default)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                      zero_infinity=False):
    il, tl = jnp.asarray(input_lengths, jnp.int32), jnp.asarray(target_lengths, jnp.int32)
    max_target = max(target_lengths, default=0)
    _, vjp = jax.vjp(lambda lp: _ctc_nll(lp, targets, il, tl, blank, max_target)[0], log_probs)
    g = grad.astype(log_probs.dtype)
    if zero_infinity:
        g = jnp.where(jnp.isinf(nll), 0, g)
    # NOTE(torch-vs-xla): PyTorch's CTC gradient is d(nll)/d(logits) for log_probs = log_softmax(logits):
    # the exact derivative plus exp(log_probs) inside each input length (it vanishes through log_softmax).
    inside = (jnp.arange(log_probs.shape[0])[:, None] < il[None, :])[..., None]
    return vjp(g)[0] + jnp.where(inside, jnp.exp(log_probs) * g[None, :, None], 0)
