"""`torch.tpu.ops`: TorchTPU's operators, as functions over `torch.ops.tpu._<name>` (torch_tpu/ops/tpu_ops.py).

Each is a torch.library operator: it runs in every execution mode, is traced by
torch.compile (fakes), and differentiates (docs/compat.md says how).
"""
from __future__ import annotations


import torch

from torch_tpu.ops import tpu_ops as _impl  # defines the operators

__all__ = ["optimization_barrier", "ragged_dot", "ragged_dot_weight_grad", "all_gather_dim", "reduce_scatter_dim",
           "ragged_all_to_all"]
_ops = _impl.ops


def optimization_barrier(tensors):
    """The tensors' values, unchanged, as a point XLA may not move computation across.

    Takes a tensor or a sequence of tensors and returns the same structure (new tensors).
    """
    if isinstance(tensors, torch.Tensor):
        return _ops._optimization_barrier([tensors])[0]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"optimization_barrier expects a tensor or a sequence of tensors, got {type(tensors).__name__}")
    out = _ops._optimization_barrier(list(tensors)) if tensors else []
    return type(tensors)(out) if isinstance(tensors, tuple) else list(out)


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Grouped matmul: rows [s_i, s_i + group_sizes[i]) of `lhs` [m, k] times `rhs[i]` [k, n] -> [m, n].

    Groups are consecutive from row 0; rows past the last group are zeros.
    """
    return _ops._ragged_dot(lhs, rhs, group_sizes)


def ragged_dot_weight_grad(lhs: torch.Tensor, grad: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The gradient of ragged_dot with respect to `rhs`: [g, k, n], group i = lhs_i.T @ grad_i."""
    return _ops._ragged_dot_weight_grad(lhs, grad, group_sizes)


def _group_name(group) -> str:
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    if not dist.is_initialized():
        raise RuntimeError("torch.tpu.ops collectives need an initialized process group "
                           "(torch.distributed.init_process_group)")
    return funcol._resolve_group_name(group if group is not None else dist.group.WORLD)


def all_gather_dim(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim`, in rank order (the group's ranks)."""
    return _ops._all_gather_dim(tensor, dim, _group_name(group))


def reduce_scatter_dim(tensor: torch.Tensor, dim: int, group=None, reduce_op: str = "sum") -> torch.Tensor:
    """The reduction over the group of `tensor`, split along `dim` into one chunk per rank: this rank's chunk."""
    return _ops._reduce_scatter_dim(tensor, dim, reduce_op, _group_name(group))


def ragged_all_to_all(operand: torch.Tensor, output: torch.Tensor, input_offsets: torch.Tensor,
                      send_sizes: torch.Tensor, output_offsets: torch.Tensor, recv_sizes: torch.Tensor,
                      group=None) -> torch.Tensor:
    """`output` with the rows every rank sent here written in (JAX's `lax.ragged_all_to_all` contract).

    This rank sends `operand[input_offsets[j]:][:send_sizes[j]]` to rank j, which places it at
    `output_offsets[j]` of its output; `recv_sizes[j]` rows arrive from rank j. Offsets and
    sizes count rows (the first dimension) and are one per rank of the group.
    """
    return _ops._ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   _group_name(group))
