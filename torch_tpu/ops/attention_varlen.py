"""Variable-length (packed) attention: aten._flash_attention_forward/_backward with cumulative lengths.

`torch.nn.attention.varlen.varlen_attn` (TorchTitan's "varlen" attention backend) calls these ATen
ops on any device: query (total_q, heads, dim), key/value (total_k, kv_heads, dim), sequence b
occupying rows [cum_seq_q[b], cum_seq_q[b+1]). Here they are one dense program: each token's
sequence id comes from the cumulative lengths (a static-shape searchsorted), scores outside a
token's own sequence, past the causal diagonal (bottom-right aligned, as flash-attention does for
unequal lengths) or outside the (left, right) window are masked. The backward recomputes the
forward under jax.vjp. Dropout, ALiBi, paged KV (block_table) and seqused_k are not supported
(clear errors); the dense (batch, seq, heads, dim) layout (no cumulative lengths) is not either:
F.scaled_dot_product_attention covers it (ops/attention.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from torch_tpu.ops.attention import _mm, _operand, _probabilities, _repeat_heads
from torch_tpu.ops.registry import aten, lowers


def _segments(cum, total):
    """Sequence id of each of `total` packed rows (len(cum) - 1 for rows past the last sequence)."""
    return jnp.searchsorted(cum.astype(jnp.int64), jnp.arange(total, dtype=jnp.int64), side="right") - 1


def _mask(cum_q, cum_k, total_q, total_k, is_causal, left, right):
    seg_q, seg_k = _segments(cum_q, total_q), _segments(cum_k, total_k)
    batch = cum_q.shape[0] - 1
    valid_q, valid_k = (seg_q >= 0) & (seg_q < batch), (seg_k >= 0) & (seg_k < batch)
    sq, sk = jnp.clip(seg_q, 0, batch - 1), jnp.clip(seg_k, 0, batch - 1)
    i = jnp.arange(total_q) - cum_q[sq]  # position within its sequence
    j = jnp.arange(total_k) - cum_k[sk]
    len_q, len_k = cum_q[sq + 1] - cum_q[sq], cum_k[sq + 1] - cum_k[sq]  # of each query row's sequence
    keep = (seg_q[:, None] == seg_k[None, :]) & valid_q[:, None] & valid_k[None, :]
    # the diagonal of query row i in its sequence: key position i + (len_k - len_q) (bottom-right aligned)
    diag = (i + len_k - len_q)[:, None]
    if is_causal:
        right = 0 if right is None or right < 0 else min(right, 0)
    if right is not None and right >= 0:
        keep &= j[None, :] <= diag + right
    if left is not None and left >= 0:
        keep &= j[None, :] >= diag - left
    return keep


def _check(dropout_p, extra) -> None:
    if dropout_p:
        raise NotImplementedError("tpu: _flash_attention_forward with dropout_p > 0 is not supported")
    for name, value in extra.items():
        if value is not None:
            raise NotImplementedError(f"tpu: _flash_attention_forward with {name} is not supported")


def _attend(q, k, v, cum_q, cum_k, is_causal, scale, left, right):
    """(output (Tq, H, D), logsumexp (H, Tq) float32) of packed sequences."""
    heads = q.shape[1]
    qh, kh, vh = (jnp.swapaxes(t, 0, 1) for t in (q, k, v))  # (H, T, D)
    kh, vh = _repeat_heads(kh, heads), _repeat_heads(vh, heads)
    keep = _mask(cum_q, cum_k, q.shape[0], k.shape[0], is_causal, left, right)
    bias = jnp.where(keep, 0.0, -jnp.inf).astype(jnp.float32)
    s = scale if scale is not None else 1.0 / float(q.shape[-1]) ** 0.5
    p, lse = _probabilities(qh, kh, bias, False, s)
    out = _mm(_operand(p, vh), vh).astype(q.dtype)
    return jnp.swapaxes(out, 0, 1), lse.astype(jnp.float32)


@lowers(aten._flash_attention_forward.default)
def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    _check(dropout_p, {"seqused_k": seqused_k, "alibi_slopes": alibi_slopes, "block_table": block_table})
    if cum_seq_q is None or cum_seq_k is None:
        raise NotImplementedError(
            "tpu: _flash_attention_forward without cum_seq_q/cum_seq_k (the dense layout) is not supported; "
            "use F.scaled_dot_product_attention")
    if return_debug_mask:
        raise NotImplementedError("tpu: _flash_attention_forward with return_debug_mask=True is not supported")
    out, lse = _attend(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale, window_size_left, window_size_right)
    return (out, lse, jnp.zeros((2,), jnp.uint64), jnp.zeros((), jnp.uint64), jnp.zeros((0,), query.dtype))


@lowers(aten._flash_attention_backward.default)
def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, scale=None, window_size_left=None,
                             window_size_right=None):
    _check(dropout_p, {})

    def forward(q, k, v):
        return _attend(q, k, v, cum_seq_q, cum_seq_k, is_causal, scale, window_size_left, window_size_right)[0]

    _, vjp = jax.vjp(forward, query, key, value)
    return vjp(grad_out.astype(query.dtype))
