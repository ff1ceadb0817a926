"""scaled_dot_product_attention as one fused program, forward and backward.

On "tpu", `F.scaled_dot_product_attention` asks the native shim's
`_fused_sdp_choice` stub for a backend; it answers "overrideable", so PyTorch
calls `_scaled_dot_product_fused_attention_overrideable` (boolean masks
already turned into additive -inf biases) and, for autograd, its `_backward`.
Both are lowered here: causal masks, additive masks, dropout (the mask is
regenerated in the backward from the key the forward returns as its
philox_seed) and grouped-query attention (fewer key/value heads) included.
`sdpa_kernel(SDPBackend.MATH)` still selects PyTorch's math decomposition.

Products follow the float32 matmul precision (precision.matmul).
NOTE(torch-vs-xla): a row whose every score is masked gives zeros (like
PyTorch's math path and its _safe_softmax), not NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torch_tpu import precision
from torch_tpu.ops import _draws
from torch_tpu.ops.normalization import native_layer_norm as layer_norm
from torch_tpu.ops.registry import aten, lowers

_LOW = (jnp.bfloat16, jnp.float16)


def _mm(a, b):
    return precision.matmul(a, b, accumulator=True)


def _operand(p, like):
    """Probabilities as the second product's operand: low-precision inputs multiply in their own dtype."""
    return p.astype(like.dtype) if like.dtype in _LOW else p


def _repeat_heads(x, heads):
    """Grouped-query attention: key/value head h serves query heads [h*g, (h+1)*g)."""
    return x if x.ndim < 3 or x.shape[-3] == heads else jnp.repeat(x, heads // x.shape[-3], axis=-3)


def _group_heads(grad, like):
    """The transpose of _repeat_heads: sum the gradients of each group."""
    if grad.ndim < 3 or grad.shape[-3] == like.shape[-3]:
        return grad
    hk = like.shape[-3]
    return jnp.sum(grad.reshape(grad.shape[:-3] + (hk, grad.shape[-3] // hk) + grad.shape[-2:]), axis=-3)


def _probabilities(q, k, bias, is_causal, scale):
    """(softmax probabilities, logsumexp) of the scaled, masked scores."""
    s = _mm(q, jnp.swapaxes(k, -1, -2)) * scale
    if bias is not None:
        s = s + bias.astype(s.dtype)
    if is_causal:
        length, source = s.shape[-2:]
        s = jnp.where(jnp.tril(jnp.ones((length, source), bool)), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = jnp.where(total > 0, e / jnp.where(total > 0, total, 1), 0)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1)) + m, -jnp.inf)[..., 0]
    return p, lse


def _keep_mask(key, dropout_p, shape):
    return _draws.bernoulli(key, 1 - dropout_p, shape)


def _pack_key(key):
    """A jax.random key as one int64 (PyTorch's philox_seed slot)."""
    hi, lo = (part.astype(jnp.uint64) for part in jax.random.key_data(key))
    return lax.bitcast_convert_type((hi << 32) | lo, jnp.int64)


def _unpack_key(seed):
    bits = lax.bitcast_convert_type(seed, jnp.uint64)
    data = jnp.stack([(bits >> 32).astype(jnp.uint32), (bits & 0xFFFFFFFF).astype(jnp.uint32)])
    return jax.random.wrap_key_data(data, impl="threefry2x32")


def _scale(q, scale):
    return scale if scale is not None else 1.0 / float(q.shape[-1]) ** 0.5


@lowers(aten._scaled_dot_product_fused_attention_overrideable.default, rng=True, precision=True)
def sdpa_fused(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=None, *,
               key):
    heads = q.shape[-3] if q.ndim >= 3 else None
    k, v = (_repeat_heads(t, heads) for t in (k, v)) if heads else (k, v)
    p, lse = _probabilities(q, k, attn_bias, is_causal, _scale(q, scale))
    if dropout_p > 0:
        p = jnp.where(_keep_mask(key, dropout_p, p.shape), p / (1 - dropout_p), 0)
    out = _mm(_operand(p, v), v)
    return out, lse.astype(jnp.float32), None, None, _pack_key(key), jnp.zeros((), jnp.int64), None


@lowers(aten._scaled_dot_product_fused_attention_overrideable_backward.default, precision=True)
def sdpa_fused_backward(grad, q, k, v, attn_bias, grad_input_mask, out, lse, cum_seq_q, cum_seq_k, max_q, max_k,
                        dropout_p, is_causal, philox_seed, philox_offset, scale=None):
    heads = q.shape[-3] if q.ndim >= 3 else None
    kr, vr = (_repeat_heads(t, heads) for t in (k, v)) if heads else (k, v)
    s = _scale(q, scale)
    p, _ = _probabilities(q, kr, attn_bias, is_causal, s)
    g = grad.astype(jnp.float32) if grad.dtype in _LOW else grad
    if dropout_p > 0:
        keep = _keep_mask(_unpack_key(philox_seed), dropout_p, p.shape)
        dropped = jnp.where(keep, p / (1 - dropout_p), 0)
    else:
        dropped = p
    grad_v = _mm(jnp.swapaxes(_operand(dropped, vr), -1, -2), _operand(g, vr))
    dp = _mm(_operand(g, vr), jnp.swapaxes(vr, -1, -2))
    if dropout_p > 0:
        dp = jnp.where(keep, dp / (1 - dropout_p), 0)
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))  # softmax backward
    grad_q = _mm(_operand(ds, q), kr) * s
    grad_k = _mm(jnp.swapaxes(_operand(ds, q), -1, -2), q) * s
    if heads:
        grad_k, grad_v = _group_heads(grad_k, k), _group_heads(grad_v, v)
    if attn_bias is None:
        grad_bias = jnp.zeros((0,), q.dtype)
    elif grad_input_mask[3]:
        grad_bias = _sum_to(ds, attn_bias.shape)
    else:
        grad_bias = jnp.zeros(attn_bias.shape, attn_bias.dtype)
    return grad_q, grad_k, grad_v, grad_bias


