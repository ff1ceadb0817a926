"""Strided views of flat storage buffers, inside traced programs.

A tpu storage's buffer is a flat 1-D array; a tensor is (sizes, strides,
offset) over it, exactly like PyTorch's CPU/CUDA tensors. These pure JAX
functions read such a view into a dense array and write a dense array back
into the buffer. They run inside the op's program, so XLA fuses the view math
into the op (no eager reshapes, no host round trips).

Plans, fastest first: contiguous (slice + reshape); non-overlapping strides
that nest (reshape + slice + transpose when the offset is known while tracing,
else pad + reshape + slice + transpose: still no gather); anything else
(overlapping `as_strided`, `unfold`) gathers with iota-computed indices.
"""
from __future__ import annotations

import math
import weakref

import jax.numpy as jnp
import numpy as np
from jax import lax


def contiguous_strides(sizes) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(sizes):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def is_contiguous(sizes, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def dense_permutation(sizes, strides) -> tuple[int, ...] | None:
    """The dim order (outermost first) if the view is dense in some permuted order, else None."""
    order = sorted(range(len(sizes)), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return tuple(order)


def _nested_plan(sizes, strides):
    """Dims (index, size, stride) sorted outer->inner if the strides nest, else None."""
    dims = sorted(
        ((d, sizes[d], strides[d]) for d in range(len(sizes)) if sizes[d] > 1 and strides[d] != 0),
        key=lambda t: -t[2],
    )
    for (_, _, outer_stride), (_, inner_size, inner_stride) in zip(dims, dims[1:]):
        if outer_stride % inner_stride or outer_stride < inner_stride * inner_size:
            return None
    return dims


def _extent(sizes, strides) -> int:
    """Elements from the view's first to its last element, inclusive."""
    return 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides) if size > 0)


def _padded(buf, window: int, extent: int):
    """`buf` with room for a `window`-long slice at any offset where the view (of `extent`) fits."""
    pad = window - extent
    return jnp.pad(buf, (0, pad)) if pad > 0 else buf


