"""Lowerings of the functional collectives (`torch.ops._c10d_functional`) inside torch.compile graphs.

A graph holding these ops becomes one SPMD XLA program over its process group's
mesh (torch_tpu/distributed/compiled.py): each lowering sees this rank's block and
moves data with the same per-rank functions as the process group's own programs
(ops/_collective.py, mesh axis "r", one position per group rank). Eager keeps
c10d's kernels (`eager=False`): there each op calls the process group, a program of
its own (skinny mode).
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torch_tpu.ops import _collective
from torch_tpu.ops.registry import register

c10d = torch.ops._c10d_functional
AXIS = _collective.AXIS


def _op(name: str) -> str:
    name = name.lower()
    if name not in ("sum", "avg", "min", "max", "product"):
        raise ValueError(f"tpu_dist: reduce op {name!r} is not supported (sum, avg, min, max, product)")
    return name


def _in_spmd_program() -> bool:
    """Whether the group's mesh axis is bound. Only the SPMD program of a graph or segment runs these
    lowerings (no eager kernel); outside it they are traced for their result's shape alone (DeferAndFuse
    checks a recorded op abstractly, defer._check), and give a value of that shape."""
    try:
        lax.axis_size(AXIS)
    except NameError:
        return False
    return True


def all_reduce(x, reduce_op, group_name):
    op = _op(reduce_op)
    if not _in_spmd_program():
        return x
    return _collective.reduce(x, op, lax.axis_size(AXIS))


def all_gather_into_tensor(x, group_size, group_name):
    if not _in_spmd_program():
        return jnp.concatenate([x] * group_size)
    return lax.all_gather(x, AXIS, axis=0, tiled=True)


def reduce_scatter_tensor(x, reduce_op, group_size, group_name):
    op = _op(reduce_op)
    if not _in_spmd_program():
        return x[: x.shape[0] // group_size]
    (scatter,) = _collective.block_fn("reduce_scatter", (op,), group_size)(x.reshape(-1))
    return scatter.reshape((x.shape[0] // group_size, *x.shape[1:]))


def broadcast(x, src, group_name):
    if not _in_spmd_program():
        return x
    return _collective.one_from(x, src)


def wait_tensor(x):
    return jnp.asarray(x)  # the program finishes as a whole: nothing to wait for inside it


for _op_overload, _fn in (
    (c10d.all_reduce.default, all_reduce),
    (c10d.all_gather_into_tensor.default, all_gather_into_tensor),
    (c10d.reduce_scatter_tensor.default, reduce_scatter_tensor),
    (c10d.broadcast.default, broadcast),
    (c10d.wait_tensor.default, wait_tensor),
):
    register(_op_overload, _fn, eager=False)
