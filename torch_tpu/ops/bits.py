"""Lazy conjugate and negative bits (`x.conj()`, `x._neg_view()`) on tpu tensors.

PyTorch resolves these bits before most kernels run (its Conjugate/Negative
fallbacks), but passes them through to a few ops that BLAS-style backends
handle themselves: copy_, clone and the matrix products. Our programs read
storage values, so those ops resolve the bits first (registered here as
preparations of their lowered kernels; copy_ uses `resolved`/`stripped`).
"""
from __future__ import annotations

import torch

from torch_tpu.ops.registry import aten, prepare


def has_bits(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_conj() or t.is_neg())


def stripped(t: torch.Tensor) -> torch.Tensor:
    """A view of t's stored values: t with its conjugate and negative bits cleared."""
    if t.is_conj():
        t = t.conj()  # conj() of a conjugate view clears the bit
    if t.is_neg():
        t = t._neg_view()
    return t


def resolved(t: torch.Tensor) -> torch.Tensor:
    """t's value as a tensor without lazy bits (a new tensor if t had any)."""
    if not has_bits(t):
        return t
    value = stripped(t)
    if t.is_conj():
        value = aten._conj_physical.default(value)
    if t.is_neg():
        value = aten.neg.default(value)
    return value


def apply_bits(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The stored values that make a tensor with `like`'s bits read as `value`."""
    if like.is_conj():
        value = aten._conj_physical.default(value)
    if like.is_neg():
        value = aten.neg.default(value)
    return value


def _resolve_read_arguments(op):
    writes = {i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    names = [a.name for a in op._schema.arguments]

    def prepare_args(*args, **kwargs):
        if not any(has_bits(a) for a in args) and not any(has_bits(v) for v in kwargs.values()):
            return args, kwargs
        args = tuple(a if i in writes else resolved(a) if has_bits(a) else a for i, a in enumerate(args))
        kwargs = {k: v if names.index(k) in writes else resolved(v) if has_bits(v) else v for k, v in kwargs.items()}
        return args, kwargs

    prepare_args.only_resolves_lazy_bits = True  # kernels.py keeps such ops on the boxed hit path
    return prepare_args


# The non-view ops PyTorch lets through with the bits set (its fallthrough lists, torch 2.13).
_PASSED_THROUGH = (
    aten.clone.default,
    aten.mm.default, aten.mm.out, aten.bmm.default, aten.bmm.out,
    aten.addmm.default, aten.addmm.out, aten.addmm_.default,
    aten.baddbmm.default, aten.baddbmm.out, aten.baddbmm_.default,
    aten.dot.default, aten.dot.out, aten.vdot.default, aten.vdot.out,
    aten.linalg_solve_triangular.default, aten.linalg_solve_triangular.out,
)

for _op in _PASSED_THROUGH:
    prepare(_op, only_on_miss=True)(_resolve_read_arguments(_op))  # the hit path refuses lazy bits
