"""Planning one ATen FX graph as one XLA program, from the eager executors' op programs.

`Plan(gm, key, level)` walks the graph for one concrete argument signature on meta tensors
with the eager model of memory: every value is a view (sizes, strides, storage offset) of a
*slot*, a flat buffer like a tpu storage's. Inputs are the storages of the tpu arguments; view
ops only make new metadata over the same slot; every other op becomes the `OpProgram` the
strict executor would build for the same arguments (program.build: PyTorch's meta run and
promotion, the lowering table, runtime scalars, random (seed, offset), precision), reading
its slots and giving fresh slots and updated ones. `Plan.function()` is the traced function
running those programs' traces in order, so compiled and eager results are computed by the
same lowerings. CPU values (a non-capturable optimizer's step counts) become host steps run
by PyTorch before each launch (`Plan.run_host`).

Owns: planning, the traced graph function, host steps.
Does not own: launching (graph.py), what ops compute (ops/), op programs (eager/program.py).
"""
from __future__ import annotations

import functools
import importlib
import math
import operator

import jax.numpy as jnp
import torch

from torch_tpu.compile.decompositions import EMPTY, decompositions, lowered_inplace_variant, lowered_out_variant
from torch_tpu.eager import opspec
from torch_tpu.eager import program as program_mod
from torch_tpu.eager.opspec import Arg
from torch_tpu.ops import checks, registry
from torch_tpu.runtime import dtypes, strided

aten = torch.ops.aten
_TENSOR, _SCALAR, _SCALAR_LIST = program_mod.TENSOR, program_mod.SCALAR, program_mod.SCALAR_LIST
_NUMBERS = (int, float, bool, complex)
# Views that only set a tensor's conjugate or negative bit: a program's ops read values, not bits, so
# in a (functional) graph each is its physical op, a fresh value (AOTAutograd's complex-mul backward
# takes `_conj` of an input; as a plain view the conjugation was lost).
BIT_VIEWS = {aten._conj.default: aten._conj_physical.default, aten._neg_view.default: aten.neg.default}


class Unsupported(Exception):
    """The graph has something one XLA program cannot hold; it runs op by op in eager instead."""


class Value:
    """A tensor while planning: a meta tensor viewing slot `slot`."""

    __slots__ = ("slot", "meta")

    def __init__(self, slot: int, meta: torch.Tensor):
        self.slot = slot
        self.meta = meta


class HostValue:
    """A CPU tensor while planning (an optimizer's `step` counts, their bias corrections).

    CPU values are computed on the host, by PyTorch, before each launch (`Plan.host_steps`);
    a 0-dim one read by a device op is a runtime scalar of the program.
    """

    __slots__ = ("index", "meta")

    def __init__(self, index: int, meta: torch.Tensor):
        self.index = index
        self.meta = meta