def _block_shape(dims):
    shape = [dims[0][1]]
    for (_, _, outer_stride), (_, _, inner_stride) in zip(dims, dims[1:]):
        shape.append(outer_stride // inner_stride)
    shape.append(dims[-1][2])
    return shape


def _static_blocks(dims, offset, length: int):
    """(shape, starts) when the view is `lax.slice(buf.reshape(shape), starts, ...)`, else None.

    Only for an offset known while tracing (a Python int): the whole buffer, cut into its
    strides' blocks ([length / s0, s0 / s1, ..., s_last]), holds the view as one rectangle
    when the buffer divides into outermost blocks and no dim wraps past its block. Then XLA
    reads (or writes) the view in place instead of through a padded copy of the buffer.
    """
    if type(offset) is not int or not dims:
        return None
    outer = dims[0][2]
    if length % outer:
        return None
    shape = (length // outer, *(a[2] // b[2] for a, b in zip(dims, dims[1:])), dims[-1][2])
    starts, rest = [], offset
    for _, _, stride in dims:
        starts.append(rest // stride)
        rest %= stride
    starts.append(rest)
    for start, size, limit in zip(starts, [size for _, size, _ in dims] + [1], shape):
        if start + size > limit:
            return None
    return shape, tuple(starts)


def _gather_indices(sizes, strides, offset):
    index = jnp.zeros(tuple(sizes), dtype=jnp.int64) + offset
    for d, (size, stride) in enumerate(zip(sizes, strides)):
        if size > 1 and stride:
            index = index + lax.broadcasted_iota(jnp.int64, tuple(sizes), d) * stride
    return index


# `offset` below is the view's storage offset: a Python int, or a traced int64
# scalar when it is a runtime input (one program then serves every offset).
# Either way a valid view fits its storage, so dynamic slices never clamp.


def read(buf, sizes, strides, offset):
    """The dense value of the view (sizes, strides, offset) of flat `buf`."""
    sizes, strides = tuple(sizes), tuple(strides)
    numel = math.prod(sizes)
    if numel == 0:
        return jnp.zeros(sizes, buf.dtype)
    if is_contiguous(sizes, strides):
        if numel == buf.shape[0]:  # the whole storage: the offset can only be 0
            return buf.reshape(sizes)
        return lax.dynamic_slice(buf, (offset,), (numel,)).reshape(sizes)
    dims = _nested_plan(sizes, strides)
    if dims is None:
        return buf[_gather_indices(sizes, strides, offset)]
    if not dims:  # every dim has size 1 or stride 0
        return jnp.broadcast_to(lax.dynamic_slice(buf, (offset,), (1,)).reshape(()), sizes)
    limits = tuple(size for _, size, _ in dims) + (1,)
    static = _static_blocks(dims, offset, buf.shape[0])
    if static is not None:  # a plain slice of the whole buffer: no padded copy
        shape, starts = static
        value = lax.slice(buf.reshape(shape), starts, tuple(s + n for s, n in zip(starts, limits)))
    else:
        window = dims[0][1] * dims[0][2]
        block = lax.dynamic_slice(_padded(buf, window, _extent(sizes, strides)), (offset,), (window,))
        value = lax.slice(block.reshape(_block_shape(dims)), (0,) * (len(dims) + 1), limits)
    value = value.reshape(limits[:-1])
    # `value` is in stride order; put the dims back in the view's order, then
    # restore size-1 dims and broadcast the stride-0 ones.
    order = [d for d, _, _ in dims]
    if order != sorted(order):
        dense, perm = value, tuple(int(p) for p in np.argsort(order))
        value = jnp.transpose(value, perm)
        if len(order) == len(sizes):  # nothing to restore: the result is `dense`, permuted
            _note_permuted(value, dense, perm)
    kept = sorted(order)
    shape = [sizes[d] if d in kept else 1 for d in range(len(sizes))]
    return jnp.broadcast_to(value.reshape(shape), sizes)


# Values `read` made by permuting a dense block (a transposed view, e.g. a linear layer's
# weight.t()), while tracing: id -> (weak reference to the value, the dense block, the
# permutation). A product can then take the block as it lies (precision.py: XLA:CPU's
# library dot takes a right operand [n, k] as well as [k, n]; a transpose would be copied).
_permuted: dict[int, tuple] = {}


def _note_permuted(value, dense, perm) -> None:
    key = id(value)

    def forget(ref, key=key):
        if _permuted.get(key, (None,))[0] is ref:
            del _permuted[key]

    try:
        _permuted[key] = (weakref.ref(value, forget), dense, perm)
    except TypeError:  # not weakly referenceable: nothing noted
        pass


def permuted_source(value):
    """(dense, perm) if `read` made `value` as jnp.transpose(dense, perm) in this trace, else None."""
    entry = _permuted.get(id(value))
    if entry is None or entry[0]() is not value:
        return None
    return entry[1], entry[2]


def write(buf, value, sizes, strides, offset):
    """`buf` with the view (sizes, strides, offset) replaced by `value`."""
    sizes, strides = tuple(sizes), tuple(strides)
    value = jnp.broadcast_to(value.astype(buf.dtype), sizes)
    numel = math.prod(sizes)
    if numel == 0:
        return buf
    if is_contiguous(sizes, strides):
        if numel == buf.shape[0]:
            return value.reshape(-1)
        return lax.dynamic_update_slice(buf, value.reshape(-1), (offset,))
    dims = _nested_plan(sizes, strides)
    if dims is None:
        return buf.at[_gather_indices(sizes, strides, offset)].set(value)
    # NOTE(torch-vs-xla): writing through a stride-0 (expanded) dim is undefined
    # in PyTorch; we write element 0 of that dim.
    picked = tuple(slice(None) if (sizes[d] > 1 and strides[d] != 0) else slice(0, 1) for d in range(len(sizes)))
    value = value[picked]
    if not dims:  # every dim expanded: the view is the one element at `offset`
        return lax.dynamic_update_slice(buf, value.reshape(-1), (offset,))
    order = [d for d, _, _ in dims]
    value = value.reshape(tuple(sizes[d] for d in sorted(order)))
    # Inverse of read's permutation: from the view's dim order to stride order.
    value = jnp.transpose(value, np.argsort(np.argsort(order))) if order != sorted(order) else value
    value = value.reshape(tuple(size for _, size, _ in dims) + (1,))
    static = _static_blocks(dims, offset, buf.shape[0])
    if static is not None:
        shape, starts = static
        return lax.dynamic_update_slice(buf.reshape(shape), value, starts).reshape(-1)
    window = dims[0][1] * dims[0][2]
    padded = _padded(buf, window, _extent(sizes, strides))
    block = lax.dynamic_slice(padded, (offset,), (window,)).reshape(_block_shape(dims))
    block = lax.dynamic_update_slice(block, value, (0,) * block.ndim)
    padded = lax.dynamic_update_slice(padded, block.reshape(-1), (offset,))
    return padded if padded.shape[0] == buf.shape[0] else padded[: buf.shape[0]]


def to_flat(value, strides) -> "jnp.ndarray":
    """A dense value laid out in a fresh buffer with the given (dense) strides."""
    sizes = value.shape
    if is_contiguous(sizes, strides):
        return value.reshape(-1)
    order = dense_permutation(sizes, strides)
    return jnp.transpose(value, order).reshape(-1)


def reinterpret(buf, dtype):
    """The same bytes as a flat array of `dtype` (PyTorch's view(dtype) at storage level)."""
    src = buf.dtype
    if src == dtype:
        return buf
    if src == jnp.bool_:
        buf, src = buf.astype(jnp.uint8), jnp.dtype(jnp.uint8)
    if dtype == jnp.bool_:
        return reinterpret(buf, jnp.uint8) != 0
    if jnp.issubdtype(src, jnp.complexfloating):
        part = jnp.float32 if src == jnp.complex64 else jnp.float64
        buf = jnp.stack([jnp.real(buf), jnp.imag(buf)], -1).reshape(-1).astype(part)
        return reinterpret(buf, dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = jnp.float32 if dtype == jnp.complex64 else jnp.float64
        pairs = reinterpret(buf, part).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    src_size, dst_size = jnp.dtype(src).itemsize, jnp.dtype(dtype).itemsize
    if src_size == dst_size:
        return lax.bitcast_convert_type(buf, dtype)
    raw = lax.bitcast_convert_type(buf, jnp.uint8).reshape(-1) if src_size > 1 else lax.bitcast_convert_type(buf, jnp.uint8)
    pad = (-raw.shape[0]) % dst_size
    if pad:
        raw = jnp.pad(raw, (0, pad))
    if dst_size == 1:
        return lax.bitcast_convert_type(raw, dtype)
    return lax.bitcast_convert_type(raw.reshape(-1, dst_size), dtype)
