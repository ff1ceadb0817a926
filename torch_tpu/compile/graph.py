"""One ATen FX graph as one XLA program: keying, compiling and launching (planning: plan.py).

`GraphFunction` is what the backend hands AOTAutograd for a forward, backward or
inference graph. On a call it keys the real arguments (tensor metadata, storages,
integer values: a dynamic-shape graph is specialised per concrete size), and on a
new key it plans the graph (`plan.Plan`) and compiles it (`program.compile_indexed`,
through every level of the compile cache). A known key launches the executable: the
storages a graph writes (a parameter, a running mean, an optimizer state) get the new
buffers and their old ones are donated; fresh outputs become new tpu tensors, outputs
viewing an unwritten input are views of the argument.

Owns: argument keys, compiling, launching, outputs, the counters (`stats`).
Does not own: planning (plan.py), what ops compute (ops/), the cache (cache/).
"""
from __future__ import annotations

import hashlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_tpu import _native, metrics, precision, recompiles
from torch_tpu.compile.plan import _TENSOR, EMPTY, Plan, Unsupported, lowered_inplace_variant, lowered_out_variant
from torch_tpu.eager import program as program_mod
from torch_tpu.eager import valuecheck
from torch_tpu.runtime import platform, storage
from torch_tpu.runtime.errors import translate_runtime_error

__all__ = ["EMPTY", "GraphFunction", "Plan", "Unsupported", "lowered_inplace_variant", "lowered_out_variant",
           "stats"]


