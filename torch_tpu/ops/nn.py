"""Neural-network ops and their backward kernels: softmax, dropout, embedding (+ bag), pixel shuffle, im2col.

Backward ops that PyTorch implements as backend kernels (`*_backward`) are
lowered here too, so `loss.backward()` runs natively.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torch_tpu.ops import _draws, checks
from torch_tpu.ops._dims import axis
from torch_tpu.ops.registry import aten, kernel, lowers

_F32 = jnp.float32


def _opmath(x):
    return x.astype(_F32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


# ---------------------------------------------------------------- softmax
@lowers(aten._softmax.default)
def softmax(x, dim, half_to_float=False):
    return jax.nn.softmax(_opmath(x), axis=axis(x, dim))


@lowers(aten._log_softmax.default)
def log_softmax(x, dim, half_to_float=False):
    return jax.nn.log_softmax(_opmath(x), axis=axis(x, dim))


@lowers(aten._softmax_backward_data.default)
def softmax_backward(grad, y, dim, input_dtype):
    g, y = _opmath(grad), _opmath(y)
    return y * (g - jnp.sum(g * y, axis=axis(y, dim), keepdims=True))


@lowers(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad, y, dim, input_dtype):
    g, y = _opmath(grad), _opmath(y)
    return g - jnp.exp(y) * jnp.sum(g, axis=axis(y, dim), keepdims=True)


# ---------------------------------------------------------------- dropout
@lowers(aten.native_dropout.default, rng=True)
def native_dropout(x, p, train, *, key):
    if not train or p == 0:
        return x, jnp.ones(x.shape, jnp.bool_)
    if p == 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = _draws.bernoulli(key, 1 - p, x.shape)
    return jnp.where(keep, _opmath(x) / (1 - p), 0), keep


@lowers(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    return _opmath(grad) * mask * scale


# ---------------------------------------------------------------- embedding
@lowers(aten.embedding.default)
@checks.checked
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    checks.require_index(indices, weight.shape[0], checks.INDEX_IN_SELF)
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


@lowers(aten.embedding_renorm.default, static_scalars=True)
def embedding_renorm(weight, indices, max_norm, norm_type):
    rows = jnp.zeros((weight.shape[0],), bool).at[indices.reshape(-1)].set(True)
    a = _opmath(weight)
    norm = jnp.sum(jnp.abs(a) ** norm_type, axis=1) ** (1.0 / norm_type)
    scale = jnp.where(rows & (norm > max_norm), max_norm / (norm + 1e-7), 1)
    return (a * scale[:, None]).astype(weight.dtype)


# ---------------------------------------------------------------- one_hot
# aten.one_hot is CompositeImplicitAutograd: on a PrivateUse1 device it decomposes to `scatter_`, whose
# device check reports scatter's message. A tpu kernel of its own checks the class values in the program
# with one_hot's own errors (as PyTorch's CPU kernel does on the host), then compares with arange.
_lib = torch.library.Library("torch_tpu", "FRAGMENT")
_lib.define("one_hot(Tensor self, int num_classes) -> Tensor")


@torch.library.register_fake("torch_tpu::one_hot", lib=_lib)
def _one_hot_fake(x, num_classes):
    return x.new_empty((*x.shape, num_classes), dtype=torch.int64)


@lowers(torch.ops.torch_tpu.one_hot.default)
@checks.checked
def one_hot_checked(x, num_classes):
    checks.require(x >= 0, checks.ONE_HOT_NEGATIVE)  # CPU checks the sign first
    checks.require(x < num_classes, checks.ONE_HOT_BIG)
    return (x[..., None] == jnp.arange(num_classes, dtype=x.dtype)).astype(jnp.int64)


@kernel(aten.one_hot.default)
def one_hot(x, num_classes=-1):
    """PyTorch's host-side checks (Onehot.cpp), then the checked program."""
    if x.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if x.numel() == 0:
        if num_classes <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return x.new_empty((*x.shape, num_classes))
    if num_classes == -1:  # the size depends on the values: one read, as on CPU and CUDA
        num_classes = int(x.max().item()) + 1
    elif num_classes < 0:  # every value is >= num_classes: CPU's message
        raise RuntimeError("Class values must be smaller than num_classes.")
    return torch.ops.torch_tpu.one_hot(x, num_classes)


# ---------------------------------------------------------------- embedding bag
_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset, padding_idx):
    """(number of bags, bag of each index, whether each index counts)."""
    n_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    positions = jnp.arange(indices.shape[0])
    bag = jnp.searchsorted(offsets[:n_bags], positions, side="right") - 1
    valid = indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    if include_last_offset:
        valid = valid & (positions < offsets[n_bags])
    return n_bags, bag, valid


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
@checks.checked
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=_SUM, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    ok = (indices >= 0) & (indices < weight.shape[0])
    first_bad = jnp.argmax(~ok.reshape(-1)) if indices.size else 0  # (argmax of nothing is an error)
    checks.require(ok, checks.EMBEDDING_BAG, indices, first_bad, weight.shape[0])
    n_bags, bag, valid = _bags(indices, offsets, include_last_offset, padding_idx)
    rows = jnp.take(_opmath(weight), indices, axis=0)
    count = jax.ops.segment_sum(valid.astype(jnp.int64), bag, n_bags)
    if mode == _MAX:
        masked = jnp.where(valid[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(masked, bag, n_bags)
        # The first member reaching the maximum, as an embedding row id (0 for empty bags).
        is_best = valid[:, None] & (masked == best[bag])
        first = jax.ops.segment_min(jnp.where(is_best, jnp.arange(indices.shape[0])[:, None], indices.shape[0]),
                                    bag, n_bags)
        max_indices = jnp.where(count[:, None] > 0, indices[jnp.minimum(first, indices.shape[0] - 1)], 0)
        out = jnp.where(count[:, None] > 0, best, 0)
    else:
        if per_sample_weights is not None:
            rows = rows * _opmath(per_sample_weights)[:, None]
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), bag, n_bags)
        if mode == _MEAN:
            out = out / jnp.maximum(count, 1)[:, None].astype(out.dtype)
        max_indices = jnp.zeros((0,), jnp.int64)
    # NOTE(torch-vs-xla): bag_size has one entry per offset (PyTorch's meta shape), also with include_last_offset.
    bag_size = jnp.pad(count, (0, offsets.shape[0] - n_bags))
    return out, bag, bag_size, max_indices


