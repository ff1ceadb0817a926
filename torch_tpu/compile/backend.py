"""The Dynamo backend "tpu": AOTAutograd graphs, each one XLA program (graph.py).

`tpu_backend(gm, example_inputs, **options)` is what `torch.compile(backend="tpu")`
calls with each Dynamo graph. AOTAutograd (torch._functorch) functionalizes it and
splits it into a forward and a backward ATen graph (or one inference graph), with the
decompositions of `decompositions()`; each becomes a `graph.GraphFunction`.

Owns: the backend, its options and the decomposition choice.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

from torch_tpu.config import config

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Options:
    """`torch.compile(model, backend="tpu", options={...})`."""

    # Write every ATen FX graph (graph_<n>_<name>.py) and the StableHLO of every program it
    # becomes (graph_<n>_<name>_<k>.mlir) into this directory.
    dump_dir: str | None = None
    # XLA compile options passed through to the compiler: (name, value) pairs, e.g.
    # {"xla_cpu_enable_fast_math": False}. They are part of the compile cache's key.
    xla_flags: tuple = ()

    @staticmethod
    def parse(options: dict) -> "Options":
        known = {f.name for f in dataclasses.fields(Options)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise RuntimeError(f"Unexpected option(s) {unknown} for torch.compile(backend='tpu'); "
                               f"known options are {sorted(known)}")
        flags = options.get("xla_flags") or {}
        if not isinstance(flags, dict):
            raise TypeError(f"xla_flags must be a dict of XLA option names to values, got {type(flags).__name__}")
        dump = options.get("dump_dir", config.compile_dump_dir)
        return Options(dump_dir=dump or None, xla_flags=tuple(sorted(flags.items())))

    def dump_graph(self, fn) -> None:
        if self.dump_dir is None:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        fn.dump_index = _next_dump_index()
        with open(os.path.join(self.dump_dir, f"graph_{fn.dump_index}_{fn.name}.py"), "w") as f:
            f.write(fn.gm.print_readable(print_output=False))

    def dump_program(self, fn, traced, sharding, args, k: int) -> None:
        if self.dump_dir is None:
            return
        import jax

        text = jax.jit(traced, out_shardings=sharding, keep_unused=True).lower(*args).as_text()
        with open(os.path.join(self.dump_dir, f"graph_{fn.dump_index}_{fn.name}_{k}.mlir"), "w") as f:
            f.write(text)


_dumped = 0


def _next_dump_index() -> int:
    global _dumped
    _dumped += 1
    return _dumped


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

    from torch_tpu.compile import plan
    from torch_tpu.eager import opspec
    from torch_tpu.ops import registry
    from torch_tpu.runtime import platform

    platform.get()  # loads the lowering table
    lowered = registry.table()
    table = {}
    for op, fn in decomposition_table.items():
        if not isinstance(op, torch._ops.OpOverload) or op in lowered or op in plan.EMPTY:
            continue
        if op is aten._unsafe_view.default:
            continue
        s = opspec.spec(op)
        if s.is_view and not s.writes:
            continue
        functional = opspec.functional_counterpart(op)
        if functional is not None and functional in lowered:
            continue
        if plan.lowered_out_variant(op) is not None or plan.lowered_inplace_variant(op) is not None:
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


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: `torch.compile(model, backend="tpu")` calls it with each captured graph.

    `options` are the keyword options of `Options` (dump_dir, xla_flags), or
    `options={...}` as `torch.compile(..., options=...)` passes them.
    """
    if "options" in options:
        options = {**(options.pop("options") or {}), **options}
    options.pop("mode", None)  # torch.compile modes tune Inductor; one program per graph needs none
    parsed = Options.parse(options)

    from torch._dynamo.backends.common import aot_autograd

    from torch_tpu.compile.frames import skip_library_frames

    skip_library_frames()
    from torch._functorch.partitioners import default_partition

    from torch_tpu.compile.graph import GraphFunction

    def compiler(name):
        return lambda graph_module, inputs: GraphFunction(graph_module, name, parsed)

    aot = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                       inference_compiler=compiler("inference"), decompositions=decompositions(),
                       partition_fn=default_partition, keep_inference_input_mutations=True)
    return aot(gm, example_inputs)
