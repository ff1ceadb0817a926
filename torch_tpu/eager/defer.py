"""DeferAndFuse execution: record ops, run them as fused programs at a materialization point.

In this mode `executor.execute` calls `record` instead of launching. The op's
signature, cached `OpProgram` and runtime scalars (the RNG seed/offset too,
taken now) are exactly Strict's; instead of running the program, a `Node` is
appended to the current graph and the op's results become `Pending` values:
each fresh output gets a new tpu tensor whose storage buffer is a Pending, and
each storage the op writes gets a Pending as its new buffer. Storage-level
truth holds: an in-place op on a view reads and replaces its storage's value,
pending or not, so updates chain exactly as in eager.

`flush` (called through `storage.materialize()` by every reader of values,
when the mode is left, and at the size cap) traces the recorded programs
(`OpProgram.trace`, unchanged) into fused functions whose outputs are only the
pending values whose storages are still alive, so dead intermediates never
get device buffers. Graphs are fingerprinted by structure (op programs,
wiring, live outputs, donations; never values): a repeated graph reuses its
plan and compiled programs. The repeated-operations heuristic (repeats.py)
cuts a graph into segments so that one program serves every repetition of a
block. Inputs that nothing else references any more (old values of storages
the graph overwrote, e.g. parameters updated by an optimizer) are donated to
XLA, which writes the new values in place.

Errors: a new op program is checked abstractly when recorded, so a lowering
that cannot handle its arguments fails at the user's line, as in Strict. A
failure while tracing, compiling or running a fused graph carries a note
naming the op and the user line that recorded it; the values that graph would
have produced are lost (reading them raises).

Threads: one process-wide graph under one lock (the autograd engine records
backward ops on its own thread).

Owns: the recorder, graphs, fingerprints, plans and fused executables, error
attribution. Does not own: signatures and op programs (executor.py,
program.py), where to cut (repeats.py), when to materialize (callers of
`storage.materialize`).
"""
from __future__ import annotations

import contextlib
import math
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_tpu import _native, metrics, recompiles
from torch_tpu import profiler as _trace
from torch_tpu.cache import levels as cache_levels
from torch_tpu.config import config
from torch_tpu.eager import executor
from torch_tpu.eager import program as program_mod
from torch_tpu.eager import cpu_errors, repeats, valuecheck
from torch_tpu.eager.valuecheck import Lost
from torch_tpu.runtime import dtypes, platform, storage, strided
from torch_tpu.runtime.errors import translate_runtime_error

lock = _native.RecorderLock()  # a reentrant lock the native recorder takes without Python
_counts = metrics.counts
_buffers = storage.buffers
_fast_signature = _native.fast_signature
_new_outputs = _native.new_outputs
_OUT = 1 << 20  # a pending value's ref: node index * _OUT + output index


class Pending:
    """A value the current graph will compute: output `ref % _OUT` of node `ref // _OUT`."""

    __slots__ = ("ref",)

    def __init__(self, ref: int):
        self.ref = ref

    def __repr__(self):
        return f"Pending(node={self.ref // _OUT}, output={self.ref % _OUT})"


class Node:
    """One recorded op: its program, where its inputs come from, its runtime scalars, who recorded it."""

    __slots__ = ("prog", "refs", "scalars", "device", "where")

    def __init__(self, prog, refs, scalars, device, where):
        self.prog = prog
        self.refs = refs  # per program input: a pending ref (>= 0) or -1 - index into Graph.ext
        self.scalars = scalars
        self.device = device
        self.where = where  # (code, line) of the user frame, or None


class Graph:
    __slots__ = ("nodes", "descs", "ext", "ext_ids")

    def __init__(self):
        self.nodes: list[Node] = []
        self.descs = bytearray()  # per node _desc(prog, refs): the structural fingerprint, built as recorded
        self.ext: list = []  # concrete input arrays, first use first
        self.ext_ids: dict[int, int] = {}  # id(array) -> index in ext


_graph = Graph()