def _embedding_bag_grad(grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
                        per_sample_weights, padding_idx):
    g = _opmath(grad)
    valid = indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    if mode == _MAX:
        keep = (bag_size[:g.shape[0]] > 0)[:, None]  # include_last_offset: one more size than bags
        columns = jnp.broadcast_to(jnp.arange(g.shape[1])[None, :], g.shape)
        out = jnp.zeros((num_weights, g.shape[1]), g.dtype).at[maximum_indices, columns].add(jnp.where(keep, g, 0))
    else:
        per_index = g[offset2bag]
        if mode == _MEAN:
            per_index = per_index / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(g.dtype)
        if per_sample_weights is not None:
            per_index = per_index * _opmath(per_sample_weights)[:, None]
        out = jnp.zeros((num_weights, g.shape[1]), g.dtype).at[indices].add(jnp.where(valid[:, None], per_index, 0))
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[indices].add(valid.astype(g.dtype))
        out = out / jnp.maximum(counts, 1)[:, None]
    if padding_idx >= 0:
        out = out.at[padding_idx].set(0)
    return out


@lowers(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    return _embedding_bag_grad(grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq,
                               mode, per_sample_weights, padding_idx)


@kernel(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    """ATen's routing: sparse=True to its composite sparse backward (a sparse COO gradient), else the dense one."""
    if sparse:
        return aten._embedding_bag_sparse_backward(grad, indices, offsets, offset2bag, bag_size, num_weights,
                                                   scale_grad_by_freq, mode, per_sample_weights, padding_idx)
    return aten._embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                              scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lowers(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    rows = jnp.take(_opmath(weight), indices, axis=0)
    out = jnp.sum(_opmath(grad)[offset2bag] * rows, axis=1)
    return jnp.where(indices != padding_idx, out, 0) if padding_idx >= 0 else out


# ---------------------------------------------------------------- softmax variants
@lowers(aten._safe_softmax.default)
def safe_softmax(x, dim, dtype=None):
    """Softmax whose fully masked (all -inf) rows are 0 instead of NaN (scaled_dot_product_attention's math path)."""
    a = _opmath(x) if dtype is None else x
    dim = axis(x, dim)
    out = jax.nn.softmax(a, axis=dim)
    return jnp.where(jnp.all(a == -jnp.inf, axis=dim, keepdims=True), 0, out)


# ---------------------------------------------------------------- rearrangements
@lowers(aten.pixel_shuffle.default)
def pixel_shuffle(x, upscale_factor):
    r = upscale_factor
    *lead, c, h, w = x.shape
    y = x.reshape(*lead, c // (r * r), r, r, h, w)
    n = len(lead)
    y = jnp.transpose(y, tuple(range(n)) + (n, n + 3, n + 1, n + 4, n + 2))
    return y.reshape(*lead, c // (r * r), h * r, w * r)


@lowers(aten.pixel_unshuffle.default)
def pixel_unshuffle(x, downscale_factor):
    r = downscale_factor
    *lead, c, h, w = x.shape
    n = len(lead)
    y = x.reshape(*lead, c, h // r, r, w // r, r)
    y = jnp.transpose(y, tuple(range(n)) + (n, n + 2, n + 4, n + 1, n + 3))
    return y.reshape(*lead, c * r * r, h // r, w // r)


@lowers(aten.channel_shuffle.default)
def channel_shuffle(x, groups):
    n, c = x.shape[:2]
    return x.reshape(n, groups, c // groups, *x.shape[2:]).swapaxes(1, 2).reshape(x.shape)


def _im2col(x, kernel_size, dilation, padding, stride):
    """(N, C, H, W) -> (N, C*kh*kw, L): every kernel-sized patch as a column (F.unfold)."""
    batched = x.ndim == 4
    x = x if batched else x[None]
    n, c, h, w = x.shape
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel_size, dilation, padding, stride
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    xp = jnp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    parts = [xp[:, :, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
             for i in range(kh) for j in range(kw)]
    cols = jnp.stack(parts, axis=2).reshape(n, c * kh * kw, oh * ow)
    return cols if batched else cols[0]


@lowers(aten.im2col.default)
def im2col(x, kernel_size, dilation, padding, stride):
    return _im2col(x, kernel_size, dilation, padding, stride)


@lowers(aten.col2im.default)
def col2im(cols, output_size, kernel_size, dilation, padding, stride):
    """F.fold: sum every column back into its patch (the transpose of im2col)."""
    batched = cols.ndim == 3
    kh, kw = kernel_size
    c = cols.shape[-2] // (kh * kw)
    shape = ((cols.shape[0],) if batched else ()) + (c, *output_size)
    acc = _opmath(cols)
    forward = lambda x: _im2col(x, kernel_size, dilation, padding, stride)  # noqa: E731
    return jax.vjp(forward, jnp.zeros(shape, acc.dtype))[1](acc)[0]
