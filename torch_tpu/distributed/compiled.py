"""torch.compile graphs holding functional collectives: one SPMD XLA program per graph.

A graph of the compile backend (compile/graph.py) whose ATen graph calls
`_c10d_functional` collectives is compiled as a `shard_map` over the mesh of its
process group: every rank's graph program is the same program, its buffers are
this rank's blocks, and the collectives' lowerings (ops/collectives.py) move data
inside it. No process-group call and no program of its own per collective.

Owns: finding a graph's group, the SPMD executable (local buffers in and out).
Does not own: planning or tracing graphs (compile/graph.py), the lowerings (ops/).
"""
from __future__ import annotations

import sys

import jax
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from torch_tpu.distributed import programs

stats = {"graphs": 0, "calls": 0, "recorded": 0}  # SPMD programs built, run; collectives recorded


def graph_group(gm: torch.fx.GraphModule):
    """The tpu_dist group a graph's functional collectives run on, or None if it has none.

    Raises `ValueError` for a graph the SPMD program cannot hold (collectives on several
    groups, or on a group that is not tpu_dist); the backend then runs the graph in eager.
    """
    names = set()
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
            continue
        if target is torch.ops._c10d_functional.wait_tensor.default:
            continue
        name = node.kwargs.get("group_name", node.args[-1] if node.args else None)
        names.add(name)
    if not names:
        return None
    if len(names) > 1:
        raise ValueError(f"functional collectives on {len(names)} process groups in one graph")
    from torch.distributed.distributed_c10d import _resolve_process_group

    (name,) = names
    group = _resolve_process_group(name) if isinstance(name, str) else name
    if not _is_tpu_dist(group):
        raise ValueError(f"functional collectives on a {type(group).__name__} group (not tpu_dist)")
    return group


def _is_tpu_dist(group) -> bool:
    # Looked up, not imported (process_group imports this module): no tpu_dist group exists before
    # process_group.py was imported.
    process_group = sys.modules.get("torch_tpu.distributed.process_group")
    return process_group is not None and isinstance(group, process_group.ProcessGroupTPU)


def fused_group():
    """The group of collectives recorded into DeferAndFuse segments: the default group (spmd_safe's)."""
    import torch.distributed as dist

    return dist.group.WORLD


def record_all_reduce(tensors, op: str, group) -> None:
    """Record an spmd_safe all_reduce into the pending DeferAndFuse graph (fused with the work around it).

    The in-place functional collective, run by the executor as any in-place op with a lowering:
    recorded, not launched; the segment holding it becomes one SPMD program when it runs.
    """
    from torch_tpu.eager import executor, opspec
    from torch_tpu.ops import registry

    lowering = registry.get(torch.ops._c10d_functional.all_reduce.default)
    spec = opspec.spec(torch.ops._c10d_functional.all_reduce_.default)
    for t in tensors:
        executor.execute(spec, lowering, True, t, op, group.group_name)
    stats["recorded"] += 1


class SpmdExecutable:
    """A traced program function as a jitted shard_map over the group's mesh, called on this rank's arrays.

    The calling convention of the single-device executables it stands in for (the compile
    backend's graphs, DeferAndFuse segments): a tuple of lists of this rank's arrays in, its
    results out, every result flat (a storage's layout). A 1-D or N-d argument is this rank's
    block along dimension 0; a 0-d one (a runtime scalar) is passed as is.
    """

    def __init__(self, fn, group, example_args: tuple, donate: bool = True):
        self.group = group
        m = programs.mesh(group._devices)
        self.sharded, self.replicated = programs._sharding(m), NamedSharding(m, P())
        self.size = m.size
        specs = jax.tree_util.tree_map(lambda a: P(programs.AXIS) if a.ndim else P(), example_args)

        def body(*args):
            return jax.tree_util.tree_map(lambda o: o.reshape(-1), fn(*args))

        self.program = jax.jit(
            jax.shard_map(body, mesh=m, in_specs=specs, out_specs=P(programs.AXIS), check_vma=False),
            donate_argnums=(0,) if donate else (),
        )
        stats["graphs"] += 1

    def _global(self, a):
        if not a.ndim:
            return jax.make_array_from_single_device_arrays((), self.replicated, [a])
        return jax.make_array_from_single_device_arrays((a.shape[0] * self.size, *a.shape[1:]), self.sharded, [a])

    def __call__(self, *args):
        stats["calls"] += 1
        group = self.group
        args = jax.tree_util.tree_map(self._global, args)
        # Launched like a skinny collective: a missing rank raises within the group's timeout.
        group._flush_p2p()
        group._seq += 1
        results = group._bounded("a fused program's collectives", group._seq, lambda: self.program(*args))
        return jax.tree_util.tree_map(lambda r: r.addressable_data(0), results)
