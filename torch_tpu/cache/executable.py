"""Compiled XLA executables to bytes and back, without pickle.

Owns: serializing the executable inside a `jax.stages.Compiled` with the PJRT
client's `serialize_executable`, loading such bytes with the client's
`deserialize_executable`, and calling a loaded executable like the `Compiled`
it came from. Does not own keys, envelopes or storage.

Why not `jax.experimental.serialize_executable`: it pickles JAX's internal
executable object, and unpickling runs arbitrary code. Why not `jax.export`: it
stores StableHLO, so a load still compiles. The PJRT client's own format (the
one JAX's persistent compilation cache stores) is bytes XLA parses; we add
the calling convention (flat arguments in, flat results out, the output
pytree from the lowering) ourselves. docs/cache.md has the details.
"""
from __future__ import annotations

import operator

import jax
from jax._src.lib import _jax


def serialize(compiled) -> bytes:
    """The PJRT bytes of a `jax.stages.Compiled`'s executable."""
    runtime = compiled.runtime_executable()
    return runtime.client.serialize_executable(runtime)


def parameter_count(compiled) -> int:
    """How many flat arguments the executable takes (with keep_unused=True: every leaf)."""
    return len(compiled.runtime_executable().get_parameter_layouts())


class LoadedExecutable:
    """A deserialized executable, called with the same pytrees as the `Compiled` it was saved from.

    Arguments are flattened and passed to PJRT as they are (they must already
    be on the executable's device, as the executors' are); the flat results
    are rebuilt into `out_tree`.
    """

    __slots__ = ("runtime", "out_tree", "n_inputs", "_execute")

    def __init__(self, runtime, out_tree, n_inputs: int):
        self.runtime = runtime
        self.out_tree = out_tree
        self.n_inputs = n_inputs
        self._execute = runtime.execute_sharded

    def __call__(self, *args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if len(leaves) != self.n_inputs:
            raise TypeError(f"cached executable takes {self.n_inputs} arrays, got {len(leaves)}")
        results = self._execute(leaves).disassemble_into_single_device_arrays()
        return self.out_tree.unflatten([r for (r,) in results])

    def runtime_executable(self):
        return self.runtime


def _flat_pair(tree):
    """(n, m) if `tree` is a pair of flat lists ([*] * n, [*] * m), else None."""
    if tree.node_data() != (tuple, None):
        return None
    children = tree.children()
    if len(children) != 2:
        return None
    counts = tuple(child.num_leaves for child in children)
    for child, n in zip(children, counts):
        if child != jax.tree_util.tree_structure([0] * n):
            return None
    return counts


def result_handlers(arrays) -> list:
    """JAX's own result handlers for outputs like `arrays` (same avals, shardings, committedness).

    NOTE(jax 0.10): `consume_with_handlers` with any other callable first makes every result a
    single-device array with a fresh sharding object (~0.7 us each on a CPU host); these handlers
    reuse the given sharding, as JAX's own dispatch does (`jax._src.lib._jax`, no public name).
    """
    return [_jax.array_result_handler(a.aval, a.sharding, a.committed, True) for a in arrays]


def _adopting_handlers(execute, n_outputs: int):
    """`execute(flat)` -> the flat result arrays: the first call's results give the later calls' handlers."""
    handlers = [operator.itemgetter(0)] * n_outputs  # each result's array on its one device

    def run(flat):
        nonlocal handlers
        results = execute(flat)
        if handlers is not None and isinstance(handlers[0], operator.itemgetter):
            arrays = results.consume_with_handlers(handlers)
            handlers = result_handlers(arrays)
            return arrays
        return results.consume_with_handlers(handlers)

    return run


def _pair_call(runtime, n_first: int, n_outputs: int):
    """The executors' calling convention, without pytree work: (list, list) -> (list, list)."""
    run = _adopting_handlers(runtime.execute_sharded, n_outputs) if n_outputs else None

    def call(arrays, scalars):
        results = run(arrays + scalars) if run else []
        return results[:n_first], results[n_first:]

    call.runtime_executable = lambda: runtime
    return call


def _flat_list(tree):
    """n if `tree` is a flat list of n leaves, else None."""
    return tree.num_leaves if tree == jax.tree_util.tree_structure([0] * tree.num_leaves) else None


def _list_call(runtime, n_outputs: int):
    """DeferAndFuse's calling convention, without pytree work: lists of arrays -> a list."""
    run = _adopting_handlers(runtime.execute_sharded, n_outputs) if n_outputs else None

    def call(*lists):
        return run([a for arrays in lists for a in arrays]) if run else []

    call.runtime_executable = lambda: runtime
    return call


def direct_launch(executable, n_arguments: int, fresh: list, updated: list):
    """`executable` (a `jax.stages.Compiled` or a callable from `deserialize`, taking the executors'
    (arrays, scalars) pair) as a `_native.DirectLaunch`, or None where that cannot be done.

    `fresh`/`updated`: the results of one launch, whose avals and shardings every later launch
    has (the executors' byte key fixes every input's shape, dtype and device). The native
    cache-hit path then calls PJRT's `execute_sharded` itself: JAX's C++ dispatch of a
    `Compiled` (pytree flattening, argument checks) and the Python frame of a loaded
    executable's call are skipped. None for an executable taking more parameters than its
    arguments (hoisted constants, effect tokens): it stays behind JAX's dispatch.
    """
    from torch_tpu import _native

    runtime_of = getattr(executable, "runtime_executable", None)
    results = [*fresh, *updated]
    if runtime_of is None or not results or not all(isinstance(r, jax.Array) for r in results):
        return None
    runtime = runtime_of()
    try:
        n_parameters = len(runtime.get_parameter_layouts())
    except jax.errors.JaxRuntimeError:  # token parameters (ordered effects) have no layout
        return None
    if n_parameters != n_arguments:
        return None
    return _native.DirectLaunch(runtime.execute_sharded, _jax.ExecuteResults.consume_with_handlers,
                                result_handlers(results), len(fresh))


_lapack_ready = False


def _prepare_custom_calls(payload: bytes, device) -> None:
    """Make the host libraries an executable's custom calls jump into ready before it runs.

    NOTE(jax 0.10): on XLA:CPU, factorizations (cholesky, LU, QR, eigh, SVD...) are custom calls
    into LAPACK whose function pointers jaxlib fills in lazily, when a LAPACK op is first *lowered*
    in the process. An executable loaded from the compile cache skips lowering, so its custom call
    jumped through a null pointer: a segfault (issue 13). Lowering one small LAPACK op, once, fills
    every pointer (through the public API); the target names are in the payload's HLO.
    """
    global _lapack_ready
    if _lapack_ready or device.platform != "cpu" or b"lapack_" not in payload:
        return
    import jax.numpy as jnp

    jax.jit(jax.lax.linalg.cholesky).lower(jnp.ones((1, 1), jnp.float32))
    _lapack_ready = True


def deserialize(payload: bytes, device, in_tree, out_tree):
    """Load PJRT bytes onto `device` as a callable taking `in_tree` and returning `out_tree`.

    `in_tree` is the tree of `(args, kwargs)`, as `jax.stages.Lowered.in_tree`.
    Raises if XLA cannot parse the bytes.
    """
    _prepare_custom_calls(payload, device)
    runtime = device.client.deserialize_executable(payload, [device])
    args = in_tree.children()[0] if in_tree.node_data() == (tuple, None) and in_tree.children() else None
    no_kwargs = args is not None and in_tree.children()[1] == jax.tree_util.tree_structure({})
    outs = _flat_pair(out_tree)
    if no_kwargs and _flat_pair(args) is not None and outs is not None:
        return _pair_call(runtime, outs[0], out_tree.num_leaves)
    if (no_kwargs and all(_flat_list(child) is not None for child in args.children())
            and _flat_list(out_tree) is not None):
        return _list_call(runtime, out_tree.num_leaves)
    return LoadedExecutable(runtime, out_tree, in_tree.num_leaves)