class Stats:
    """Counters of the compile backend (also in `torch_tpu.metrics.report()`)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.graphs = 0  # graphs handed to the backend (forward, backward, inference)
        self.plans = 0  # graph programs planned (one per graph and concrete signature)
        self.calls = 0  # compiled graph calls
        self.eager_graphs = 0  # graphs run op by op in eager (see `Unsupported`)
        self.donations = 0  # input buffers donated to graph programs
        self.host_steps = 0  # CPU ops run by PyTorch between launches (a non-capturable optimizer's step counts)

    def as_dict(self) -> dict:
        return dict(vars(self))


stats = Stats()
metrics.add_section("torch.compile (backend tpu)", stats.as_dict)


_flatteners: dict = {}


def _flattener(arrays: list, device: int):
    """The executable flattening outputs shaped like `arrays` into flat storage buffers.

    A compiled reshape that donates them (a bitcast, no copy).
    """
    shapes = tuple((a.shape, str(a.dtype)) for a in arrays)
    executable = _flatteners.get((shapes, device))
    if executable is None:
        sharding = platform.get().shardings[device]
        out_tree = jax.tree_util.tree_structure([0] * len(arrays))
        executable = program_mod.compile_indexed(lambda xs: [x.reshape(-1) for x in xs], sharding, (arrays,),
                                                 ("torch.compile flatten", shapes), out_tree, donate_argnums=(0,))
        _flatteners[(shapes, device)] = executable
    return executable


# ------------------------------------------------------------------ the runtime
_signature_of = _native.tensor_signature
_graph_key = _native.graph_key
_buffers = storage.buffers


class Compiled:
    """One planned and compiled graph signature."""

    __slots__ = ("plan", "executable", "donated_slots", "kept_slots", "layouts", "flatten", "checked")


class GraphFunction:
    """The callable AOTAutograd gets for one graph: the list of graph inputs in, the list of outputs out.

    Boxed (`_boxed_call`, an instance attribute so that Dynamo's `disable` wrapper copies it):
    AOTAutograd hands over its argument list, which is cleared so inputs can be freed early.
    """

    def __init__(self, gm: torch.fx.GraphModule, name: str, options):
        self.gm = gm
        self.name = name
        self.options = options
        self.compiled: dict = {}
        self._boxed_call = True
        self.eager = None  # set when the graph cannot be one program
        self.code_hash = hashlib.sha256(gm.code.encode()).hexdigest()
        self.n_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        self.dynamic = any(_symbolic(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder")
        stats.graphs += 1
        self.site = f"{name} graph {stats.graphs}"  # the recompilation explainer's name for this graph
        options.dump_graph(self)

    def __call__(self, args: list):
        if self.eager is not None:
            return self._run_eager(args)
        storage.drain()
        # DeferAndFuse: its pending eager work runs before this graph. Not a materialization point:
        # pending value-check flags wait for one (reading them here waited for the previous graph,
        # so the forward, backward and optimizer programs of a step ran one after the other).
        storage.flush_pending("torch.compile")
        key, addresses, arrays, device = self._key(args)
        if key is None:
            return self._run_eager(args)
        compiled = self.compiled.get(key)
        if compiled is None:
            recompiles.graph_compiled(self.site, args)  # a second key of one graph is a recompile, explained
            compiled = self._compile(key, arrays)
            if compiled is None:
                return self._run_eager(args)
        plan = compiled.plan
        env, host = None, None
        if plan.n_host:
            env, host = plan.run_host(args)
            stats.host_steps += len(plan.host_steps) + len(plan.host_mutations)
        aliases = [_view_of(args[out[1]], out) for out in plan.outputs if out[0] == "alias"]
        args.clear()
        donated = [_own(arrays[s]) for s in compiled.donated_slots]
        kept = [arrays[s] for s in compiled.kept_slots]
        rng = _take_rng(plan.n_rng, device)
        host = _host_vector(host, device)
        stats.calls += 1
        stats.donations += len(donated)
        for s in plan.mutated:  # donated: the storages get the new buffers below
            arrays[s] = None
        try:
            outs, updated = compiled.executable(donated, [*kept, rng, host])
        except jax.errors.JaxRuntimeError as err:
            raise translate_runtime_error(err, f"a torch.compile graph ({self.name})") from None
        del donated
        if compiled.checked:
            updated, flags = updated[:-1], updated[-1]
        for s, array in zip(plan.mutated, updated):
            _buffers[addresses[s]] = (array, plan.slot_layout[s][0])
        if compiled.flatten is not False:
            if compiled.flatten is None:  # the shapes are the plan's: one flattener per compiled signature
                nd = plan.nd_outputs and any(o.ndim != 1 for o in outs)
                compiled.flatten = _flattener(list(outs), device) if nd else False
            if compiled.flatten is not False:
                outs = compiled.flatten(list(outs))
        fresh = _native.new_outputs(compiled.layouts, outs, device, _buffers) if compiled.layouts else []
        results, position, alias = [], 0, 0
        for out in plan.outputs:
            if out[0] == "t":
                results.append(fresh[position])
                position += 1
            elif out[0] == "alias":
                results.append(aliases[alias])
                alias += 1
            elif out[0] == "host":
                results.append(env[out[1]])
            else:
                results.append(out[1])
        if compiled.checked:  # raised at the next materialization point; the graph's results are lost then
            valuecheck.launched_graph(flags, compiled.checked, outs)
        return results

    def _key(self, args):
        """(signature, slot addresses, slot buffers, device) of a call; key None: not for one program."""
        found = _graph_key(args, _buffers, _TENSOR)  # the common case, natively
        if found is None:
            found = self._python_key(args)
            if found is None:
                return None, None, None, None
        entries, addresses, arrays, device = found
        if device < 0:
            device = _native.current_device()
        # Inputs held elsewhere too (another storage's buffer, a pending copy) are not donated.
        # The default dtype too: Dynamo recompiles when it changes, into a graph of the same code.
        return (entries, device, precision.matmul_precision(), *program_mod.default_dtype_entry()), addresses, arrays, device

    @staticmethod
    def _python_key(args):
        """`_native.graph_key` for any argument list: (entries, addresses, arrays, device); None: not for one program."""
        entries, addresses, arrays = [], [], []
        slot_of: dict[int, int] = {}
        device = -1
        get_buffer = _buffers.get
        for a in args:
            if isinstance(a, torch.Tensor):
                kind = a.device.type
                if kind != "tpu":
                    if kind != "cpu":
                        return None
                    entries.append(("H", a.dtype, tuple(a.shape), tuple(a.stride())))
                    continue
                dtype, sizes, strides, offset, nbytes, index, address = _signature_of(a)
                if index != device and device != -1:
                    return None
                device = index
                entry = get_buffer(address)
                slot = slot_of.get(address)
                if slot is None:
                    slot = slot_of[address] = len(addresses)
                    addresses.append(address)
                    arrays.append(None if entry is None else entry[0])
                slot_dtype = dtype if entry is None else entry[1]
                entries.append((_TENSOR, dtype, sizes, strides, offset, slot, slot_dtype, nbytes, entry is not None))
            elif a is None or isinstance(a, (int, float, bool)):
                entries.append(("P", a))
            else:
                return None
        return tuple(entries), addresses, arrays, device

    def _compile(self, key, arrays):
        try:
            group = _collective_group(self.gm)
            plan = Plan(self.gm, key, key[2], nd_outputs=not self.dynamic)
        except Unsupported as why:
            self._go_eager(str(why))
            return None
        stats.plans += 1
        fn, donated_slots, kept_slots = plan.function()
        fn = precision.bind(fn, plan.level)
        device = key[1]
        sharding = platform.get().shardings[device]
        donated = [arrays[s] for s in donated_slots]
        kept = [arrays[s] for s in kept_slots]
        rng = _take_rng(0, device)  # only its shape and dtype matter while compiling
        host = _host_vector([0.0] * len(plan.host_scalars), device)
        signature = None
        checked = [str(step.prog.spec.op) for step in plan.steps if step.prog.checks]
        if plan.indexable:
            signature = ("torch.compile", self.code_hash, key, self.options.xla_flags, *(("value checks",) if checked else ()))
        n_outputs = sum(1 for out in plan.outputs if out[0] == "t")
        out_tree = jax.tree_util.tree_structure(([0] * n_outputs, [0] * (len(plan.mutated) + bool(checked))))
        if group is not None:  # functional collectives: one SPMD program over the group (distributed/compiled.py)
            from torch_tpu.distributed.compiled import SpmdExecutable

            executable = SpmdExecutable(fn, group, (donated, [*kept, rng, host]))
        else:
            self.options.dump_program(self, fn, sharding, (donated, [*kept, rng, host]), len(self.compiled))
            executable = program_mod.compile_indexed(fn, sharding, (donated, [*kept, rng, host]), signature, out_tree,
                                                     donate_argnums=(0,), options=self.options.xla_flags)
        compiled = Compiled()
        compiled.plan = plan
        compiled.executable = executable
        compiled.donated_slots = donated_slots
        compiled.kept_slots = kept_slots
        compiled.checked = checked  # the value-checked ops' names, in the order of their flags
        compiled.flatten = None  # found on the first launch: see __call__
        compiled.layouts = tuple((m.sizes, m.strides, m.dtype) for out in plan.outputs if out[0] == "t"
                                 for m in [out[3]])
        self.compiled[key] = compiled
        return compiled

    def _go_eager(self, why: str) -> None:
        stats.eager_graphs += 1
        warnings.warn(f"torch_tpu compile: {self.name} runs op by op in eager ({why})", stacklevel=3)
        self.eager = torch.fx.Interpreter(self.gm)

    def _run_eager(self, args):
        if self.eager is None:
            self.eager = torch.fx.Interpreter(self.gm)
        values = list(args)
        args.clear()
        out = self.eager.run(*values)
        return list(out) if isinstance(out, (list, tuple)) else [out]


def _view_of(arg: torch.Tensor, out) -> torch.Tensor:
    """The argument itself, or a view of it with the output's metadata (no program, no copy)."""
    _, _, sizes, strides, offset = out
    if tuple(arg.shape) == sizes and tuple(arg.stride()) == strides and arg.storage_offset() == offset:
        return arg
    return arg.as_strided(sizes, strides, offset)


def _collective_group(gm):
    """The process group of a graph's functional collectives (None: none); Unsupported if not one tpu_dist group."""
    if not any(getattr(n.target, "namespace", None) == "_c10d_functional" for n in gm.graph.nodes):
        return None
    from torch_tpu.distributed.compiled import graph_group

    try:
        return graph_group(gm)
    except ValueError as why:
        raise Unsupported(str(why)) from None


def _host_vector(values, device: int):
    """The program's host scalars (CPU scalar tensors' values) as one float64 vector: one transfer per call."""
    if not values:  # most graphs have none: one empty vector per device, no transfer
        empty = _NO_HOST.get(device)
        if empty is None:
            empty = _NO_HOST[device] = jax.device_put(np.zeros(0, np.float64), platform.get().devices[device])
        return empty
    return jax.device_put(np.asarray(values or (), np.float64), platform.get().devices[device])


def _own(array):
    """`array`, or a copy of it if another storage also holds it (a donated buffer is deleted)."""
    # References: the caller's list, the storage's buffer entry, this frame's argument, getrefcount's.
    if sys.getrefcount(array) > 4:
        return jnp.copy(array)
    return array


def _symbolic(val) -> bool:
    """Whether a placeholder's example value has symbolic sizes (a dynamic-shape graph)."""
    if isinstance(val, torch.SymInt):
        return True
    return isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape)


def _take_rng(n: int, device: int):
    """The device generator's (seed, offset) for a call with `n` random ops; the offset advances by n (as eager)."""
    if n == 0:
        words = _NO_RNG.get(device)
        if words is None:
            words = _NO_RNG[device] = jax.device_put(np.zeros(4, np.uint32), platform.get().devices[device])
        return words
    generator = _native.default_generator(device)
    seed = generator.initial_seed()
    offset = generator.get_offset()
    generator.set_offset(offset + n)
    words = np.array([seed & 0xFFFFFFFF, seed >> 32, offset & 0xFFFFFFFF, offset >> 32], np.uint32)
    return jax.device_put(words, platform.get().devices[device])


_NO_RNG: dict = {}
_NO_HOST: dict = {}
