"""The decompositions AOTAutograd applies to graphs on tpu, and the factories and variants plans take whole.

Owns: which ops are decomposed before planning (`decompositions()`), the empty factories planned as zero
buffers (`EMPTY`), and the lowered out= / in-place variants an op without a lowering runs through.
Does not own: planning (plan.py), the backend (backend.py).
"""
from __future__ import annotations

import functools

import torch

from torch_tpu.eager import opspec
from torch_tpu.ops import registry

aten = torch.ops.aten

# Factories whose values are never read before being written: a zero buffer of their layout.
EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
         aten.new_empty_strided.default, aten.empty_like.default}


@functools.cache
def decompositions() -> dict:
    """The decompositions AOTAutograd applies: torch._decomp's, for exactly the ops we do not lower.

    An op the lowering table lowers (itself, or as the in-place/out= variant of a lowered op)
    stays whole: one lowering, as in eager, instead of the ops a decomposition would make.
    View ops stay (they are metadata over a storage slot, plan.py), and so do the empty
    factories (a zero buffer). Everything else with a decomposition in `torch._decomp`'s table
    is decomposed, recursively, until it reaches lowered ops.
    """
    from torch._decomp import core_aten_decompositions, decomposition_table

    from torch_tpu.runtime import platform

    platform.get()  # loads the lowering table
    lowered = registry.table()
    table = {}
    for op, fn in decomposition_table.items():
        if not isinstance(op, torch._ops.OpOverload) or op in lowered or op in EMPTY:
            continue
        if op is aten._unsafe_view.default:
            continue
        s = opspec.spec(op)
        if s.is_view and not s.writes:
            continue
        functional = opspec.functional_counterpart(op)
        if functional is not None and functional in lowered:
            continue
        if lowered_out_variant(op) is not None or lowered_inplace_variant(op) is not None:
            continue  # run through its lowered out= / in-place variant, as eager does (arange)
        table[op] = fn
    for op, fn in _OWN.items():
        if op not in lowered:
            table[op] = fn
    core = core_aten_decompositions()
    for op in _FROM_CORE:
        if op not in lowered and op in core:
            table[op] = core[op]
    return table


# Factories torch._decomp leaves whole (PyTorch runs them as empty + an in-place fill): written
# as the functional ops eager runs, so random factories draw the same numbers as in eager.
def _full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return aten.full.default(x.shape, fill_value, dtype=dtype or x.dtype, device=device or x.device)


def _rand_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return aten.uniform.default(aten.empty.memory_format(x.shape, dtype=dtype or x.dtype, device=device or x.device))


def _randn_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    empty = aten.empty.memory_format(x.shape, dtype=dtype or x.dtype, device=device or x.device)
    return aten.normal_functional.default(empty)


def _rand(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    empty = aten.empty.memory_format(size, dtype=dtype or torch.get_default_dtype(), device=device)
    return aten.uniform.default(empty, generator=generator)


def _randn(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    empty = aten.empty.memory_format(size, dtype=dtype or torch.get_default_dtype(), device=device)
    return aten.normal_functional.default(empty, generator=generator)


def _embedding_bag_backward(*args, **kwargs):
    from torch_tpu.ops import nn  # its eager kernel routes to the dense (lowered) or the sparse backward

    return nn.embedding_bag_backward(*args, **kwargs)


_OWN = {
    aten._embedding_bag_backward.default: _embedding_bag_backward,
    aten.full_like.default: _full_like,
    aten.rand_like.default: _rand_like,
    aten.randn_like.default: _randn_like,
    aten.rand.default: _rand,
    aten.rand.generator: _rand,
    aten.randn.default: _randn,
    aten.randn.generator: _randn,
}


# Composite ops eager decomposes at dispatch that reach a graph whole, with a decomposition only in
# PyTorch's core ATen set (not in `decomposition_table`): F.one_hot in MoE routing.
_FROM_CORE = (aten.one_hot.default,)


_OPTIONS = {"dtype", "layout", "device", "pin_memory", "memory_format"}


def lowered_out_variant(op):
    """The lowered out= variant of an op that has no lowering itself (aten.arange.start_step -> start_out), or None.

    PyTorch's CompositeExplicitAutograd kernel of such an op allocates its result and calls the
    out= variant; the variant takes the same arguments, less the tensor options.
    """
    if not op._schema.returns or op._schema.name.split("::")[0] != "aten":
        return None
    packet = getattr(aten, op._schema.name.split("::")[1], None)
    if packet is None:
        return None
    names = [a.name for a in op._schema.arguments if a.name not in _OPTIONS]
    for overload in packet.overloads():
        variant = getattr(packet, overload)
        s = opspec.spec(variant)
        if not s.is_out or registry.get(variant) is None:
            continue
        if [n for i, n in enumerate(s.names) if i not in s.writes] == names:
            return variant
    return None


def lowered_inplace_variant(op):
    """The lowered in-place op of a functional op that has no lowering (normal_functional -> normal_), or None."""
    namespace, name = op._schema.name.split("::")
    if namespace != "aten":
        return None
    base = name[: -len("_functional")] if name.endswith("_functional") else name
    packet = getattr(aten, base + "_", None)
    variant = getattr(packet, op._overloadname, None) if packet is not None else None
    if variant is None or registry.get(variant) is None:
        return None
    if [a.name for a in variant._schema.arguments] != [a.name for a in op._schema.arguments]:
        return None
    return variant
