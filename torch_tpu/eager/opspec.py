"""What an op's schema says, read once per op overload.

Owns: argument kinds (tensor, scalar, static...), defaults, which arguments
an op writes (alias info), which returns alias them, and the functional
counterpart of a mutating op (`add_`/`add.out` -> `add.Tensor`).
"""
from __future__ import annotations

import enum
import functools
import sys

import torch


class Arg(enum.IntEnum):
    TENSOR = 0
    OPT_TENSOR = 1
    TENSOR_LIST = 2
    OPT_TENSOR_LIST = 3
    SCALAR = 4  # runtime input unless the lowering asks for static scalars
    OPT_SCALAR = 5
    SCALAR_LIST = 6
    GENERATOR = 7
    STATIC = 8  # part of the cache key (ints, dims, flags, dtypes, floats)


_KINDS = {
    "Tensor": Arg.TENSOR,
    "Optional[Tensor]": Arg.OPT_TENSOR,
    "List[Tensor]": Arg.TENSOR_LIST,
    "List[Optional[Tensor]]": Arg.OPT_TENSOR_LIST,
    "number": Arg.SCALAR,
    "Optional[number]": Arg.OPT_SCALAR,
    "List[number]": Arg.SCALAR_LIST,
    "Optional[Generator]": Arg.GENERATOR,
    "Generator": Arg.GENERATOR,
}

REQUIRED = object()  # default of an argument that has none


class OpSpec:
    __slots__ = ("op", "name", "names", "kinds", "defaults", "index", "writes", "returns", "n_args", "is_view", "is_out",
                 "n_positional")

    def __init__(self, op: torch._ops.OpOverload, mutates: tuple[str, ...] = (), runtime: tuple[str, ...] = ()):
        schema = op._schema
        self.op = op
        # Also the first element of every signature: a str hashes in C (an OpOverload in Python).
        self.name = sys.intern(str(op))
        args = schema.arguments
        self.names = tuple(a.name for a in args)
        self.n_args = len(args)
        self.n_positional = sum(1 for a in args if not a.kwarg_only)
        self.kinds = tuple(Arg.SCALAR if a.name in runtime else _KINDS.get(str(a.type), Arg.STATIC) for a in args)
        self.defaults = tuple(a.default_value if a.has_default_value() else REQUIRED for a in args)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.writes = tuple(i for i, a in enumerate(args)
                            if (a.alias_info is not None and a.alias_info.is_write) or a.name in mutates)
        self.is_out = any(args[i].kwarg_only for i in self.writes)
        # Each return: ("arg", i) when it aliases written argument i, ("value", None) for a non-tensor
        # (e.g. a SymInt, taken from the meta run), else ("fresh", is_list).
        returns = []
        for r in schema.returns:
            alias = r.alias_info
            if alias is not None and alias.is_write:
                target = next(i for i in self.writes  # (a `mutates` argument has no alias info)
                              if args[i].alias_info is not None and args[i].alias_info.before_set == alias.before_set)
                returns.append(("arg", target))
            elif "Tensor" not in str(r.type):
                returns.append(("value", None))
            else:
                returns.append(("fresh", str(r.type).startswith("List")))
        self.returns = tuple(returns)
        self.is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)

    def normalize(self, args: tuple, kwargs: dict) -> list:
        """All arguments in schema order, defaults filled in."""
        full = list(args)
        if len(full) < self.n_args:
            full.extend(self.defaults[len(full):])
        for name, value in kwargs.items():
            full[self.index[name]] = value
        return full

    def call(self, full: list):
        """Call the op itself with a normalized argument list (kwarg-only args by name)."""
        n = self.n_positional
        return self.op(*full[:n], **dict(zip(self.names[n:], full[n:])))

    @property
    def n_fresh(self) -> int:
        return sum(1 for kind, _ in self.returns if kind == "fresh")


@functools.cache
def spec(op: torch._ops.OpOverload, mutates: tuple[str, ...] = (), runtime: tuple[str, ...] = ()) -> OpSpec:
    """The op's spec; `mutates` adds arguments its kernels write that the schema does not mark,
    `runtime` names float arguments that are runtime scalars instead of static values."""
    return OpSpec(op, mutates, runtime)


# Reductions and scans whose out= form, given no dtype, computes in out's dtype (ATen's sum_out,
# cumsum_out...): cumsum(half, out=float) accumulates in float; prod(half, out=long) multiplies longs.
OUT_DTYPE_IS_DTYPE = frozenset(("cumsum", "cumprod", "sum", "prod", "nansum", "mean"))


def computes_in_out_dtype(s: OpSpec) -> bool:
    """Whether `s` is the out= form of an op that, given no dtype, computes in out's (OUT_DTYPE_IS_DTYPE)."""
    return s.is_out and "dtype" in s.index and s.name.split(".")[1] in OUT_DTYPE_IS_DTYPE


# ATen's arange/linspace/logspace/range out= kernels resize `out` (silently) only when its numel
# differs, and otherwise fill it in its own shape and strides, in element order; their meta kernels
# and references resize it to the 1-D result.
RESIZED_ONLY_TO_ANOTHER_NUMEL = frozenset(
    ("aten.arange.start_out", "aten.linspace.out", "aten.logspace.out", "aten.range.out"))


def functional_counterpart(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The non-mutating overload whose results a mutating op writes, or None.

    In-place `foo_.ovl` -> `foo.ovl`; out= `foo.ovl_out` -> the `foo` overload
    with the same non-out arguments. Follows PyTorch's functionalization
    convention: the functional op returns the mutating op's fresh results,
    then one new value per written argument.
    """
    s = spec(op)
    if not s.writes:
        return None
    packet_name = op._schema.name.split("::")[1]
    aten = torch.ops.aten
    if s.is_out:
        packet = getattr(aten, packet_name, None)
        if packet is None:
            return None
        # Only the out= (kwarg-only) arguments are left out: an out= op that also writes an input
        # (_native_batch_norm_legit.out's running stats) has no alias-free counterpart.
        wanted = [(a.name, str(a.type)) for a in op._schema.arguments
                  if not (a.kwarg_only and a.alias_info and a.alias_info.is_write)]
        for overload in packet.overloads():
            candidate = getattr(packet, overload)
            cs = candidate._schema
            if any(a.alias_info is not None for a in cs.arguments):
                continue
            if [(a.name, str(a.type)) for a in cs.arguments] == wanted:
                return candidate
        return None
    if packet_name.endswith("_"):
        packet = getattr(aten, packet_name[:-1], None)
        if packet is None:
            return None
        candidate = getattr(packet, op._overloadname, None)
        if candidate is not None and not spec(candidate).writes:
            return candidate
    return None
