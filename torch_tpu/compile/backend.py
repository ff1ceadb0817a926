"""The Dynamo backend "tpu": AOTAutograd graphs, each one XLA program (graph.py).

`tpu_backend(gm, example_inputs, **options)` is what `torch.compile(backend="tpu")`
calls with each Dynamo graph. AOTAutograd (torch._functorch) functionalizes it and
splits it into a forward and a backward ATen graph (or one inference graph), with the
decompositions of `decompositions()`; each becomes a `graph.GraphFunction`.

Owns: the backend and its options (the decomposition choice: decompositions.py).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from torch_tpu.compile.decompositions import decompositions
from torch_tpu.config import config



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