class HostRef:
    """A runtime scalar of the program: element `k` of its host-scalar vector."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


class Step:
    """One op program in the graph: global slots in/out and its scalars."""

    __slots__ = ("prog", "inputs", "scalars", "rng", "fresh", "updated")

    def __init__(self, prog, inputs, scalars, rng, fresh, updated):
        self.prog = prog
        self.inputs = inputs  # global slot per program input slot
        self.scalars = scalars  # Python values (constants of the trace)
        self.rng = rng  # index among the graph's random ops, or None
        self.fresh = fresh  # global slot per fresh output buffer
        self.updated = updated  # global slot per updated program slot


_programs: dict = {}  # op signature -> OpProgram (the compile backend's own level-1 table)
# Graph constants up to this size become literals of the program; a larger one runs the graph in eager.
_MAX_CONSTANT_BYTES = 1 << 20


class Plan:
    """A graph planned for one concrete argument signature."""

    def __init__(self, gm: torch.fx.GraphModule, key: tuple, level: str, nd_outputs: bool = True):
        self.slot_layout: list[tuple] = []  # (torch dtype, nbytes) per slot
        self.input_slots: list[int] = []  # slots read from storages, in first-argument order
        self.unwritten: set[int] = set()  # input slots whose storage was never written: zeros
        self.zero_slots: list[int] = []  # slots of empty factories
        self.constant_slots: dict[int, object] = {}  # slot -> the NumPy values of a graph constant
        self.steps: list[Step] = []
        # per graph output: ("t", slot, entry, OutputMeta) | ("alias", argument, sizes, strides, offset)
        # | ("host", index) | ("py", value)
        self.outputs: list = []
        self.n_rng = 0
        self.level = level
        # Outputs in their N-d shapes, flattened by a second (reshape) program: see `_physical`.
        # Dynamic-shape graphs return flat buffers instead: one XLA compile per new size, not two.
        self.nd_outputs = nd_outputs
        self.n_host = 0  # host values (CPU placeholders, then results of host steps)
        self.host_constants: dict[int, torch.Tensor] = {}  # host values that depend on no input: their values
        self.host_inputs: list[tuple[int, int]] = []  # (argument position, host index)
        self.host_steps: list[_HostStep] = []  # mutating ones in host_mutations, run last
        self.host_mutations: list[_HostStep] = []
        self.host_scalars: list[int] = []  # host index of each runtime scalar the program reads
        self.arguments_of: dict[int, list] = {}  # input slot -> [(argument position, dtype)]
        self._build(gm, key)
        written = {s for step in self.steps for s in step.updated}
        self.mutated = [s for s in self.input_slots if s in written]  # input slots the graph writes
        self.outputs = [self._alias(out, written) for out in self.outputs]
        self.indexable = all(program_mod.indexable(step.prog) for step in self.steps)

    # ------------------------------------------------------------ planning
    def _new_slot(self, dtype, nbytes) -> int:
        self.slot_layout.append((dtype, nbytes))
        return len(self.slot_layout) - 1

    def _build(self, gm, key) -> None:
        args_key, self.device = key[0], key[1]
        env: dict = {}
        slot_of: dict[int, int] = {}  # argument slot index (within the key) -> plan slot
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # AOTAutograd's graphs are functional but for input mutations, written back by copy_ at the end.
        written_inputs = {n.args[0] for n in gm.graph.nodes
                          if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in placeholders}
        for position, (node, entry) in enumerate(zip(placeholders, args_key)):
            if entry is not None and entry[0] == "H":
                env[node] = self._host_value(torch.empty_strided(entry[2], entry[3], dtype=entry[1], device="meta"))
                self.host_inputs.append((position, env[node].index))
            else:
                env[node] = self._input(entry, slot_of)
                if isinstance(env[node], Value):
                    self.arguments_of.setdefault(env[node].slot, []).append((position, entry[1]))
        for node in placeholders:  # after them all: input slots come first
            if node not in written_inputs:
                env[node] = self._as_traced(env[node], node)
        self.outputs = [self._output(v) for v in _flat_outputs(self._walk(gm, env))]

    def _walk(self, gm, env: dict):
        """Plan `gm`'s nodes after its placeholders (already in `env`); its output, substituted."""
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return _substitute(node.args[0], env)
            if node.op == "get_attr":  # AOTAutograd lifts parameters to inputs: what is left are constants
                env[node] = self._constant(gm, node.target)
                continue
            if node.op != "call_function":
                raise Unsupported(f"{node.op} node {node.target}")
            try:
                env[node] = self._as_traced(
                    self._call(node.target, _substitute(node.args, env), _substitute(node.kwargs, env)), node)
            except Unsupported:
                raise
            except Exception as err:
                err.add_note(f"[torch_tpu compile] while planning node {node.name}: {node.format_node()}")
                raise

    def _input(self, entry, slot_of):
        if entry is None or entry[0] != _TENSOR:
            return None if entry is None else entry[1]
        _, dtype, sizes, strides, offset, arg_slot, slot_dtype, nbytes, written = entry
        slot = slot_of.get(arg_slot)
        if slot is None:
            slot = slot_of[arg_slot] = self._new_slot(slot_dtype, nbytes)
            self.input_slots.append(slot)
            if not written:
                self.unwritten.add(slot)
        base = torch.empty((nbytes // slot_dtype.itemsize,), dtype=slot_dtype, device="meta")
        if dtype != slot_dtype:
            base = base.view(dtype)
        return Value(slot, base.as_strided(sizes, strides, offset))

    def _as_traced(self, value, node):
        """`value` laid out with the strides AOTAutograd traced for `node`, copied if they differ.

        The graph's view ops were decided on the traced strides (a `view` valid there can fail on
        another layout). Our programs' results are dense (program.OutputMeta), so a result PyTorch
        lays out otherwise (a saved q/k/v: non-dense views of one projection) arrives in another
        layout; a copy into the traced strides keeps the rest of the graph as traced. Intermediates
        are never written in a functional graph, so the copy changes no aliasing."""
        val = node.meta.get("val")
        if not isinstance(value, Value) or not isinstance(val, torch.Tensor) or val.dtype != value.meta.dtype:
            return value
        shape, strides = tuple(val.shape), tuple(val.stride())
        if not all(isinstance(x, int) for x in (*shape, *strides)) or shape != tuple(value.meta.shape):
            return value  # symbolic (dynamic) shapes: planned as they come
        if all(a == b for size, a, b in zip(shape, strides, value.meta.stride()) if size > 1):
            return value
        extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides)) if all(shape) else 0
        slot = self._new_slot(val.dtype, extent * val.dtype.itemsize)
        self.zero_slots.append(slot)
        base = torch.empty((extent,), dtype=val.dtype, device="meta")
        target = Value(slot, base.as_strided(shape, strides, 0))
        self._call(aten.copy_.default, [target, value], {})
        return target

    def _constant(self, gm, target: str) -> Value:
        """A tensor constant of the graph (`torch.tensor([...])` in the traced code)."""
        value = gm
        for name in target.split("."):
            value = getattr(value, name, None)
        if isinstance(value, torch.fx.GraphModule):
            return value  # a subgraph of a higher-order op (torch.cond's branches)
        if not isinstance(value, torch.Tensor) or value.is_sparse or value.is_quantized:
            raise Unsupported(f"graph attribute {target}")
        return self._literal(value, f"graph attribute {target}")

    def _literal(self, value: torch.Tensor, what: str) -> Value:
        """A slot the program fills with `value`'s values (an XLA literal, part of the program and its
        cache key)."""
        if value.numel() * value.element_size() > _MAX_CONSTANT_BYTES:
            raise Unsupported(f"{what}: a constant of over {_MAX_CONSTANT_BYTES} bytes")
        dtypes.to_jax(value.dtype)  # a dtype the device has, or a clear error
        host = value.detach().to("cpu", copy=True).contiguous()
        slot = self._new_slot(host.dtype, host.numel() * host.element_size())
        self.constant_slots[slot] = dtypes.tensor_to_numpy(host.reshape(-1))
        return Value(slot, torch.empty(host.shape, dtype=host.dtype, device="meta"))

    def _host_value(self, meta) -> HostValue:
        self.n_host += 1
        return HostValue(self.n_host - 1, meta)

    def _host_call(self, target, args, kwargs):
        """A node over CPU tensors only: run by PyTorch on the host before each launch.

        One that depends on no graph input (a factory such as `torch.eye(n)`, and ops over such
        values) is also run once now, so its value can become a literal of the program where the
        graph moves it to the device (`torch.eye(n).to(x.device)`)."""
        result = target(*_metas(args), **_metas(kwargs))
        out = _wrap_host(result, self)
        record = _HostStep(target, _host_refs(args), _host_refs(kwargs), _host_refs(out))
        s = opspec.spec(target)
        if isinstance(out, HostValue) and not s.writes and torch.Tag.nondeterministic_seeded not in target.tags:
            known = [v for v in _flat_outputs([list(args), list(kwargs.values())]) if isinstance(v, HostValue)]
            if all(v.index in self.host_constants for v in known) and out.meta.numel() * out.meta.element_size() \
                    <= _MAX_CONSTANT_BYTES:
                self.host_constants[out.index] = target(*_host_constant_args(args, self.host_constants),
                                                        **_host_constant_args(kwargs, self.host_constants))
        if s.writes:
            self.host_mutations.append(record)
        else:
            self.host_steps.append(record)
        return out

    def _host_scalar(self, value: HostValue) -> HostRef:
        if value.meta.dim() != 0 or value.meta.dtype.is_complex:
            raise Unsupported("a CPU tensor that is not a real 0-dim scalar, read by a tpu op")
        if value.index not in self.host_scalars:
            self.host_scalars.append(value.index)
        return HostRef(self.host_scalars.index(value.index))

    def _output(self, value):
        if isinstance(value, HostValue):
            return ("host", value.index)
        if not isinstance(value, Value):
            if isinstance(value, torch.Tensor):
                raise Unsupported("a graph output that is not a tpu value")
            return ("py", value)
        meta = value.meta
        sizes, strides = tuple(meta.shape), tuple(meta.stride())
        entry = (meta.dtype, sizes, strides, meta.storage_offset())
        return ("t", value.slot, entry, program_mod.OutputMeta(sizes, strides, meta.dtype))

    def _alias(self, out, written):
        """An output viewing an input storage the graph does not write: ("alias", argument, metadata).

        A forward graph returns parameters and their transposes among the values it saves for
        backward; as views of the argument (what eager's view ops return) they cost no copy in the
        program, and autograd's version counter sees a later in-place update of the parameter.
        """
        if out[0] != "t" or out[1] in written or out[1] not in self.arguments_of:
            return out
        dtype, sizes, strides, offset = out[2]
        for position, arg_dtype in self.arguments_of[out[1]]:
            if arg_dtype == dtype:
                return ("alias", position, sizes, strides, offset)
        return out

    def _call(self, target, args, kwargs):
        if target is torch.ops.higher_order.with_effects:
            return self._with_effects(*args, **kwargs)
        if target is torch.ops.higher_order.cond:
            return self._cond(*args, **kwargs)
        if target is torch.ops.higher_order.while_loop:
            return self._while_loop(*args, **kwargs)
        dense = _dense_hops().get(target)
        if dense is not None:
            return self._inline_dense(dense, args, kwargs)
        if not isinstance(target, torch._ops.OpOverload):
            if target is operator.getitem:
                return args[0][args[1]]
            return self._python(target, args, kwargs)
        if target is torch.ops.prims.device_put.default and isinstance(args[0], (Value, HostValue)):
            device = torch.device(args[1] if len(args) > 1 else kwargs["device"])
            if isinstance(args[0], HostValue) and device.type == "tpu" and args[0].index in self.host_constants:
                return self._literal(self.host_constants[args[0].index], "a CPU tensor moved to the device")
            if isinstance(args[0], Value):
                if device.type != "tpu":
                    raise Unsupported(f"a copy of a tpu value to {device}")
                # A constant moved to the device (`torch.tensor([...]).to(x.device)`): a tpu value already.
                return self._lowered(aten.clone.default, registry.get(aten.clone.default), False, [args[0]], {})
        flat = _flat_outputs([list(args), list(kwargs.values())])
        on_host = any(isinstance(v, HostValue) for v in flat)
        if (on_host and not any(isinstance(v, Value) for v in flat)) or _host_factory(kwargs):
            return self._host_call(target, args, kwargs)
        if target in EMPTY:
            meta = target(*_metas(args), **_metas(kwargs))
            slot = self._new_slot(meta.dtype, meta.untyped_storage().nbytes())
            self.zero_slots.append(slot)
            return Value(slot, meta)
        if target in BIT_VIEWS:
            target = BIT_VIEWS[target]
        lowering = registry.get(target)
        via_functional = False
        if lowering is None:
            functional = opspec.functional_counterpart(target)
            lowering = registry.get(functional) if functional is not None else None
            via_functional = lowering is not None
        if lowering is not None:
            return self._lowered(target, lowering, via_functional, args, kwargs)
        s = opspec.spec(target)
        if s.is_view and not s.writes:
            return self._view(target, args, kwargs)
        if target is aten._unsafe_view.default:  # a view of a value AOTAutograd made contiguous
            return self._view(aten.view.default, [self._contiguous(args[0]), *args[1:]], kwargs)
        if not any(kind == "fresh" for kind, _ in s.returns):  # sym_size, sym_stride, ...: metadata
            return self._python(target, args, kwargs)
        out_variant = lowered_out_variant(target)
        if out_variant is not None:  # arange: eager runs its out= variant, so do we
            return self._via_out(target, out_variant, args, kwargs)
        inplace = lowered_inplace_variant(target)
        if inplace is not None:  # normal_functional(x): normal_ on a copy of x
            copy = self._lowered(aten.clone.default, registry.get(aten.clone.default), False, [args[0]], {})
            return self._lowered(inplace, registry.get(inplace), False, [copy, *args[1:]], kwargs)
        raise Unsupported(f"{target} has no lowering and no decomposition")

    def _via_out(self, op, out_variant, args, kwargs):
        meta_kwargs = {k: ("meta" if k == "device" else v) for k, v in _metas(kwargs).items()}
        meta = op(*_metas(args), **meta_kwargs)
        slot = self._new_slot(meta.dtype, meta.untyped_storage().nbytes())
        self.zero_slots.append(slot)
        names = set(opspec.spec(out_variant).names)
        out_kwargs = {k: v for k, v in kwargs.items() if k in names}
        out_kwargs["out"] = Value(slot, meta)
        return self._lowered(out_variant, registry.get(out_variant), False, args, out_kwargs)

    def _with_effects(self, token, op, *args, **kwargs):
        """An op AOTAutograd orders by an effect token (a placeholder threaded through the graph, None at
        run time): the op becomes a step like any other and the token passes through. Our steps run in graph
        order inside one program, which is the order the token asks for. Only ops whose effect is a
        check of values are planned (`_linalg_check_errors`: its error is the step's value check)."""
        if not (token is None or isinstance(token, HostValue)) or not (isinstance(op, torch._ops.OpOverload)
                and registry.get(op) is not None and checks.declares(registry.get(op).fn)):
            raise Unsupported(f"the effectful op {op} (with_effects)")
        result = self._call(op, list(args), kwargs)
        return (token,) if result is None else (token, *(result if isinstance(result, tuple) else (result,)))

    def _cond(self, pred, true_graph, false_graph, operands):
        """torch.cond: each branch planned as a subgraph over the operands' slots, the two run by one
        `lax.cond` step (a branch's steps are traced inside it, so only the taken one runs)."""
        if not isinstance(pred, Value) or pred.meta.numel() != 1:
            raise Unsupported("torch.cond on a predicate that is not a tpu value")
        slots = self._operand_slots(operands)
        buffer_of = [slots.index(o.slot) for o in operands]
        layouts = [self.slot_layout[slot] for slot in slots]
        metas = [o.meta for o in operands]
        branches = [self._subgraph(graph, metas, buffer_of, layouts) for graph in (true_graph, false_graph)]
        results = [[(dtype, sizes) for _, dtype, sizes, _, _ in reads] for _, reads in branches]
        if results[0] != results[1]:
            raise Unsupported("torch.cond branches with different results")
        return self._subgraph_step(_Cond(_read_of(pred.meta), branches), [pred.slot, *slots], results[0])

    def _while_loop(self, cond_graph, body_graph, carried, additional):
        """torch.while_loop: the condition and the body planned as subgraphs over the carried values (each
        a dense buffer of its own) and the additional inputs' slots, run by one `lax.while_loop` step."""
        carried, additional = list(carried), list(additional)
        slots = self._operand_slots(carried + additional)
        extra = list(dict.fromkeys(o.slot for o in additional))
        buffer_of = list(range(len(carried))) + [len(carried) + extra.index(o.slot) for o in additional]
        dense = [torch.empty(tuple(c.meta.shape), dtype=c.meta.dtype, device="meta") for c in carried]
        layouts = [(m.dtype, m.numel() * m.dtype.itemsize) for m in dense] + [self.slot_layout[s] for s in extra]
        metas = dense + [a.meta for a in additional]
        condition = self._subgraph(cond_graph, metas, buffer_of, layouts)
        body = self._subgraph(body_graph, metas, buffer_of, layouts)
        carried_layouts = [(m.dtype, tuple(m.shape)) for m in dense]
        if [(dtype, sizes) for _, dtype, sizes, _, _ in body[1]] != carried_layouts or len(condition[1]) != 1 \
                or condition[1][0][2] not in ((), (1,)):
            raise Unsupported("a torch.while_loop whose body or condition results do not fit its carried values")
        initial = [(slots.index(c.slot), _read_of(c.meta)) for c in carried]
        step = _WhileLoop(condition, body, initial, [slots.index(s) for s in extra])
        return self._subgraph_step(step, slots, carried_layouts)

    def _inline_dense(self, dense, args, kwargs):
        """A higher-order op planned inline as its dense implementation: PyTorch's own math over ATen ops,
        traced on fake tpu tensors of the operands' layouts, so the graph stays one program."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.utils import _pytree as pytree

        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, v in enumerate(flat) if isinstance(v, Value)]
        if any(isinstance(v, HostValue) for v in flat):
            raise Unsupported("a higher-order op with an operand that is not a tpu value")
        self._operand_slots([flat[i] for i in positions])  # concrete shapes only

        def traced(*tensors):
            values = list(flat)
            for i, tensor in zip(positions, tensors):
                values[i] = tensor
            call_args, call_kwargs = pytree.tree_unflatten(values, spec)
            return dense(*call_args, **call_kwargs)

        with FakeTensorMode(allow_non_fake_inputs=True):
            fakes = [torch.empty_strided(flat[i].meta.shape, flat[i].meta.stride(), dtype=flat[i].meta.dtype,
                                         device=self.device) for i in positions]
            sub = make_fx(traced, decomposition_table=decompositions(), tracing_mode="real")(*fakes)
        env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], [flat[i] for i in positions]))
        return self._walk(sub, env)

    def _operand_slots(self, operands) -> list:
        """The distinct slots of a higher-order op's operands, in order (each must be a tpu value)."""
        for o in operands:
            if not isinstance(o, Value):
                raise Unsupported("a higher-order op with an operand that is not a tpu value")
            if not all(isinstance(x, int) for x in (*o.meta.shape, *o.meta.stride())):
                raise Unsupported("a higher-order op with symbolic shapes")
        return list(dict.fromkeys(o.slot for o in operands))

    def _subgraph(self, graph, metas, buffer_of, layouts):
        """(plan, reads): `graph` planned over buffers, operand i (of meta `metas[i]`) viewing buffer
        `buffer_of[i]` (of (dtype, nbytes) `layouts[j]`); reads: how each result is read (see `_run_subgraph`)."""
        entries = tuple((_TENSOR, m.dtype, tuple(m.shape), tuple(m.stride()), m.storage_offset(),
                         buffer_of[i], *layouts[buffer_of[i]], True) for i, m in enumerate(metas))
        plan = Plan(graph, (entries, self.device), self.level)
        if plan.n_rng or plan.n_host or plan.mutated or any(step.prog.checks for step in plan.steps):
            raise Unsupported("a higher-order op's subgraph with random ops, CPU values, mutations or value checks")
        reads = []
        for out in plan.outputs:
            if out[0] == "t":
                _, slot, (dtype, sizes, strides, offset), _ = out
                reads.append((("slot", slot), dtype, sizes, strides, offset))
            elif out[0] == "alias":  # an operand returned (or a view of one)
                _, position, sizes, strides, offset = out
                reads.append((("buffer", buffer_of[position]), metas[position].dtype, sizes, strides, offset))
            else:
                raise Unsupported("a higher-order op's subgraph returning a value that is not a tpu tensor")
        return plan, reads

    def _subgraph_step(self, step, inputs: list, layouts: list) -> tuple:
        """Add a higher-order op's step reading `inputs` (slots); its results: dense values of `layouts`."""
        fresh = [self._new_slot(dtype, math.prod(sizes) * dtype.itemsize) for dtype, sizes in layouts]
        self.steps.append(Step(step, inputs, (), None, fresh, []))
        return tuple(Value(slot, torch.empty(sizes, dtype=dtype, device="meta"))
                     for slot, (dtype, sizes) in zip(fresh, layouts))

    def _python(self, target, args, kwargs):
        """A node computing metadata (SymInt arithmetic, sym_size): evaluated now, on meta tensors."""
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise Unsupported(f"the higher-order op {target.name()}")
        result = target(*_metas(args), **_metas(kwargs))
        if isinstance(result, torch.Tensor):
            raise Unsupported(f"{target} computes a tensor outside the lowering table")
        return result

    def _view(self, op, args, kwargs):
        base = next((a for a in _flat_outputs(list(args)) if isinstance(a, Value)), None)
        if base is None:
            raise Unsupported(f"view op {op} without a tensor argument")
        result = op(*_metas(args), **_metas(kwargs))
        return _wrap(result, base.slot)

    def _contiguous(self, value: Value) -> Value:
        meta = value.meta
        if strided.is_contiguous(meta.shape, meta.stride()):
            return value
        return self._lowered(aten.clone.default, registry.get(aten.clone.default), False, [value], {})

    def _lowered(self, op, lowering, via_functional, args, kwargs):
        s = opspec.spec(op, lowering.mutates, lowering.runtime)
        full = s.normalize(tuple(args), kwargs)
        prepare = registry.preparation(op)
        if prepare is not None and not getattr(prepare, "only_resolves_lazy_bits", False):
            value_dependent = getattr(prepare, "value_dependent", None)
            if (value_dependent(*_metas(full)) if value_dependent is not None else
                    any(isinstance(v, Value) and v.meta.dtype == torch.bool for v in _flat_outputs(full))):
                raise Unsupported(f"{op} with boolean masks (a value-dependent shape)")
        entries, scalars, local_of, local_slots = [], [], {}, []

        def tensor_entry(v):
            if isinstance(v, HostValue):  # a CPU scalar tensor: a runtime scalar, as in eager
                scalars.append(self._host_scalar(v))
                return (program_mod.CPU_SCALAR, v.meta.dtype)
            if not isinstance(v, Value):
                raise Unsupported(f"{op}: a tensor argument that is not a tpu value")
            local = local_of.get(v.slot)
            if local is None:
                local = local_of[v.slot] = len(local_slots)
                local_slots.append(v.slot)
            meta = v.meta
            offset = meta.storage_offset()
            if offset:  # the program reads it from its scalars: here a trace-time constant
                scalars.append(offset)
            return (_TENSOR, meta.dtype, tuple(meta.shape), tuple(meta.stride()),
                    program_mod.DYNAMIC if offset else 0, local)

        for i, (kind, value) in enumerate(zip(s.kinds, full)):
            if value is None or kind == Arg.GENERATOR:
                entries.append(None)
            elif kind <= Arg.OPT_TENSOR:
                if isinstance(value, (Value, HostValue)):
                    entries.append(tensor_entry(value))
                elif type(value) in _NUMBERS:
                    entries.append((_SCALAR, type(value)))
                    scalars.append(value)
                else:
                    raise Unsupported(f"{op}: argument {s.names[i]} is {type(value).__name__}")
            elif kind <= Arg.OPT_TENSOR_LIST:
                entries.append(tuple(None if t is None else tensor_entry(t) for t in value))
            elif kind <= Arg.OPT_SCALAR:
                value = _concrete(value)
                if lowering.static_scalars:
                    entries.append(("V", value))
                else:
                    entries.append((_SCALAR, type(value)))
                    scalars.append(value)
            elif kind == Arg.SCALAR_LIST:
                value = [_concrete(v) for v in value]
                entries.append((_SCALAR_LIST, tuple(map(type, value))))
                scalars.extend(value)
            else:
                value = _concrete(value)
                entries.append(tuple(value) if type(value) is list else value)
        slots = tuple(self.slot_layout[g] for g in local_slots)
        key = (s.name, self.device, *entries, slots, *program_mod.default_dtype_entry())
        if lowering.precision:
            key = (*key, self.level)
        prog = _programs.get(key)
        if prog is None:
            example = [0 if isinstance(v, HostRef) else v for v in scalars]
            prog = program_mod.build(key, s, lowering, example, via_functional)
            if prog.resize:
                raise Unsupported(f"{op} resizes an out= argument")
            _programs[key] = prog
        rng = None
        if lowering.rng:
            rng, self.n_rng = self.n_rng, self.n_rng + 1
        fresh, outs = [], []
        for m in prog.outputs:
            if m is None:
                outs.append(None)
                continue
            slot = self._new_slot(m.dtype, m.nbytes)
            fresh.append(slot)
            outs.append(Value(slot, torch.empty_strided(m.sizes, m.strides, dtype=m.dtype, device="meta")))
        inputs = [local_slots[i] for i in prog.input_slots]
        updated = [local_slots[i] for i in prog.updated_slots]
        self.steps.append(Step(prog, inputs, tuple(scalars), rng, fresh, updated))
        return program_mod.returns(s, prog, full, outs)

    # ------------------------------------------------------------ tracing
    def function(self):
        """The traced function: (donated buffers, [*kept buffers, rng words, host scalars]) -> (outputs, mutated
        inputs' buffers). Two flat lists in and out: the calling form the compile cache's loaded executables
        run without pytree work (cache/executable.py)."""
        read_slots = [s for s in self.input_slots if s not in self.unwritten]
        donated_slots = [s for s in read_slots if s in set(self.mutated)]
        kept_slots = [s for s in read_slots if s not in set(self.mutated)]

        def graph(donated, rest):
            kept, rng, host = rest[:-2], rest[-2], rest[-1]
            bufs = [None] * len(self.slot_layout)
            for s, array in zip(donated_slots, donated):
                bufs[s] = array
            for s, array in zip(kept_slots, kept):
                bufs[s] = array
            flags = self._run_steps(bufs, rng, host)
            outs = []
            for out in self.outputs:
                if out[0] != "t":
                    continue
                _, slot, (dtype, sizes, strides, offset), m = out
                value = _read(bufs[slot], (sizes, strides, offset, dtype))
                outs.append(_physical(value, m) if self.nd_outputs else strided.to_flat(value, m.strides))
            # The flags (one row per checked op) after the mutated buffers (eager/valuecheck.py).
            return outs, [bufs[s] for s in self.mutated] + ([jnp.stack(flags)] if flags else [])

        return graph, donated_slots, kept_slots

    def _run_steps(self, bufs: list, rng, host) -> list:
        """Trace the steps over `bufs` (the input slots filled; the rest filled here): the checked steps' flags."""
        for s in (*self.unwritten, *self.zero_slots):
            dtype, nbytes = self.slot_layout[s]
            bufs[s] = jnp.zeros((nbytes // dtype.itemsize,), dtypes.to_jax(dtype))
        for s, values in self.constant_slots.items():
            bufs[s] = jnp.asarray(values, dtypes.to_jax(self.slot_layout[s][0]))
        flags = []
        for step in self.steps:
            scalars = [host[v.k] if isinstance(v, HostRef) else v for v in step.scalars]
            if step.rng is not None:
                scalars.extend(_rng_words(rng, step.rng))
            fresh, updated = step.prog.trace([bufs[s] for s in step.inputs], scalars)
            if step.prog.checks:  # a value-checked op: its error flag follows its updated slots
                flags.append(updated[-1])
                updated = updated[:-1]
            for s, array in zip(step.fresh, fresh):
                bufs[s] = array
            for s, array in zip(step.updated, updated):
                bufs[s] = array
        return flags

    def run_host(self, args) -> tuple[list, list]:
        """The host steps on this call's CPU arguments: (host values, the program's host scalars)."""
        env = [None] * self.n_host
        for position, index in self.host_inputs:
            env[index] = args[position]
        for step in self.host_steps:
            step.run(env)
        scalars = [env[i].item() for i in self.host_scalars]
        for step in self.host_mutations:
            step.run(env)
        return env, scalars


def _read_of(meta: torch.Tensor) -> tuple:
    """(sizes, strides, offset, dtype): how a value is read from its slot's buffer."""
    return tuple(meta.shape), tuple(meta.stride()), meta.storage_offset(), meta.dtype


def _read(buf, read: tuple):
    sizes, strides, offset, dtype = read
    return strided.read(strided.reinterpret(buf, dtypes.to_jax(dtype)), sizes, strides, offset)


def _run_subgraph(subgraph: tuple, buffers: list) -> list:
    """Trace a planned subgraph (`Plan._subgraph`) over its input buffers: its results, each dense and flat."""
    plan, reads = subgraph
    bufs = [None] * len(plan.slot_layout)
    for s, array in zip(plan.input_slots, buffers):
        bufs[s] = array
    plan._run_steps(bufs, None, None)
    return [_read(bufs[where] if kind == "slot" else buffers[where], (sizes, strides, offset, dtype)).reshape(-1)
            for (kind, where), dtype, sizes, strides, offset in reads]


class _Cond:
    """The step of a torch.cond: `lax.cond` over two planned branches. It has the part of an op program
    `Plan.function` uses (`trace`, `checks`); `lowering` None: a graph holding one is not indexed by
    signature, whose code hash does not cover the subgraphs' code."""

    checks = False
    lowering = None

    def __init__(self, pred: tuple, branches: list):
        self.pred, self.branches = pred, branches

    def trace(self, inputs, scalars):
        from jax import lax

        pred = _read(inputs[0], self.pred).reshape(()).astype(bool)
        true_fn, false_fn = (lambda operands, b=b: _run_subgraph(b, operands) for b in self.branches)
        return lax.cond(pred, true_fn, false_fn, list(inputs[1:])), []


class _WhileLoop:
    """The step of a torch.while_loop: `lax.while_loop` over the carried values (dense buffers), the
    planned condition and body reading them and the additional inputs (see `_Cond`)."""

    checks = False
    lowering = None

    def __init__(self, condition: tuple, body: tuple, initial: list, extra: list):
        self.condition, self.body = condition, body
        self.initial = initial  # per carried value: (input index, read)
        self.extra = extra  # input index of each additional buffer

    def trace(self, inputs, scalars):
        from jax import lax

        extra = [inputs[i] for i in self.extra]
        carried = [_read(inputs[i], read).reshape(-1) for i, read in self.initial]

        def condition(values):
            return _run_subgraph(self.condition, [*values, *extra])[0].reshape(()).astype(bool)

        return lax.while_loop(condition, lambda values: _run_subgraph(self.body, [*values, *extra]), carried), []


def _host_constant_args(obj, constants):
    """A constant host step's arguments with its host values replaced by their values."""
    if isinstance(obj, HostValue):
        return constants[obj.index]
    if isinstance(obj, (list, tuple)):
        return _same_kind(obj, [_host_constant_args(o, constants) for o in obj])
    if isinstance(obj, dict):
        return {k: _host_constant_args(v, constants) for k, v in obj.items()}
    return obj


def _host_factory(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def _wrap_host(result, plan):
    if isinstance(result, torch.Tensor):
        return plan._host_value(result)
    if isinstance(result, (list, tuple)):
        return _same_kind(result, [_wrap_host(r, plan) for r in result])
    return result


def _host_refs(obj):
    """A host step's arguments with host values as ("h", index) markers."""
    if isinstance(obj, HostValue):
        return _HostIndex(obj.index)
    if isinstance(obj, Value):
        raise Unsupported("a CPU op reading a tpu value (it would wait for the device)")
    if isinstance(obj, (list, tuple)):
        return _same_kind(obj, [_host_refs(o) for o in obj])
    if isinstance(obj, dict):
        return {k: _host_refs(v) for k, v in obj.items()}
    return obj


class _HostIndex(int):
    """An index into a call's host values (see `_host_refs`)."""


class _HostStep:
    """One host node (target, arguments and outputs with `_HostIndex` markers), run on each call's host values.

    Its argument getters are made once, when planned: an optimizer's host steps are foreach ops
    over every parameter's `step` count, rebuilt from lists of indices on every call.
    """

    __slots__ = ("target", "_getters", "_kw_getters", "_store")

    def __init__(self, target, args, kwargs, out):
        self.target = target
        self._getters = [_getter(a) for a in args]
        self._kw_getters = {k: _getter(v) for k, v in kwargs.items()}
        self._store = _storer(out)

    def run(self, env: list) -> None:
        kwargs = {k: get(env) for k, get in self._kw_getters.items()} if self._kw_getters else {}
        self._store(env, self.target(*[get(env) for get in self._getters], **kwargs))


def _getter(obj):
    """A function of the host values giving a host step's argument `obj` (a marker, a list of them, a constant)."""
    if type(obj) is _HostIndex:
        return operator.itemgetter(obj)
    if isinstance(obj, (list, tuple)) and obj and all(type(o) is _HostIndex for o in obj):
        indices, kind = tuple(obj), type(obj) if type(obj) in (list, tuple) else list
        return lambda env: kind([env[i] for i in indices])
    if not _has_marker(obj):
        return lambda env: obj
    return lambda env: _host_args(obj, env)


def _storer(out):
    """A function storing a host step's result into the host values at the markers of `out`."""
    if type(out) is _HostIndex:
        def store(env, result):
            env[out] = result
        return store
    if isinstance(out, (list, tuple)) and all(type(o) is _HostIndex for o in out):
        indices = tuple(out)

        def store_all(env, results):
            for i, r in zip(indices, results):
                env[i] = r
        return store_all
    return lambda env, result: _assign(env, out, result)


def _has_marker(obj) -> bool:
    if type(obj) is _HostIndex:
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_marker(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_marker(v) for v in obj.values())
    return False


def _host_args(obj, env):
    if type(obj) is _HostIndex:
        return env[obj]
    if isinstance(obj, (list, tuple)):
        return _same_kind(obj, [_host_args(o, env) for o in obj])
    if isinstance(obj, dict):
        return {k: _host_args(v, env) for k, v in obj.items()}
    return obj


def _assign(env, out, result) -> None:
    if type(out) is _HostIndex:
        env[out] = result
    elif isinstance(out, (list, tuple)):
        for o, r in zip(out, result):
            _assign(env, o, r)


def _physical(value, m):
    """A fresh output in its memory-order N-d shape (flattened after the launch: graph._flattener).

    NOTE(xla-cpu): as in DeferAndFuse (defer._output_shapes), a program whose outputs are
    flattening bitcasts of fusions reading broadcast operands gets slow scalar code.
    """
    if value.ndim < 2:
        return value.reshape(-1)
    if strided.is_contiguous(m.sizes, m.strides):
        return value
    return jnp.transpose(value, strided.dense_permutation(m.sizes, m.strides))


def _rng_words(rng, k: int):
    """The (seed lo, seed hi, offset lo, offset hi) of the k-th random op: the call's offset + k, as in eager."""
    seed_lo, seed_hi, offset_lo, offset_hi = rng[0], rng[1], rng[2], rng[3]
    lo = offset_lo + jnp.uint32(k)
    hi = offset_hi + (lo < offset_lo).astype(jnp.uint32)
    return [seed_lo, seed_hi, lo, hi]


def _concrete(value):
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise Unsupported("a symbolic value left in a specialised graph")
    if isinstance(value, (list, tuple)):
        return _same_kind(value, [_concrete(v) for v in value])
    return value


def _same_kind(obj, items: list):
    """`items` as a plain list or tuple, like `obj` (FX's immutable containers do not reach ops)."""
    return items if isinstance(obj, list) else tuple(items)


@functools.cache
def _dense_hops() -> dict:
    """Higher-order ops planned as their dense implementation (`Plan._inline_dense`): FlexAttention's."""
    module = importlib.import_module("torch._higher_order_ops.flex_attention")  # (its import registers the ops)
    return {torch.ops.higher_order.flex_attention: module.sdpa_dense,
            torch.ops.higher_order.flex_attention_backward: module.sdpa_dense_backward}


def _substitute(obj, env):
    if isinstance(obj, torch.fx.Node):
        return env[obj]
    if isinstance(obj, (list, tuple)):
        return _same_kind(obj, [_substitute(o, env) for o in obj])
    if isinstance(obj, dict):
        return {k: _substitute(v, env) for k, v in obj.items()}
    return obj


def _metas(obj):
    if isinstance(obj, (Value, HostValue)):
        return obj.meta
    if isinstance(obj, (list, tuple)):
        return _same_kind(obj, [_metas(o) for o in obj])
    if isinstance(obj, dict):
        return {k: _metas(v) for k, v in obj.items()}
    return obj


def _wrap(result, slot):
    if isinstance(result, torch.Tensor):
        return Value(slot, result)
    if isinstance(result, (list, tuple)):
        return _same_kind(result, [_wrap(r, slot) for r in result])
    return result


def _flat_outputs(obj) -> list:
    if isinstance(obj, (list, tuple)):
        out = []
        for o in obj:
            out.extend(_flat_outputs(o))
        return out
    return [obj]