# ------------------------------------------------------------------ recording
def record(spec, lowering, via_functional: bool, full: list):
    """Record one dispatched op; return what the op returns (tensors over pending values)."""
    with lock:
        if not config.defer_and_fuse:  # the mode changed while this thread waited for the lock
            return executor._execute_slow(spec, lowering, via_functional, full)
        sig = _fast_signature(spec.name, spec.kinds, full, _buffers, lowering.static_scalars)
        if sig is None:
            sig = executor.signature(spec, lowering, full)
        key, addresses, entries, scalars, device, generator = sig
        if valuecheck.any_lost:  # reading the result of an op that failed a value check raises
            valuecheck.raise_if_lost(entries)
        if lowering.rng:  # seed and offset are taken now: the same stream as Strict
            scalars.extend(executor._rng_scalars(generator, device))
        key = executor.state_key(key, lowering)
        prog = executor.programs.get(key)
        if prog is None:
            prog = executor._miss(key, spec, lowering, scalars, via_functional)
            if not prog.resize:
                _check(key, prog, scalars)
        else:
            _counts._cache_hits += 1  # the raw slot: the property adds the native fast path's count
        if prog.resize:
            return executor.resize_and_rerun(spec, lowering, via_functional, full, prog, generator, device)

        graph = _graph
        ext, ext_ids = graph.ext, graph.ext_ids
        refs = []
        for slot in prog.input_slots:
            value = entries[slot][0]
            if type(value) is Pending:
                refs.append(value.ref)
                continue
            if type(value) is Lost:
                raise RuntimeError(value.message)
            j = ext_ids.get(id(value))
            if j is None:
                j = ext_ids[id(value)] = len(ext)
                ext.append(value)
            refs.append(-1 - j)
        index = len(graph.nodes)
        base = index * _OUT
        n_fresh = _fresh_count(prog)
        slot_dtypes = prog.slot_dtypes
        for j, slot in enumerate(prog.updated_slots):
            _buffers[addresses[slot]] = (Pending(base + n_fresh + j), slot_dtypes[slot])
        refs = tuple(refs)
        graph.nodes.append(Node(prog, refs, scalars, device, _user_frame()))
        graph.descs += _desc(prog, refs)
        outs = _new_outputs(prog.layouts, [Pending(base + k) for k in range(n_fresh)], device, _buffers)
        _counts.ops_deferred += 1
        _counts.ops_recorded_python += 1
        if index == 0:
            storage.set_flush(flush)
        if index + 1 >= config.defer_max_ops:
            flush("size cap")
    return executor._returns(spec, prog, full, outs)


def _desc(prog, refs: tuple) -> bytes:
    """A node's bytes in the graph fingerprint: program id, number of inputs, their refs (native.cpp appends
    the same bytes when it records)."""
    return struct.pack(f"{len(refs) + 2}q", id(prog), len(refs), *refs)


_fresh_counts: dict = {}


def _fresh_count(prog) -> int:
    n = _fresh_counts.get(prog)
    if n is None:
        n = _fresh_counts[prog] = sum(1 for layout in prog.layouts if layout is not None)
    return n