def _sum_to(x, shape):
    """Sum a broadcast result back down to `shape`."""
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


# ---------------------------------------------------------------- fused inference paths
# nn.MultiheadAttention and nn.TransformerEncoderLayer (batch_first, eval mode, no grad) call these
# fused kernels on "tpu" as on CPU/CUDA. Masks: bool (True = masked out) or float (nonzero = masked
# out, as PyTorch's kernels convert them); mask_type 0 = (L, S), 1 = key padding (B, S), 2 = (B, H, L, S).
def _linear(x, w, b):
    return _mm(x, jnp.swapaxes(w, 0, 1)) + b


def _mha(query, key, value, embed_dim, heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type):
    b, length, _ = query.shape
    head_dim = embed_dim // heads
    wq, wk, wv = jnp.split(qkv_weight, 3)
    bq, bk, bv = jnp.split(qkv_bias, 3)

    def heads_of(x, w, bias):
        return _linear(x, w, bias).reshape(b, x.shape[1], heads, head_dim).transpose(0, 2, 1, 3)

    q, k, v = heads_of(query, wq, bq), heads_of(key, wk, bk), heads_of(value, wv, bv)
    scores = _mm(q, jnp.swapaxes(k, -1, -2)) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))
    if mask is not None:
        masked = mask if mask.dtype == jnp.bool_ else mask != 0
        if mask_type == 1:
            masked = masked.reshape(b, 1, 1, -1)
        scores = jnp.where(masked, -jnp.inf, scores)
    # NOTE(torch-vs-xla): a fully masked row is NaN here, as in PyTorch's CPU kernel.
    p = jax.nn.softmax(scores, axis=-1)
    context = _mm(_operand(p, v), v).transpose(0, 2, 1, 3).reshape(b, length, embed_dim)
    return _linear(context, proj_weight, proj_bias), p


def _native_mha_meta(*args, **kwargs):
    # ATen's CPU and CUDA kernels leave the weights undefined (None) without need_weights; its meta kernel
    # gives an empty tensor
    out, weights = aten._native_multi_head_attention.default(*args, **kwargs)
    need_weights = kwargs.get("need_weights", args[10] if len(args) > 10 else True)
    return out, weights if need_weights else None


@lowers(aten._native_multi_head_attention.default, precision=True, meta=_native_mha_meta)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    out, p = _mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                  mask_type)
    if not need_weights:
        return out, None
    return out, jnp.mean(p, axis=1) if average_attn_weights else p


@lowers(aten._transformer_encoder_layer_fwd.default, precision=True)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                                  norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                                  ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    def norm(x, w, b):
        return layer_norm(x, (embed_dim,), w, b, eps)[0]

    def ffn(x):
        h = _linear(x, ffn_weight_1, ffn_bias_1)
        h = jax.nn.gelu(h, approximate=False) if use_gelu else jnp.maximum(h, 0)
        return _linear(h, ffn_weight_2, ffn_bias_2)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = _mha(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type)[0] + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    x = ffn(norm(x, norm_weight_2, norm_bias_2) if norm_first else x) + residual
    return x if norm_first else norm(x, norm_weight_2, norm_bias_2)
