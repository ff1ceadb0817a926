"""The lowering table: one pure JAX function per ATen op overload.

A lowering takes JAX arrays (tensor arguments, already read from their
storages and promoted) and Python values (static arguments), in the op's
schema order, and returns JAX arrays. It never touches torch tensors; the
executors convert at the boundary. The same table serves the strict and
defer-and-fuse executors and the torch.compile backend.

Mutating ops are not registered here: in-place and out= variants are derived
from the functional op's schema (eager/opspec.py). A lowering registered on a
mutating op directly follows PyTorch's functionalization convention: it
returns the op's fresh results, then one new value per written argument.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as _Kind

aten = torch.ops.aten


class Promote(enum.Enum):
    """Named type-promotion policies (PyTorch's elementwise kinds)."""

    DEFAULT = _Kind.DEFAULT
    INT_TO_FLOAT = _Kind.INT_TO_FLOAT
    ALWAYS_BOOL = _Kind.ALWAYS_BOOL
    COMPLEX_TO_FLOAT = _Kind.COMPLEX_TO_FLOAT
    BOOL_TO_LONG = _Kind.BOOL_TO_LONG
    NO_OPMATH = _Kind.NO_OPMATH


@dataclass(frozen=True, eq=False)
class Lowering:
    op: torch._ops.OpOverload
    fn: Callable
    # Cast the promoted tensor/scalar arguments to the computation dtype first.
    promote: Promote | None = None
    # Names of the arguments that take part in promotion (default: all tensors and scalars).
    promote_args: tuple[str, ...] | None = None
    # Bake Scalar arguments into the program instead of passing them at run time.
    static_scalars: bool = False
    # The lowering takes a `key=` (jax.random key) derived from the device generator.
    rng: bool = False
    # The program depends on the float32 matmul precision (part of the cache key).
    precision: bool = False
    # Arguments the op writes although its schema does not say so (legacy kernels, e.g.
    # native_batch_norm's running stats): the lowering returns their new values after the
    # op's results, as for a mutating op, and no in-place/out= variants are derived.
    mutates: tuple[str, ...] = ()
    # `float` arguments passed at run time instead of baked into the program: values that change
    # every step (BatchNorm(momentum=None) passes 1/num_batches_tracked), like a learning rate.
    runtime: tuple[str, ...] = ()
    # Output metadata where PyTorch's meta kernel refuses inputs the lowering supports (it checks
    # one backend's limits, e.g. _grouped_mm's CUDA-only bf16): called like the op, on meta tensors.
    meta: Callable | None = None
    # Tensor arguments whose layout picks PyTorch's algorithm (det/slogdet factor A^T of a contiguous
    # real A): the lowering gets `contiguous=`, one bool per name, read from the strides in the
    # program's key (so each layout is its own program, in eager, DeferAndFuse and compiled graphs).
    layout_args: tuple[str, ...] = ()
    # Checks of the call's Python scalars that ATen makes on the host (uniform_'s from <= to): called
    # with the op's arguments before each launch or recording, so a bad value raises at the call as on
    # every PyTorch device, not at the next materialization point as a value check in the program.
    # Its derived in-place and out= variants call it with the op's own arguments (no out= tensors). It may
    # return a function of the op's results, run after the launch (ATen's check of an info).
    host_check: Callable | None = None
    # False: torch.compile graphs only; eager keeps the op's own kernel (collectives: c10d's, which
    # calls the process group; the lowering needs the SPMD program of a graph, ops/collectives.py).
    eager: bool = True


_TABLE: dict[torch._ops.OpOverload, Lowering] = {}


def register(op: torch._ops.OpOverload, fn: Callable, **options) -> Lowering:
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"lowerings register OpOverloads (e.g. aten.add.Tensor), got {op!r}")
    if op in _TABLE:
        raise RuntimeError(f"a lowering for {op} is already registered")
    name = op._schema.name
    overload_name = f"{name}.{op._overloadname}" if op._overloadname != "default" else name
    if torch._C._dispatch_has_kernel_for_dispatch_key(overload_name, "CompositeImplicitAutograd"):
        raise RuntimeError(f"{op} is CompositeImplicitAutograd: it decomposes before reaching 'tpu'; lower its parts")
    lowering = Lowering(op, fn, **options)
    unknown = set(lowering.mutates) - {a.name for a in op._schema.arguments}
    if unknown:
        raise ValueError(f"{op} has no arguments named {sorted(unknown)}")
    floats = {a.name for a in op._schema.arguments if str(a.type) == "float"}
    if set(lowering.runtime) - floats:
        raise ValueError(f"{op}: runtime arguments must be float arguments, got {sorted(set(lowering.runtime) - floats)}")
    tensors = {a.name for a in op._schema.arguments if isinstance(a.type, torch.TensorType)}
    if set(lowering.layout_args) - tensors:
        raise ValueError(f"{op}: layout arguments must be tensor arguments, got {sorted(set(lowering.layout_args) - tensors)}")
    _TABLE[op] = lowering
    return lowering


def lowers(*ops, **options):
    """Decorator: register one function as the lowering of several overloads."""

    def decorate(fn):
        for op in ops:
            register(op, fn, **options)
        return fn

    return decorate


def lower_table(table: dict, **options) -> None:
    """Register one-liners: {op: jax_function}."""
    for op, fn in table.items():
        register(op, fn, **options)


# ---------------------------------------------------------------- torch-level kernels
# An op that cannot be one program (its result shape depends on values: nonzero,
# masked_select, unique...) gets a kernel on torch tensors instead: it runs tpu ops,
# reads a size (one synchronisation), then runs a static-size op (ops/dynamic.py).
# A preparation rewrites an op's arguments before its lowered kernel runs (e.g.
# boolean masks -> index tensors). Both are registered like lowerings: once per op.
_KERNELS: dict = {}
_PREPARE: dict = {}
_ONLY_ON_MISS: set = set()


def _add_once(table: dict, ops, fn):
    for op in ops:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"kernels register OpOverloads, got {op!r}")
        if op in table:
            raise RuntimeError(f"{op} is already registered")
        table[op] = fn
    return fn


def kernel(*ops):
    """Decorator: a torch-level tpu kernel `fn(*args, **kwargs)` for ops with value-dependent shapes."""
    return lambda fn: _add_once(_KERNELS, ops, fn)


def prepare(*ops, only_on_miss: bool = False):
    """Decorator: `fn(*args, **kwargs) -> (args, kwargs)` runs before these ops' lowered kernels.

    only_on_miss: the preparation changes only arguments whose signature (a dtype, a device, a
    layout, a static None) no prepared call's signature has, so a call that finds a cached program
    needs none. The op then keeps its boxed C++ kernel, whose cache hits run without Python, and the
    preparation runs on its Python path (misses and unusual arguments) only.
    """

    def add(fn):
        _add_once(_PREPARE, ops, fn)
        if only_on_miss:
            _ONLY_ON_MISS.update(ops)
        return fn

    return add


def kernels() -> dict:
    return dict(_KERNELS)


def preparation(op) -> Callable | None:
    return _PREPARE.get(op)


def prepared_only_on_miss(op) -> bool:
    """Whether `op`'s preparation is registered `only_on_miss` (see `prepare`)."""
    return op in _ONLY_ON_MISS


def get(op) -> Lowering | None:
    return _TABLE.get(op)


def table() -> dict:
    return dict(_TABLE)