def _check(key, prog, scalars) -> None:
    """Trace a new op program abstractly, so a lowering error surfaces at the recording line (as in Strict)."""
    slots = key[2 + prog.spec.n_args]
    shapes = [
        jax.ShapeDtypeStruct((slots[i][1] // prog.slot_dtypes[i].itemsize,), dtypes.to_jax(prog.slot_dtypes[i]))
        for i in prog.input_slots
    ]
    try:
        jax.eval_shape(prog.trace, shapes, list(scalars))
    except Exception as err:
        executor.programs.pop(key, None)
        replacement = cpu_errors.as_cpu_error(prog.spec, key, scalars, err)  # PyTorch's error, as in Strict
        if replacement is err:
            raise
        raise replacement from None


def _user_frame():
    """(code, line) of the innermost frame outside torch, torch_tpu and the standard library."""
    return recompiles.user_code(sys._getframe(2))


# ------------------------------------------------------------------ flushing
def pending() -> int:
    """How many ops are recorded and not yet run."""
    return len(_graph.nodes)


def forget() -> None:
    """Run what is recorded, then drop every plan and fused program with the op programs they name by id."""
    with lock:
        flush("clear cache")
        _plans.clear()
        _executables.clear()
        _offset_modes.clear()
        executor.programs.clear()


def flush(reason: str = "materialize") -> None:
    """Run everything recorded (all devices) and install the live results. A no-op when nothing is pending."""
    global _graph
    with lock:
        graph = _graph
        if not graph.nodes:
            return
        _graph = Graph()
        try:
            _run(graph, reason)
        finally:
            # Cleared only now: a thread that reads a value while this flush runs must wait
            # for it on the lock (through storage.materialize), not read a pending value.
            storage.set_flush(None)


def _run(graph, reason: str) -> None:
    """Run one taken graph and install its live values into the storages that hold them."""
    storage.drain()
    live: dict[int, list] = {}
    for address, (value, dtype) in _buffers.items():
        if type(value) is Pending:
            live.setdefault(value.ref, []).append((address, dtype))
    outputs = tuple(sorted(live))
    ext = graph.ext
    # Donate inputs nobody else holds: the list and getrefcount's argument are the only references.
    donate = tuple(j for j in range(len(ext)) if sys.getrefcount(ext[j]) <= 2)
    # They shape the plan.
    options = (config.defer_repeats, config.defer_min_period, config.defer_max_period, config.defer_loops)
    fingerprint = (bytes(graph.descs), outputs, donate, options)
    plan = _plans.get(fingerprint)
    if plan is None:
        _counts.fused_cache_misses += 1
        plan = _make_plan(graph, outputs, frozenset(donate))
        _plans[fingerprint] = plan
    else:
        _counts.fused_cache_hits += 1
    values: dict = {}
    try:
        plan.run(graph, values)
    except BaseException as err:
        _lose(live, values, graph, err)
        raise
    for ref, targets in live.items():
        array = values[ref]
        for address, dtype in targets:
            _buffers[address] = (array, dtype)
    _counts.flushes += 1
    metrics.flush_reasons[reason] += 1
    _counts.ops_executed += len(graph.nodes)


def _lose(live, values, graph, err) -> None:
    """After a failed flush: install what was computed, mark the rest lost (reading it raises)."""
    message = (f"this tensor's value was lost: the deferred graph computing it ({len(graph.nodes)} ops) failed "
               f"with {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    lost = Lost(message)
    for ref, targets in live.items():
        array = values.get(ref, lost)
        for address, dtype in targets:
            _buffers[address] = (array, dtype)


# Both bounded, and halved under memory-mapping pressure: a plan's segments hold their executables.
_plans: dict = cache_levels.ExecutableTable(limit=1024)  # graph fingerprint -> Plan
_executables: dict = cache_levels.ExecutableTable()  # segment fingerprint -> compiled fused program


class Segment:
    """One fused program of a plan: which values go in, which nodes run, which values come out."""

    __slots__ = ("device", "nodes", "sources", "donated", "kept", "outputs", "drop", "fingerprint", "steps",
                 "n_inputs", "local_outputs", "out_shapes", "reshaped", "offset_positions", "checked", "executable",
                 "last_scalars")

    def __init__(self):
        self.executable = None  # its fused program, once compiled or found (by fingerprint, no offsets)
        self.last_scalars = None  # (runtime scalars, their device arrays) of the last run

    def run(self, graph, values: dict) -> None:
        ext = graph.ext
        nodes = graph.nodes
        inputs = [ext[-1 - s] if s < 0 else values[s] for s in self.sources]
        donated = [inputs[i] for i in self.donated]
        kept = [inputs[i] for i in self.kept]
        del inputs
        raw = [value for i in self.nodes for value in nodes[i].scalars]
        key, offsets = self.fingerprint, None
        if self.offset_positions:
            offsets, raw = _split_offsets(self, raw)
            if offsets is not None:
                key = (key, offsets)
        # A repeated graph mostly repeats its scalars; each position's type is fixed by its program
        # (part of the plan's fingerprint), so equal values mean the same device arrays.
        scalars = _reused_scalars(self, raw)
        executable = self.executable if offsets is None else None
        if executable is None:
            executable = _executables.get(key)
            if offsets is None:
                self.executable = executable
        name = _trace.segment_name(nodes, self.nodes) if _trace.active else None
        if executable is None:
            with _trace.compiling(name, self.device) if name else contextlib.nullcontext():
                executable = self._compile(graph, donated, kept, scalars, key, offsets)
        try:
            if name:  # torch.profiler device rows (profiler.py)
                results = _trace.run_program(name, self.device, executable, donated, kept, scalars)
            else:
                results = executable(donated, kept, scalars)
        except jax.errors.JaxRuntimeError as err:
            wheres = [nodes[i].where for i in self.nodes]
            raise _runtime_error(err, f"a deferred graph of {len(self.nodes)} ops", wheres) from None
        if self.reshaped:
            results = list(results)
            flat = _flatten(self, [results[k] for k in self.reshaped])
            for k, array in zip(self.reshaped, flat):
                results[k] = array
        _counts.fused_executions += 1
        _counts.fused_outputs += len(self.outputs)
        _counts.fused_donations += len(self.donated)
        for ref, array in zip(self.outputs, results):
            values[ref] = array
        if self.checked:  # the error flags of value-checked ops come last (eager/valuecheck.py)
            self._launched_checks(nodes, values, results[-1])
        for ref in self.drop:
            values.pop(ref, None)

    def _launched_checks(self, nodes, values, flags) -> None:
        checked = []
        for s in self.checked:
            i = self.nodes[s]
            node = nodes[i]
            # Fresh results only: written tensors keep their values when the check fails (program.py).
            results = [values[i * _OUT + k] for k in range(_fresh_count(node.prog)) if i * _OUT + k in values]
            checked.append((node.prog.spec.name, node.where, results))
        valuecheck.launched_fused(flags, checked)

    def signature(self, nodes):
        """What determines the fused program, as plain data (a program key: no tracing in a later process).

        None when a step's program is not indexable (see program.indexable).
        """
        if not all(program_mod.indexable(nodes[i].prog) for i in self.nodes):
            return None
        steps = tuple((prog.key, refs, n_scalars) for prog, refs, n_scalars in self.steps)
        return ("fused", steps, self.n_inputs, self.donated, self.kept, self.local_outputs, self.out_shapes,
                self.checked)

    def _compile(self, graph, donated, kept, scalars, key, offsets):
        nodes = graph.nodes
        static = dict(zip(self.offset_positions, offsets)) if offsets is not None else {}
        fused = _fused_function(self.steps, self.n_inputs, self.donated, self.kept, self.local_outputs,
                                self.out_shapes, static)
        fused.wheres = [nodes[i].where for i in self.nodes]
        fused.names = [nodes[i].prog.spec.name for i in self.nodes]
        sharding = platform.get().shardings[self.device]
        out_tree = jax.tree_util.tree_structure([0] * (len(self.local_outputs) + bool(self.checked)))
        try:
            signature = self.signature(nodes)
            if signature is not None and offsets is not None:
                signature = (*signature, ("offsets", self.offset_positions, offsets))
            if any(nodes[i].prog.spec.name.startswith("_c10d_functional") for i in self.nodes):
                # spmd_safe collectives recorded here: one SPMD program over the group (distributed/compiled.py)
                from torch_tpu.distributed.compiled import SpmdExecutable, fused_group

                executable = SpmdExecutable(fused, fused_group(), (donated, kept, scalars), bool(self.donated))
            else:
                executable = program_mod.compile_indexed(fused, sharding, (donated, kept, scalars), signature,
                                                         out_tree, donate_argnums=(0,) if self.donated else ())
        except jax.errors.JaxRuntimeError as err:
            raise _runtime_error(err, f"compiling a deferred graph of {len(self.nodes)} ops",
                                 fused.wheres) from None
        _executables[key] = executable
        recompiles.segment_compiled(self, nodes, key)
        return executable


# Storage offsets of views read or written in a fused program (the q, k and v column blocks of
# an attention's projection) are runtime scalars in Strict mode: one program serves every
# offset. A fused segment takes them as constants instead, so XLA reads such a view in place
# (strided._static_blocks) rather than through a padded copy of its buffer: one copy of the
# projection less per attention block. A segment that runs with other offsets than those it
# was compiled for (a loop over x[i], cut into equal units) falls back to runtime offsets for
# good: one compile more at most, never one per offset.
_offset_modes: dict = {}  # segment fingerprint -> the offsets compiled as constants, or None: runtime


def _split_offsets(segment, raw: list):
    """(the segment's offsets if they are compiled as constants else None, the runtime scalars)."""
    positions = segment.offset_positions
    offsets = tuple(raw[i] for i in positions)
    mode = _offset_modes.setdefault(segment.fingerprint, offsets)
    if mode != offsets:
        if mode is not None:
            _offset_modes[segment.fingerprint] = None
        return None, raw
    taken = set(positions)
    return offsets, [value for i, value in enumerate(raw) if i not in taken]


def _flatten(segment, arrays: list) -> list:
    """The segment's N-d outputs as flat buffers, by a compiled reshape that donates them (a bitcast, no copy)."""
    key = ("flatten", segment.fingerprint)
    executable = _executables.get(key)
    if executable is None:
        sharding = platform.get().shardings[segment.device]
        signature = ("flatten", tuple((a.shape, str(a.dtype)) for a in arrays))
        out_tree = jax.tree_util.tree_structure([0] * len(arrays))
        executable = program_mod.compile_indexed(_flat_all, sharding, (arrays,), signature, out_tree,
                                                 donate_argnums=(0,))
        _executables[key] = executable
    return executable(arrays)


def _flat_all(arrays):
    return [a.reshape(-1) for a in arrays]


class Plan:
    __slots__ = ("segments",)

    def __init__(self, segments):
        self.segments = segments

    def run(self, graph, values: dict) -> None:
        for segment in self.segments:
            segment.run(graph, values)


def _fused_function(steps, n_inputs, donated_positions, kept_positions, outputs, shapes, static: dict):
    """The traced function of one segment: every step's OpProgram.trace, wired together.

    `static`: {position among the segment's scalars: value} of the storage offsets compiled as
    constants (see _split_offsets); the program takes the other scalars at run time.
    """

    def fused(donated, kept, scalars):
        if static:
            scalars = list(scalars)
            for position in sorted(static):
                scalars.insert(position, static[position])
        values = [None] * n_inputs
        for position, value in zip(donated_positions, donated):
            values[position] = value
        for position, value in zip(kept_positions, kept):
            values[position] = value
        offset = 0
        flags = []
        for s, (prog, refs, n_scalars) in enumerate(steps):
            try:
                fresh, updated = prog.trace([values[r] for r in refs], scalars[offset:offset + n_scalars])
            except Exception as err:
                _note(err, f"in the deferred op {fused.names[s]}, recorded at:\n  {recompiles.traceback_line(fused.wheres[s])}")
                raise
            if prog.checks:  # a value-checked op: its error flag follows its updated slots
                flags.append(updated[-1])
                updated = updated[:-1]
            offset += n_scalars
            values.extend(fresh)
            values.extend(updated)
        results = [values[i].reshape(shape) for i, shape in zip(outputs, shapes)]
        return [*results, jnp.stack(flags)] if flags else results

    fused.wheres = []
    fused.names = []
    return fused


def _note(err: BaseException, text: str) -> None:
    err.add_note(f"[torch_tpu DeferAndFuse] {text}")


def _sites(wheres, limit: int = 8) -> str:
    seen = []
    for where in wheres:
        if where not in seen:
            seen.append(where)
    lines = [f"  {recompiles.traceback_line(w)}" for w in seen[:limit]]
    if len(seen) > limit:
        lines.append(f"  ... and {len(seen) - limit} more sites")
    return "\n".join(lines)


# ------------------------------------------------------------------ planning
def _output_avals(prog) -> list:
    """(length, jax dtype) of each output of a node running `prog`: fresh buffers, then updated slots."""
    avals = [(m.nbytes // m.dtype.itemsize, np.dtype(dtypes.to_jax(m.dtype))) for m in prog.outputs if m is not None]
    slots = prog.key[2 + prog.spec.n_args]
    for slot in prog.updated_slots:
        dtype = prog.slot_dtypes[slot]
        avals.append((slots[slot][1] // dtype.itemsize, np.dtype(dtypes.to_jax(dtype))))
    return avals


def _output_shapes(prog) -> list:
    """The physical (memory-order) shape of each output of `prog`: fresh buffers, then updated slots.

    NOTE(xla-cpu): a fused program returns its outputs in these shapes and they
    are flattened afterwards (a donated reshape: no copy). XLA:CPU emits a fusion
    whose root is a flattening bitcast and that reads a broadcast operand (a bias,
    a row statistic) with scalar code: an erf-GELU on a biased matmul output runs
    ~8x slower than with an N-d root. Strict mode never hits it (its op boundaries
    split such fusions).
    """
    shapes = _shapes.get(prog)
    if shapes is not None:
        return shapes
    shapes = []
    for m in prog.outputs:
        if m is None:
            continue
        if len(m.sizes) < 2:
            shapes.append((math.prod(m.sizes),))
        elif strided.is_contiguous(m.sizes, m.strides):
            shapes.append(tuple(m.sizes))
        else:
            order = strided.dense_permutation(m.sizes, m.strides)
            # Not dense in any order (empty, or with gaps): the flat buffer as the program made it.
            shapes.append((m.nbytes // m.dtype.itemsize,) if order is None else tuple(m.sizes[d] for d in order))
    spec = prog.spec
    key_args = prog.key[2:2 + spec.n_args]
    slots = prog.key[2 + spec.n_args]
    for slot in prog.updated_slots:
        dtype = prog.slot_dtypes[slot]
        length = slots[slot][1] // dtype.itemsize
        targets = [e for i in spec.writes for e in program_mod.tensor_entries(spec.kinds[i], key_args[i]) if e[5] == slot]
        shape = (length,)
        if len(targets) == 1:
            _, entry_dtype, sizes, strides, offset, _ = targets[0]
            if (len(sizes) >= 2 and entry_dtype == dtype and offset == 0 and math.prod(sizes) == length
                    and strided.is_contiguous(sizes, strides)):
                shape = tuple(sizes)
        shapes.append(shape)
    _shapes[prog] = shapes
    return shapes


_shapes: dict = {}


def _cheap(prog) -> bool:
    """A pointwise op with one fresh result and no side effects: cheaper to recompute than to keep."""
    op = prog.spec.op
    tags = op.tags
    return (torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags
            and not prog.updated_slots and _fresh_count(prog) == 1 and len(prog.outputs) == 1)


def _recompute_cheap(nodes, pieces: list, final: set) -> list:
    """Pieces (device, nodes, recomputed nodes) with cheap values recomputed where they are read.

    A value that only crosses a cut (it is dead at the materialization point,
    e.g. an activation saved for backward) would be a program output, a device
    buffer kept from its producer to its last reader. If a pointwise op made
    it from values the reading piece receives anyway, the reader recomputes it:
    one buffer less to keep, at the price of one pointwise pass.
    """
    made_in = {}
    for p, (_, indices) in enumerate(pieces):
        for i in indices:
            made_in[i] = p
    reads = []  # per piece: refs read from outside it
    for p, (_, indices) in enumerate(pieces):
        outside = set()
        for i in indices:
            outside.update(r for r in nodes[i].refs if r < 0 or made_in[r // _OUT] != p)
        reads.append(outside)
    extra: dict[int, list[int]] = {}
    for p, outside in enumerate(reads):
        for r in sorted(outside):
            if r < 0 or r in final:
                continue
            node = nodes[r // _OUT]
            if _cheap(node.prog) and all(x < 0 or x in outside for x in node.refs):
                extra.setdefault(p, []).append(r // _OUT)
    return [(device, extra.get(p, []) + list(indices), frozenset(extra.get(p, ())))
            for p, (device, indices) in enumerate(pieces)]


def _replaced_input(nodes, ref: int, position: dict, local: dict):
    """The position among a piece's inputs of the value `ref` replaces (through in-place updates made
    in the piece), or None: `ref` is not an updated buffer, or what it replaces is made in the piece."""
    while True:
        node = nodes[ref // _OUT]
        prog = node.prog
        j = ref % _OUT - _fresh_count(prog)
        if j < 0:
            return None
        slot = prog.updated_slots[j]
        if slot not in prog.input_slots:
            return None
        previous = node.refs[prog.input_slots.index(slot)]
        if previous in position:
            return position[previous]
        if previous < 0 or previous not in local:
            return None
        ref = previous


def _make_plan(graph, outputs: tuple, donate: frozenset) -> Plan:
    """Cut the graph into segments and wire them: which values cross, which are donated."""
    nodes = graph.nodes
    by_device: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        by_device.setdefault(node.device, []).append(i)
    pieces = []
    for device, indices in by_device.items():
        if config.defer_repeats and len(indices) >= 2 * config.defer_min_period:
            tokens = [id(nodes[i].prog) for i in indices]
            cuts = repeats.segments(tokens, config.defer_min_period, config.defer_max_period)
            pieces.extend((device, indices[a:b]) for a, b in cuts)
        else:
            pieces.append((device, indices))

    final = set(outputs)
    pieces = _recompute_cheap(nodes, pieces, final)
    # Last piece reading each ext input and each crossing value; values read by later pieces.
    last_reader: dict[int, int] = {}
    crossing: set[int] = set()
    for p, (_, indices, _) in enumerate(pieces):
        made: set[int] = set()
        for i in indices:
            for r in nodes[i].refs:
                last_reader[r] = p
                if r >= 0 and r // _OUT not in made:
                    crossing.add(r)
            made.add(i)
    avals = {}
    segments = []
    for p, (device, indices, recomputed) in enumerate(pieces):
        sources: list[int] = []  # ext (< 0) or pending refs produced by earlier pieces
        position: dict[int, int] = {}
        local: dict[int, int] = {}  # pending ref -> local value index (computed later)
        steps = []
        produced = []
        for i in indices:
            node = nodes[i]
            local_refs = []
            for r in node.refs:
                if r >= 0 and r in local:
                    local_refs.append(("v", local[r]))
                    continue
                k = position.get(r)
                if k is None:
                    k = position[r] = len(sources)
                    sources.append(r)
                local_refs.append(("i", k))
            out_avals = _output_avals(node.prog)
            for k, aval in enumerate(out_avals):
                ref = i * _OUT + k
                local[ref] = len(produced)
                produced.append(ref)
                avals[ref] = aval
            steps.append((node.prog, local_refs, len(node.scalars)))
        n_inputs = len(sources)
        steps = tuple(
            (prog, tuple(k if kind == "i" else n_inputs + k for kind, k in refs), n_scalars)
            for prog, refs, n_scalars in steps
        )
        out_refs = [r for r in produced if (r in final or r in crossing) and r // _OUT not in recomputed]

        # Donation: inputs nobody needs after this piece, matched to an output of the same shape.
        # JAX pairs each output, in order, with the first unused donated input of its shape and
        # dtype. An output that is the new value of an input (a parameter or optimizer state updated
        # in place) is paired with that input: such outputs go first, their inputs first in the
        # same order, so XLA updates each buffer where it lies. Paired by order of appearance, an
        # optimizer step's outputs took other inputs' buffers (a gradient's, another parameter's)
        # and XLA copied most of its inputs first (233 copies in the demo GPT's AdamW program).
        def source_aval(k):
            s = sources[k]
            return (graph.ext[-1 - s].shape[0], np.dtype(graph.ext[-1 - s].dtype)) if s < 0 else avals[s]

        donatable = [k for k, s in enumerate(sources)
                     if ((s < 0 and (-1 - s) in donate) or (s >= 0 and s not in final)) and last_reader.get(s) == p]
        donatable_set = set(donatable)
        paired: dict[int, int] = {}  # output ref -> position of the input it replaces
        for r in out_refs:
            k = _replaced_input(nodes, r, position, local)
            if k in donatable_set and source_aval(k) == avals[r]:
                donatable_set.discard(k)
                paired[r] = k
        out_refs = tuple([r for r in out_refs if r in paired] + [r for r in out_refs if r not in paired])
        # A paired output is returned flat, like the input whose buffer it takes (JAX pairs equal
        # shapes only); the others in their N-d shape (see _output_shapes).
        out_shapes = tuple((avals[r][0],) if r in paired else _output_shapes(nodes[r // _OUT].prog)[r % _OUT]
                           for r in out_refs)
        free = {}
        for r, shape in zip(out_refs, out_shapes):
            if r not in paired and len(shape) == 1:
                free[avals[r]] = free.get(avals[r], 0) + 1
        donated = [paired[r] for r in out_refs if r in paired]
        for k in donatable:
            aval = source_aval(k)
            if k in donatable_set and free.get(aval, 0) > 0:
                free[aval] -= 1
                donated.append(k)
        kept = [k for k in range(n_inputs) if k not in set(donated)]
        local_outputs = tuple(n_inputs + local[r] for r in out_refs)

        segment = Segment()
        segment.device = device
        segment.nodes = tuple(indices)
        segment.sources = tuple(sources)
        segment.donated = tuple(donated)
        segment.kept = tuple(kept)
        segment.outputs = out_refs
        segment.local_outputs = local_outputs
        segment.out_shapes = out_shapes
        segment.reshaped = tuple(k for k, shape in enumerate(out_shapes) if len(shape) != 1)
        segment.n_inputs = n_inputs
        segment.steps = steps
        # Crossing values no later piece reads (and not live): drop them now.
        segment.drop = tuple(r for r in set(sources) if r >= 0 and last_reader.get(r) == p and r not in final)
        segment.fingerprint = (device, tuple((id(prog), refs) for prog, refs, _ in steps), n_inputs, local_outputs,
                               segment.donated, out_shapes)
        positions, start = [], 0
        for prog, _, n_scalars in steps:
            positions.extend(start + p for p in program_mod.offset_positions(prog))
            start += n_scalars
        segment.offset_positions = tuple(positions)
        segment.checked = tuple(s for s, (prog, _, _) in enumerate(steps) if prog.checks)
        segments.append(segment)
    if config.defer_loops:
        segments = _form_loops(segments, final, last_reader)
    return Plan(segments)


def _loop_key(segment):
    """What a loop's units must share: the fingerprint without donation and output shapes (a loop donates
    nothing, and reshapes its outputs as its last unit's), or None: the unit cannot run in a loop."""
    if segment.offset_positions or segment.checked:
        return None
    if any(prog.spec.name.startswith("_c10d_functional") for prog, _, _ in segment.steps):
        return None
    return segment.fingerprint[:4]


def _carried(prev, unit, p: int, final: set, last_reader: dict):
    """How `unit` (piece p) reads the outputs of `prev`, the unit before it, as a loop body's carry:
    ((input position, output index), ...) when every input of `unit` is an output of `prev` or the value
    `prev` read at the same position, and nothing but `unit` reads `prev`'s outputs; else None."""
    key = _loop_key(unit)
    if key is None or key != _loop_key(prev):
        return None
    index = {r: m for m, r in enumerate(prev.outputs)}
    carry = []
    for k, s in enumerate(unit.sources):
        m = index.get(s)
        if m is not None:
            carry.append((k, m))
        elif s != prev.sources[k]:
            return None
    if len(carry) != len(prev.outputs) or any(r in final or last_reader.get(r) != p for r in prev.outputs):
        return None
    return tuple(carry)


def _form_loops(segments: list, final: set, last_reader: dict) -> list:
    """Consecutive segments that are one loop body run again and again become one LoopSegment."""
    out, i = [], 0
    while i < len(segments):
        j, carry = i + 1, None
        while j < len(segments):
            found = _carried(segments[j - 1], segments[j], j, final, last_reader)
            if found is None or (carry is not None and found != carry):
                break
            carry, j = found, j + 1
        if j - i >= 2:
            out.append(LoopSegment(segments[i:j], carry))
        else:
            out.append(segments[i])
        i = j
    return out


def _reused_scalars(segment, raw: list) -> list:
    """Device arrays of a segment's runtime scalars `raw`: the previous run's when they are the same values."""
    cached = segment.last_scalars
    if cached is not None and executor.same_scalars(cached[0], raw):
        return cached[1]
    scalars = executor._device_scalars(raw, segment.device) if raw else []
    segment.last_scalars = (raw, scalars)
    return scalars


def _runtime_error(err, what: str, wheres) -> Exception:
    """XLA's runtime error `err` of a deferred program, in PyTorch's words, naming the recorded ops' lines."""
    error = translate_runtime_error(err, what)
    _note(error, "the graph's ops were recorded at:\n" + _sites(wheres))
    return error


class LoopSegment:
    """Consecutive equal units of a plan run by one program: an XLA while loop over the unit, its iteration
    count a runtime input, so any number of repetitions costs one launch and one compile.

    The units' values flow from each to the next (`carry`: input position <- output index of the unit
    before) and their other inputs are the same values. A graph whose units read different scalars (or
    when the profiler is on) runs them one by one instead.
    """

    __slots__ = ("members", "carry", "device", "drop", "executable", "last_scalars")

    def __init__(self, members, carry):
        self.members = tuple(members)
        self.carry = carry
        self.device = members[0].device
        self.drop = tuple(sorted({r for m in members for r in m.drop}))
        self.executable = None
        self.last_scalars = None

    def run(self, graph, values: dict) -> None:
        nodes = graph.nodes
        members = self.members
        raw = [value for i in members[0].nodes for value in nodes[i].scalars]
        if _trace.active or not _same_scalars_in_all(raw, members, nodes):
            for member in members:
                member.run(graph, values)
            return
        first, last = members[0], members[-1]
        ext = graph.ext
        inputs = [ext[-1 - s] if s < 0 else values[s] for s in first.sources]
        scalars = _reused_scalars(self, raw)
        (count,) = executor._device_scalars([len(members)], self.device)
        executable = self.executable
        if executable is None:
            key = ("loop", last.fingerprint, self.carry)
            executable = _executables.get(key)
            if executable is None:
                executable = self._compile(graph, inputs, scalars, count, key)
            self.executable = executable
        try:
            results = executable(inputs, scalars, count)
        except jax.errors.JaxRuntimeError as err:
            raise _runtime_error(err, f"a deferred loop of {len(members)} x {len(last.nodes)} ops",
                                 [nodes[i].where for i in last.nodes]) from None
        del inputs
        if last.reshaped:
            results = list(results)
            for k, array in zip(last.reshaped, _flatten(last, [results[k] for k in last.reshaped])):
                results[k] = array
        _counts.fused_executions += 1
        _counts.fused_loop_units += len(members)
        _counts.fused_outputs += len(last.outputs)
        for ref, array in zip(last.outputs, results):
            values[ref] = array
        for ref in self.drop:
            values.pop(ref, None)

    def _compile(self, graph, inputs, scalars, count, key):
        nodes = graph.nodes
        last = self.members[-1]
        unit = _fused_function(last.steps, last.n_inputs, (), tuple(range(last.n_inputs)), last.local_outputs,
                               last.out_shapes, {})
        unit.wheres = [nodes[i].where for i in last.nodes]
        unit.names = [nodes[i].prog.spec.name for i in last.nodes]
        looped = _loop_function(unit, self.carry, last.out_shapes)
        signature = last.signature(nodes)
        if signature is not None:
            signature = ("fused loop", signature, self.carry)
        sharding = platform.get().shardings[self.device]
        out_tree = jax.tree_util.tree_structure([0] * len(last.local_outputs))
        try:
            executable = program_mod.compile_indexed(looped, sharding, (inputs, scalars, count), signature, out_tree)
        except jax.errors.JaxRuntimeError as err:
            raise _runtime_error(err, f"compiling a deferred loop of {len(last.nodes)} ops", unit.wheres) from None
        _executables[key] = executable
        recompiles.segment_compiled(last, nodes, key)
        return executable


def _same_scalars_in_all(raw: list, members, nodes) -> bool:
    """Whether every unit runs with the runtime scalars `raw` of the first (-0.0 told from 0.0)."""
    zeros = [k for k, value in enumerate(raw) if type(value) is float and value == 0.0]
    for member in members[1:]:
        other = [value for i in member.nodes for value in nodes[i].scalars]
        if other != raw or any(math.copysign(1.0, other[k]) != math.copysign(1.0, raw[k]) for k in zeros):
            return False
    return True


def _loop_function(unit, carry: tuple, shapes: tuple):
    """`count` runs of the fused `unit`, each reading the previous run's outputs at the carried positions."""

    def looped(inputs, scalars, count):
        def body(_, state):
            arguments = list(inputs)
            for (k, _), value in zip(carry, state):
                arguments[k] = value
            # Nothing is hoisted out of the loop: each run computes exactly what the unit's own program does.
            arguments, unit_scalars = jax.lax.optimization_barrier((arguments, list(scalars)))
            results = unit([], arguments, unit_scalars)
            return tuple(results[m].reshape(-1) for _, m in carry)

        state = jax.lax.fori_loop(0, count, body, tuple(inputs[k] for k, _ in carry))
        by_output = {m: value for (_, m), value in zip(carry, state)}
        return [by_output[m].reshape(shape) for m, shape in enumerate(shapes)]

    return looped


def _first_node() -> None:
    storage.set_flush(flush)


executor._record = record  # in this mode `executor.execute` hands every call here

# The native recorder (csrc/native.cpp) appends seen signatures to `_graph` exactly as `record` does.
_native.set_defer_hooks(sys.modules[__name__], lock, config, valuecheck, recompiles._is_library, recompiles.user_code,
                        _first_node, Node, Pending, Lost)
