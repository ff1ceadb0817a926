"""TorchTPU's own operators (`torch.tpu.ops`, docs/compat.md): `torch.ops.tpu._<name>`.

Defined here with torch.library, each with a fake (shapes for torch.compile and the
executors' meta runs), a CPU kernel (the same operator on CPU tensors) and, where it
is one program, a lowering in the table:
- `_optimization_barrier(Tensor[])`: identity whose values XLA may not move work across
  (`lax.optimization_barrier`); its gradient goes through a barrier too;
- `_ragged_dot(lhs [m, k], rhs [g, k, n], group_sizes [g])`: row block i of `lhs`
  (group_sizes[i] rows, in order) times `rhs[i]`; rows past the last group are zeros
  (`lax.ragged_dot`); its gradients are `_ragged_dot` (lhs) and
  `_ragged_dot_weight_grad(lhs, grad, group_sizes)` [g, k, n] (rhs).
The collectives `_all_gather_dim` / `_reduce_scatter_dim` / `_ragged_all_to_all` are not lowerings: a
collective is its own program of the process group (docs/distributed.md), so their
kernel (every device) moves the dimension to the front, runs PyTorch's functional
collective on the group (on tpu: the "tpu_dist" group's program) and moves it back.
Their gradients are each other (sum), as PyTorch's `*_autograd` functional collectives.

Products follow the float32 matmul precision (docs/precision.md).
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torch_tpu import precision
from torch_tpu.ops.registry import lowers

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define("_optimization_barrier(Tensor[] tensors) -> Tensor[]")
_lib.define("_ragged_dot(Tensor lhs, Tensor rhs, Tensor group_sizes) -> Tensor")
_lib.define("_ragged_dot_weight_grad(Tensor lhs, Tensor grad, Tensor group_sizes) -> Tensor")
_lib.define("_all_gather_dim(Tensor self, int dim, str group_name) -> Tensor")
_lib.define("_reduce_scatter_dim(Tensor self, int dim, str reduce_op, str group_name) -> Tensor")
_lib.define("_ragged_all_to_all(Tensor operand, Tensor output, Tensor input_offsets, Tensor send_sizes, "
            "Tensor output_offsets, Tensor recv_sizes, str group_name) -> Tensor")
ops = torch.ops.tpu


# ---------------------------------------------------------------- checks (fakes and CPU kernels)
def _check_ragged(lhs, rhs, group_sizes, name="ragged_dot"):
    if lhs.dim() != 2 or rhs.dim() != 3:
        raise RuntimeError(f"{name}: expected lhs [m, k] and rhs [g, k, n], got lhs {list(lhs.shape)} and rhs "
                           f"{list(rhs.shape)}")
    if lhs.shape[1] != rhs.shape[1]:
        raise RuntimeError(f"{name}: lhs has {lhs.shape[1]} columns but rhs[g] has {rhs.shape[1]} rows")
    _check_sizes(group_sizes, rhs.shape[0], name)
    if lhs.dtype != rhs.dtype:
        raise RuntimeError(f"{name}: expected lhs and rhs of one dtype, got {lhs.dtype} and {rhs.dtype}")


def _check_sizes(group_sizes, groups, name):
    if group_sizes.dim() != 1 or group_sizes.shape[0] != groups:
        raise RuntimeError(f"{name}: expected group_sizes of shape [{groups}], got {list(group_sizes.shape)}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"{name}: expected int32 or int64 group_sizes, got {group_sizes.dtype}")


@torch.library.register_fake("tpu::_optimization_barrier", lib=_lib)
def _barrier_fake(tensors):
    return [t.new_empty(t.shape) for t in tensors]


@torch.library.register_fake("tpu::_ragged_dot", lib=_lib)
def _ragged_dot_fake(lhs, rhs, group_sizes):
    _check_ragged(lhs, rhs, group_sizes)
    return lhs.new_empty((lhs.shape[0], rhs.shape[2]))


@torch.library.register_fake("tpu::_ragged_dot_weight_grad", lib=_lib)
def _weight_grad_fake(lhs, grad, group_sizes):
    if lhs.dim() != 2 or grad.dim() != 2 or lhs.shape[0] != grad.shape[0]:
        raise RuntimeError(f"ragged_dot_weight_grad: expected lhs [m, k] and grad [m, n], got {list(lhs.shape)} "
                           f"and {list(grad.shape)}")
    if group_sizes.dim() != 1:
        raise RuntimeError(f"ragged_dot_weight_grad: expected a 1-D group_sizes, got {list(group_sizes.shape)}")
    return lhs.new_empty((group_sizes.shape[0], lhs.shape[1], grad.shape[1]))


# ---------------------------------------------------------------- CPU kernels (the same ops on CPU tensors)
def _barrier_cpu(tensors):
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]


def _groups(group_sizes):
    start = 0
    for size in group_sizes.tolist():
        yield start, start + int(size)
        start += int(size)


def _ragged_dot_cpu(lhs, rhs, group_sizes):
    _check_ragged(lhs, rhs, group_sizes)
    out = lhs.new_zeros((lhs.shape[0], rhs.shape[2]))
    for g, (a, b) in enumerate(_groups(group_sizes)):
        out[a:b] = lhs[a:b] @ rhs[g]
    return out


def _weight_grad_cpu(lhs, grad, group_sizes):
    out = lhs.new_zeros((group_sizes.shape[0], lhs.shape[1], grad.shape[1]))
    for g, (a, b) in enumerate(_groups(group_sizes)):
        out[g] = lhs[a:b].T @ grad[a:b]
    return out


_lib.impl("_optimization_barrier", _barrier_cpu, "CPU")
_lib.impl("_ragged_dot", _ragged_dot_cpu, "CPU")
_lib.impl("_ragged_dot_weight_grad", _weight_grad_cpu, "CPU")


# ---------------------------------------------------------------- lowerings
@lowers(ops._optimization_barrier.default)
def optimization_barrier(tensors):
    return list(lax.optimization_barrier(tuple(tensors)))


@lowers(ops._ragged_dot.default, precision=True)
def ragged_dot(lhs, rhs, group_sizes):
    return precision._product(lax.ragged_dot, lhs, rhs, group_sizes.astype(jnp.int32))


_WEIGHT_GRAD = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),  # contract the (ragged) rows
    lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@lowers(ops._ragged_dot_weight_grad.default, precision=True)
def ragged_dot_weight_grad(lhs, grad, group_sizes):
    def fn(a, b, sizes, **kwargs):
        return lax.ragged_dot_general(a, b, sizes, _WEIGHT_GRAD, **kwargs)

    return precision._product(fn, lhs, grad, group_sizes.astype(jnp.int32))


# ---------------------------------------------------------------- autograd
class _Barrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors):
        with torch._C._AutoDispatchBelowAutograd():
            return tuple(ops._optimization_barrier(list(tensors)))

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None]
        through = ops._optimization_barrier([grads[i] for i in present]) if present else []
        out = [None] * len(grads)
        for i, g in zip(present, through):
            out[i] = g
        return tuple(out)


def _barrier_autograd(tensors):
    return list(_Barrier.apply(*tensors))


# NOTE(torch 2.13): register_autograd refuses ops returning Tensor[]; an Autograd kernel instead.
_lib.impl("_optimization_barrier", _barrier_autograd, "Autograd")


def _ragged_setup(ctx, inputs, output):
    lhs, rhs, group_sizes = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes)


def _ragged_backward(ctx, grad):
    lhs, rhs, group_sizes = ctx.saved_tensors
    grad_lhs = ops._ragged_dot(grad, rhs.transpose(1, 2).contiguous(), group_sizes) \
        if ctx.needs_input_grad[0] else None
    grad_rhs = ops._ragged_dot_weight_grad(lhs, grad, group_sizes) if ctx.needs_input_grad[1] else None
    return grad_lhs, grad_rhs, None


torch.library.register_autograd("tpu::_ragged_dot", _ragged_backward, setup_context=_ragged_setup, lib=_lib)


# ---------------------------------------------------------------- collectives along a dimension
def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _norm_dim(dim: int, ndim: int, name: str) -> int:
    if ndim == 0:
        raise RuntimeError(f"{name}: expected a tensor with at least one dimension, got a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise IndexError(f"{name}: Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], "
                         f"but got {dim})")
    return dim % ndim


_REDUCE_OPS = ("sum", "avg", "max", "min", "product")


@torch.library.register_fake("tpu::_all_gather_dim", lib=_lib)
def _all_gather_fake(x, dim, group_name):
    dim = _norm_dim(dim, x.dim(), "all_gather_dim")
    shape = list(x.shape)
    shape[dim] *= _group(group_name).size()
    return x.new_empty(shape)


@torch.library.register_fake("tpu::_reduce_scatter_dim", lib=_lib)
def _reduce_scatter_fake(x, dim, reduce_op, group_name):
    dim = _norm_dim(dim, x.dim(), "reduce_scatter_dim")
    size = _group(group_name).size()
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"reduce_scatter_dim: reduce_op must be one of {_REDUCE_OPS}, got {reduce_op!r}")
    if x.shape[dim] % size:
        raise ValueError(f"reduce_scatter_dim: dimension {dim} has size {x.shape[dim]}, not divisible by the group "
                         f"size {size}")
    shape = list(x.shape)
    shape[dim] //= size
    return x.new_empty(shape)


def _all_gather_dim(x, dim, group_name):
    out = _all_gather_fake(x, dim, group_name)  # checks
    dim = _norm_dim(dim, x.dim(), "all_gather_dim")
    front = x.movedim(dim, 0).contiguous()
    c10d = torch.ops._c10d_functional
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(front, _group(group_name).size(), group_name))
    return gathered.movedim(0, dim).contiguous().view(out.shape)


def _reduce_scatter_dim(x, dim, reduce_op, group_name):
    out = _reduce_scatter_fake(x, dim, reduce_op, group_name)  # checks
    dim = _norm_dim(dim, x.dim(), "reduce_scatter_dim")
    front = x.movedim(dim, 0).contiguous()
    c10d = torch.ops._c10d_functional
    scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(front, reduce_op, _group(group_name).size(), group_name))
    return scattered.movedim(0, dim).contiguous().view(out.shape)


# Every device: the functional collective runs on whatever backend the group has for the tensor.
_lib.impl("_all_gather_dim", _all_gather_dim, "CompositeExplicitAutograd")
_lib.impl("_reduce_scatter_dim", _reduce_scatter_dim, "CompositeExplicitAutograd")


def _gather_setup(ctx, inputs, output):
    ctx.dim, ctx.group_name = inputs[1], inputs[2]


def _gather_backward(ctx, grad):
    return ops._reduce_scatter_dim(grad, ctx.dim, "sum", ctx.group_name), None, None


def _scatter_setup(ctx, inputs, output):
    ctx.dim, ctx.reduce_op, ctx.group_name = inputs[1], inputs[2], inputs[3]


def _scatter_backward(ctx, grad):
    if ctx.reduce_op not in ("sum", "avg"):
        raise RuntimeError(f"reduce_scatter_dim: the gradient of reduce_op={ctx.reduce_op!r} is not implemented "
                           "(only 'sum' and 'avg')")
    out = ops._all_gather_dim(grad, ctx.dim, ctx.group_name)
    if ctx.reduce_op == "avg":
        out = out / _group(ctx.group_name).size()
    return out, None, None, None


torch.library.register_autograd("tpu::_all_gather_dim", _gather_backward, setup_context=_gather_setup, lib=_lib)
torch.library.register_autograd("tpu::_reduce_scatter_dim", _scatter_backward, setup_context=_scatter_setup,
                                lib=_lib)


# ---------------------------------------------------------------- ragged all-to-all (lax.ragged_all_to_all's contract)
# Rank r sends operand[input_offsets[j] : + send_sizes[j]] (rows) to rank j, which writes it into its
# `output` at output_offsets[j] (an offset the *sender* gives, in the receiver's output); recv_sizes[j]
# is what arrives from j. The result is `output` with the received rows written in.
def _offsets_from_peers(offsets, group_name):
    """What each peer j put in its `offsets[me]` (one element each way)."""
    c10d = torch.ops._c10d_functional
    size = _group(group_name).size()
    flat = offsets.reshape(-1).contiguous()
    return c10d.wait_tensor(c10d.all_to_all_single(flat, [1] * size, [1] * size, group_name))


def _check_ragged_a2a(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
    size = _group(group_name).size()
    for name, t in (("input_offsets", input_offsets), ("send_sizes", send_sizes), ("output_offsets", output_offsets),
                    ("recv_sizes", recv_sizes)):
        if t.dim() != 1 or t.shape[0] != size or t.dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"ragged_all_to_all: {name} must be a 1-D int32/int64 tensor of the group size "
                               f"({size}), got {t.dtype} of shape {list(t.shape)}")
    if operand.dim() == 0 or output.dim() != operand.dim() or operand.shape[1:] != output.shape[1:] \
            or operand.dtype != output.dtype:
        raise RuntimeError(f"ragged_all_to_all: operand {operand.dtype}{list(operand.shape)} and output "
                           f"{output.dtype}{list(output.shape)} must agree in dtype and in every dimension but the first")


@torch.library.register_fake("tpu::_ragged_all_to_all", lib=_lib)
def _ragged_a2a_fake(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
    _check_ragged_a2a(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name)
    return output.new_empty(output.shape)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
    _check_ragged_a2a(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name)
    c10d = torch.ops._c10d_functional
    arriving_at = _offsets_from_peers(output_offsets, group_name)
    # The split sizes are host values for the process group: one read of the small tensors.
    send, starts = send_sizes.tolist(), input_offsets.tolist()
    recv, places = recv_sizes.tolist(), arriving_at.tolist()
    for j, (start, n) in enumerate(zip(starts, send)):
        if start < 0 or n < 0 or start + n > operand.shape[0]:
            raise RuntimeError(f"ragged_all_to_all: rows [{start}, {start + n}) for rank {j} are outside the "
                               f"operand's {operand.shape[0]} rows")
    for j, (place, n) in enumerate(zip(places, recv)):
        if place < 0 or n < 0 or place + n > output.shape[0]:
            raise RuntimeError(f"ragged_all_to_all: rank {j}'s rows land at [{place}, {place + n}), outside the "
                               f"output's {output.shape[0]} rows")
    pieces = [operand[start:start + n] for start, n in zip(starts, send)]
    outgoing = torch.cat(pieces).contiguous() if pieces else operand[:0]
    incoming = c10d.wait_tensor(c10d.all_to_all_single(outgoing, recv, send, group_name))
    result = output.clone(memory_format=torch.contiguous_format)
    for piece, place, n in zip(incoming.split(recv), places, recv):
        if n:
            result[place:place + n] = piece
    return result


_lib.impl("_ragged_all_to_all", _ragged_all_to_all, "CompositeExplicitAutograd")


def _ragged_a2a_setup(ctx, inputs, output):
    operand, out, input_offsets, send_sizes, output_offsets, recv_sizes, group_name = inputs
    ctx.save_for_backward(input_offsets, send_sizes, output_offsets, recv_sizes)
    ctx.operand_meta = (operand.shape, operand.dtype, operand.device)
    ctx.group_name = group_name


def _ragged_a2a_backward(ctx, grad):
    input_offsets, send_sizes, output_offsets, recv_sizes = ctx.saved_tensors
    shape, dtype, device = ctx.operand_meta
    grad = grad.contiguous()
    grad_operand = grad_output = None
    if ctx.needs_input_grad[0]:
        # The reverse routing: rows that arrived from j (at the offset j gave) go back to j's input offset.
        grad_operand = ops._ragged_all_to_all(
            grad, torch.zeros(shape, dtype=dtype, device=device), _offsets_from_peers(output_offsets, ctx.group_name),
            recv_sizes, _offsets_from_peers(input_offsets, ctx.group_name), send_sizes, ctx.group_name)
    if ctx.needs_input_grad[1]:  # output's rows pass through where nothing arrived
        arrived = ops._ragged_all_to_all(
            torch.ones(shape, dtype=grad.dtype, device=device), torch.zeros_like(grad), input_offsets, send_sizes,
            output_offsets, recv_sizes, ctx.group_name)
        grad_output = grad * (1 - arrived)
    return grad_operand, grad_output, None, None, None, None, None


torch.library.register_autograd("tpu::_ragged_all_to_all", _ragged_a2a_backward, setup_context=_ragged_a2a_setup,
                                lib=_lib)
