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

import jax
import torch
from jax.sharding import PartitionSpec as P

from torch_tpu.distributed import programs

stats = {"graphs": 0, "calls": 0}


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

    from torch_tpu.distributed.process_group import ProcessGroupTPU

    (name,) = names
    group = _resolve_process_group(name) if isinstance(name, str) else name
    if not isinstance(group, ProcessGroupTPU):
        raise ValueError(f"functional collectives on a {type(group).__name__} group (not tpu_dist)")
    return group


class SpmdExecutable:
    """The graph function as a jitted shard_map over the group's mesh, called on this rank's buffers.

    Same calling convention as the backend's single-device executables:
    (donated, kept, rng, host) local arrays in, (outputs, updated buffers) out; outputs come
    back flat (the storages' layout), so the backend installs them directly.
    """

    def __init__(self, fn, group, donate: bool = True):
        self.group = group
        m = programs.mesh(group._devices)
        self.sharding = programs._sharding(m)
        self.size = m.size

        def body(donated, kept, rng, host):
            outs, updated = fn(donated, kept, rng, host)
            return [o.reshape(-1) for o in outs], list(updated)

        self.program = jax.jit(
            jax.shard_map(body, mesh=m, in_specs=P(programs.AXIS), out_specs=P(programs.AXIS), check_vma=False),
            donate_argnums=(0,) if donate else (),
        )
        stats["graphs"] += 1

    def _global(self, arrays):
        make, sharding, size = jax.make_array_from_single_device_arrays, self.sharding, self.size
        return [make((a.shape[0] * size, *a.shape[1:]), sharding, [a]) for a in arrays]

    def __call__(self, donated, kept, rng, host):
        stats["calls"] += 1
        g, group = self._global, self.group
        args = (g(donated), g(kept), g([rng])[0], g([host])[0])
        del donated
        # Launched like a skinny collective: a missing rank raises within the group's timeout.
        group._flush_p2p()
        group._seq += 1
        outs, updated = group._bounded("a torch.compile graph's collectives", group._seq, lambda: self.program(*args))
        return [o.addressable_data(0) for o in outs], [u.addressable_data(0) for u in updated]
