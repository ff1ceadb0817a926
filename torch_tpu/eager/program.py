"""One cached program per op signature: view reads + lowering + write-backs.

A signature (the cache key) is a cheap tuple: the op, the device, one entry
per argument, and one entry per storage slot. Argument entries:

    ("T", dtype, sizes, strides, offset, slot)           a tpu tensor; offset is 0, or DYNAMIC when its
                                                          storage offset is nonzero (then a runtime scalar,
                                                          so x[i] for every i shares one program)
    ("C", dtype)                                          a 0-dim CPU tensor (runtime scalar)
    ("S", type)                                           a runtime Python scalar
    ("L", (type, ...))                                    a runtime scalar list
    tuple of "T" entries / None                           a tensor list
    any hashable value                                    a static argument
Slot entries are (buffer dtype or None if never written, storage nbytes).
Under a default dtype other than float32 the key carries it (`default_dtype_entry`);
lowerings flagged `precision` end the key with the float32 matmul precision.
(The entry tags and reading entries back into arguments: keys.py.)

Everything an `OpProgram` needs derives from the key, so equal keys give equal
programs. Its traced function maps (slot buffers, runtime scalars) to (fresh
output buffers, updated slot buffers): the strict executor jits it alone; the
defer-and-fuse executor traces many of them into one program.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import jax
import jax.numpy as jnp
import torch
from torch._prims_common import elementwise_dtypes

from torch_tpu import _native, cache, compile_notice, precision
from torch_tpu.cache import executable as cache_executable
from torch_tpu.config import config
from torch_tpu.eager import cpu_errors
from torch_tpu.eager.keys import (  # the tags also as program_mod.* (executor.py, defer.py, compile/plan.py)
    CPU_SCALAR, DYNAMIC, SCALAR, SCALAR_LIST, TENSOR, tensor_entries,
)
from torch_tpu.eager.keys import TENSOR_KINDS as _TENSOR_KINDS, rebuild as _rebuild
from torch_tpu.eager.opspec import RESIZED_ONLY_TO_ANOTHER_NUMEL, Arg, OpSpec, computes_in_out_dtype, functional_counterpart
from torch_tpu.ops import checks
from torch_tpu.ops.registry import Lowering
from torch_tpu.runtime import dtypes, strided

RNG_SCALARS = 4  # seed lo/hi, offset lo/hi appended to the runtime scalars

_PROMOTABLE = (Arg.TENSOR, Arg.OPT_TENSOR, Arg.SCALAR, Arg.OPT_SCALAR)


class OutputMeta:
    """Sizes, strides and dtype of one fresh result (dense strides only)."""

    __slots__ = ("sizes", "strides", "dtype", "nbytes")

    def __init__(self, sizes, strides, dtype):
        self.sizes = tuple(sizes)
        strides = tuple(strides)
        if strides != strided.contiguous_strides(self.sizes) and strided.dense_permutation(self.sizes, strides) is None:
            strides = strided.contiguous_strides(self.sizes)
        self.strides = strides
        self.dtype = dtype
        self.nbytes = math.prod(self.sizes) * dtype.itemsize


class OpProgram:
    """Everything derived from one signature; `executable` is jitted on first strict use."""

    __slots__ = ("key", "spec", "outputs", "layouts", "return_counts", "input_slots", "updated_slots", "slot_dtypes",
                 "resize", "trace", "executable", "device", "fast", "lowering", "values", "checks")

    def __init__(self, key, spec, outputs, return_counts, input_slots, updated_slots, slot_dtypes, resize, trace,
                 device, values=()):
        self.key = key
        self.spec = spec
        self.outputs = outputs  # OutputMeta per fresh output (list returns flattened)
        self.layouts = tuple(None if m is None else (m.sizes, m.strides, m.dtype) for m in outputs)
        self.return_counts = return_counts  # number of tensors per fresh list return
        self.input_slots = input_slots  # slots passed in (never-written slots read as zeros)
        self.updated_slots = updated_slots  # slots whose buffers the program rewrites
        self.slot_dtypes = slot_dtypes  # torch dtype of each slot's buffer elements
        self.resize = resize  # {arg index: (sizes, strides or None)}: out= arguments to resize before running
        self.trace = trace
        self.executable = None
        self.device = device
        self.values = values  # the meta run's non-tensor returns (SymInts), in order
        self.fast = None  # what the native cache-hit path needs, once the executable exists
        self.lowering = None  # the Lowering it was built from
        # Value checks (ops/checks.py): the trace returns the op's error flag after the updated slots.
        self.checks = False

    def enable_fast_path(self) -> None:
        """Hand the native cache-hit path everything it needs (not for out= resizes or non-tensor returns).

        The last item names a value-checked op (None for others): the native path hands its flag to
        eager/valuecheck.py, as the Python path does."""
        if self.resize or self.executable is None or self.values:
            return
        self.fast = (self.input_slots, self.updated_slots, self.slot_dtypes, self.layouts, self._return_plan(),
                     self.executable, self.spec.name if self.checks else None)

    def record_plan(self):
        """What the native DeferAndFuse recorder needs (csrc/native.cpp), or None: Python records this program."""
        if self.resize or self.values:
            return None
        return self.input_slots, self.updated_slots, self.slot_dtypes, self.layouts, self._return_plan()

    def _return_plan(self) -> tuple:
        """Per return: (0, argument index, 0), (1, output index, 0) or (2, first output, count) for a list."""
        plan, position, counts = [], 0, iter(self.return_counts or ())
        for kind, info in self.spec.returns:
            if kind == "arg":
                plan.append((0, info, 0))
            elif info:  # a list of fresh outputs
                n = next(counts)
                plan.append((2, position, n))
                position += n
            else:
                plan.append((1, position, 0))
                position += 1
        return tuple(plan)


    def adopt_direct_call(self, n_arguments: int, fresh: list, updated: list) -> None:
        """After the first launch: hand the native path a `_native.DirectLaunch` of the executable
        (cache/executable.py, `direct_launch`), built from that launch's results; executables it
        cannot launch directly are kept as they are."""
        if self.fast is None or self.fast[5] is not self.executable:
            return
        direct = cache_executable.direct_launch(self.executable, n_arguments, fresh, updated)
        if direct is not None:
            self.fast = (*self.fast[:5], direct, self.fast[6])


def default_dtype_entry() -> tuple:
    """The key entries for `torch.get_default_dtype()`: none for float32, PyTorch's default.

    A program's result dtypes can depend on it (float results of integer tensors or Python numbers,
    `scalar_tensor`, factories without a dtype), and a program is built under the default of its
    first call.
    """
    default = torch.get_default_dtype()
    return () if default is torch.float32 else (("default dtype", default),)


def build(key, spec: OpSpec, lowering: Lowering, scalars: list, via_functional: bool) -> OpProgram:
    """Compile-time work for a new signature: meta run, promotion, trace."""
    try:
        return _build(key, spec, lowering, scalars, via_functional)
    except cpu_errors.FOREIGN as err:  # PyTorch's CPU error for the same arguments, if it has one
        replacement = cpu_errors.as_cpu_error(spec, key, scalars, err)
        if replacement is err:
            raise
        raise replacement from None


def _build(key, spec: OpSpec, lowering: Lowering, scalars: list, via_functional: bool) -> OpProgram:
    device = key[1]
    given = key[2:2 + spec.n_args]
    key_args = _out_dtype_as_dtype(spec, given)
    slots = key[2 + spec.n_args]

    # PyTorch's own output metadata and error messages: run the op on meta tensors.
    meta_args, _ = _rebuild(spec, key_args, scalars, _meta_tensor, lambda v, t: v,
                            lambda v, dtype: torch.empty((), dtype=dtype, device="meta"), lambda vs, ts: list(vs))
    if "device" in spec.index:  # factories: build on meta, not on tpu
        meta_args[spec.index["device"]] = torch.device("meta")
    # A lowering's meta override is called like its own op: a derived variant runs its own meta kernel.
    meta_override = None if via_functional else lowering.meta
    outputs, return_counts, resize, values = _meta_outputs(spec, meta_args, key_args, meta_override)
    cpu_errors.check_arguments(spec, meta_args)
    cpu_errors.check_complex(spec, given, scalars)
    cpu_errors.check_memory_overlap(spec, given, scalars, slots)

    # The arguments the lowering sees: out= arguments are not the functional op's, and a variant may
    # order its arguments differently from its functional op (polygamma_(self, n) vs polygamma(n, self)).
    passed = tuple(i for i in range(spec.n_args) if not (via_functional and spec.is_out and i in spec.writes))
    if via_functional:
        functional_names = [a.name for a in lowering.op._schema.arguments]
        if sorted(functional_names) == sorted(spec.names[i] for i in passed):
            passed = tuple(spec.index[name] for name in functional_names)
    compute_dtype = rounded = None
    if lowering.promote is not None:
        participants = [
            meta_args[i] for i in passed
            if meta_args[i] is not None and spec.kinds[i] in _PROMOTABLE
            and (lowering.promote_args is None or spec.names[i] in lowering.promote_args)
        ]
        compute_dtype, result_dtype = elementwise_dtypes(*participants, type_promotion_kind=lowering.promote.value)
        if via_functional and spec.is_out:  # TensorIterator's rule: the result in its own dtype, then cast to out's
            rounded = result_dtype
        elif via_functional and 0 in spec.writes and key_args[0] is not None and key_args[0][0] == TENSOR:
            cpu_errors.check_cast(result_dtype, key_args[0][1])  # in place: int.mul_(1.5) raises
    if spec.is_out:
        cpu_errors.check_out_dtypes(spec, given, scalars, rounded)

    input_slots = tuple(i for i, (buffer_dtype, _) in enumerate(slots) if buffer_dtype is not None)
    updated_slots = tuple(sorted({e[5] for i in spec.writes for e in tensor_entries(spec.kinds[i], key_args[i])}))
    # A never-written slot's buffer takes the dtype of the first tensor viewing it.
    slot_dtypes = tuple(
        buffer_dtype if buffer_dtype is not None else next(
            e[1] for kind, a in zip(spec.kinds, key_args) for e in tensor_entries(kind, a) if e[5] == index
        )
        for index, (buffer_dtype, _) in enumerate(slots)
    )
    if outputs is None:  # no meta kernel: let JAX tell the shapes (contiguous outputs)
        if any(kind == "value" for kind, _ in spec.returns):
            raise NotImplementedError(f"{spec.name} returns non-tensors and has no meta kernel")
        outputs, return_counts, written = _probe_outputs(spec, lowering, key_args, slots, slot_dtypes, passed,
                                                         input_slots, updated_slots, compute_dtype, scalars)
        if spec.is_out:  # out= arguments take the probed shapes (resized like PyTorch's out= ops)
            resize = {i: (shape, None) for i, shape in zip(spec.writes, written)
                      if spec.kinds[i] in _TENSOR_KINDS and key_args[i] is not None and key_args[i][2] != shape}
            if resize:
                return OpProgram(key, spec, outputs, return_counts, input_slots, updated_slots, slot_dtypes, resize,
                                 None, device)
    checked = config.value_checks and checks.declares(lowering.fn)
    trace = _make_trace(spec, lowering, key_args, slots, slot_dtypes, passed, input_slots, updated_slots, outputs,
                        compute_dtype, checked=checked, rounded=rounded)
    if lowering.precision:  # products run at the level in the key, wherever and whenever the trace runs
        trace = precision.bind(trace, key[-1])
    trace.op_name = str(spec.op)  # what a long-compile notice names (compile_notice.py)
    program = OpProgram(key, spec, outputs, return_counts, input_slots, updated_slots, slot_dtypes, resize, trace,
                        device, tuple(values))
    program.lowering = lowering
    program.checks = checked
    return program


def returns(spec: OpSpec, prog: OpProgram, full: list, outs: list):
    """What the op returns: `full` are its arguments, `outs` its fresh outputs (one per layout).

    Shared by every consumer of programs (executors, the torch.compile backend), whatever
    objects stand for tensors in `full` and `outs`.
    """
    rets = spec.returns
    if len(rets) == 1:
        kind, info = rets[0]
        if kind == "arg":
            return full[info]
        if kind == "value":
            return prog.values[0]
        return outs if info else outs[0]
    results = []
    position = 0
    counts = iter(prog.return_counts or ())
    values = iter(prog.values)
    for kind, info in rets:
        if kind == "arg":
            results.append(full[info])
        elif kind == "value":
            results.append(next(values))
        elif info:
            n = next(counts)
            results.append(outs[position:position + n])
            position += n
        else:
            results.append(outs[position])
            position += 1
    return tuple(results) if results else None


def _out_dtype_as_dtype(spec: OpSpec, key_args: tuple) -> tuple:
    """`key_args` with out's dtype as the dtype of an op that computes in it (opspec.computes_in_out_dtype)."""
    if not computes_in_out_dtype(spec):
        return key_args
    i = spec.index["dtype"]
    out = key_args[spec.writes[0]]
    if key_args[i] is not None or out is None:
        return key_args
    return (*key_args[:i], out[1], *key_args[i + 1:])


def _meta_tensor(entry, offset):
    return torch.empty_strided(entry[2], entry[3], dtype=entry[1], device="meta")


def offset_positions(prog: OpProgram) -> tuple[int, ...]:
    """Where, among a call's runtime scalars, the program takes its tensors' storage offsets."""
    positions = _offset_positions.get(prog)
    if positions is None:
        spec, found = prog.spec, []
        # With scalars = their own indices, a tensor's dynamic offset is its position.
        _rebuild(spec, prog.key[2:2 + spec.n_args], range(1 << 30),
                 lambda entry, offset: found.append(offset) if entry[4] == DYNAMIC else None,
                 lambda v, t: v, lambda v, dtype: v, lambda vs, ts: vs)
        positions = _offset_positions[prog] = tuple(found)
    return positions


_offset_positions: dict = {}


def _is_meta_gap(err: Exception) -> bool:
    text = str(err).lower()
    # An AttributeError is a broken meta kernel, not a user error (e.g. _thnn_fused_lstm_cell's
    # meta reads .device of its optional biases): probe the shapes with JAX instead.
    return isinstance(err, (NotImplementedError, AttributeError)) or (
        "meta" in text and ("not implemented" in text or "fake impl" in text))


def _number_as_tensor(value, tensor):
    """A Python number as a 0-dim meta tensor of the dtype it promotes `tensor` to (a wrapped number's)."""
    if type(value) not in (bool, int, float, complex):
        return value
    return torch.empty((), dtype=torch.result_type(tensor, value), device="meta")


# Meta kernels whose deterministic-mode alert is CUDA's: PyTorch takes a meta tensor for a CUDA one
# (torch/_meta_registrations.py device_hint), so under torch.use_deterministic_algorithms(True) they
# raised "median CUDA with indices output does not have a deterministic implementation" for tpu.
_CUDA_ALERTS = frozenset(("median", "nanmedian", "mode", "histc"))


@contextlib.contextmanager
def _no_cuda_alerts(spec: OpSpec):
    if spec.name.split(".")[1] not in _CUDA_ALERTS or not torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


def _meta_outputs(spec: OpSpec, meta_args, key_args, meta=None):
    """(OutputMeta per fresh result or None if meta is unsupported, list-return counts, out= resizes, non-tensor returns)."""
    try:
        try:
            with warnings.catch_warnings(), _no_cuda_alerts(spec):
                # an out= resize warns once, from the launch (executor._resize_out)
                warnings.filterwarnings("ignore", message=cpu_errors.OUT_RESIZED_WARNING)
                # (a C++ meta kernel's TORCH_WARNs become Python warnings here, under this filter)
                result = _native.capture_cpp_warnings(
                    lambda: spec.call(meta_args) if meta is None else meta(*meta_args))
        except RuntimeError as err:
            # A Scalar overload PyTorch runs as the Tensor one with a wrapped number (special_xlog1py(t, 5),
            # bitwise_and(7, t)): the schema refuses the Python number our key holds for it.
            if meta is not None or "Expected a value of type 'Tensor'" not in str(err):
                raise
            tensor = next(a for a in meta_args if isinstance(a, torch.Tensor))
            result = spec.call([_number_as_tensor(a, tensor) if kind in _TENSOR_KINDS else a
                                for kind, a in zip(spec.kinds, meta_args)])
    except Exception as err:
        if _is_meta_gap(err):
            return None, None, {}, ()
        raise
    results = (result,) if len(spec.returns) == 1 else tuple(result or ())
    outputs, counts, values = [], [], []
    for (kind, is_list), r in zip(spec.returns, results):
        if kind == "value":
            values.append(r)
        if kind != "fresh":
            continue
        if is_list:
            outputs.extend(OutputMeta(t.shape, t.stride(), t.dtype) for t in r)
            counts.append(len(r))
        else:  # None: an undefined result (e.g. a grad the output_mask did not ask for)
            outputs.append(None if r is None else OutputMeta(r.shape, r.stride(), r.dtype))
    resize = {}
    for i in spec.writes:
        entry = key_args[i]
        if spec.kinds[i] in _TENSOR_KINDS and entry is not None and tuple(meta_args[i].shape) != entry[2]:
            if (spec.name in RESIZED_ONLY_TO_ANOTHER_NUMEL
                    and math.prod(meta_args[i].shape) == math.prod(entry[2])):
                continue
            if not spec.is_out:  # in place: the Python-reference meta kernels (eq_, fmod_, pow_...) resize self
                raise RuntimeError(f"output with shape {list(entry[2])} doesn't match the broadcast shape "
                                   f"{list(meta_args[i].shape)}")
            resize[i] = tuple(meta_args[i].shape)
    if resize:
        resize = _with_result_strides(spec, meta_args, resize)
    return outputs, counts, resize, values


def _with_result_strides(spec: OpSpec, meta_args, resize: dict) -> dict:
    """{out= index: (sizes, strides)}: a resized out= takes the strides of the op's result, as ATen's
    structured kernels restride it (an elementwise op of permuted inputs gives a permuted out); the
    reference meta kernels resize it contiguous. The strides come from the functional op's meta run
    (None: contiguous)."""
    functional = functional_counterpart(spec.op)
    strides = {}
    if functional is not None:
        names = [a.name for a in functional._schema.arguments]
        kwargs = {name: meta_args[spec.index[name]] for name in names if name in spec.index}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = functional(**kwargs)
            results = result if isinstance(result, (tuple, list)) else (result,)
            written = [i for i in spec.writes if spec.kinds[i] in _TENSOR_KINDS]
            for i, r in zip(written, results):
                if isinstance(r, torch.Tensor) and tuple(r.shape) == resize.get(i):
                    strides[i] = tuple(r.stride())
        except Exception:  # noqa: BLE001  (no strides to follow: contiguous)
            pass
    return {i: (sizes, strides.get(i)) for i, sizes in resize.items()}


def _probe_outputs(spec, lowering, key_args, slots, slot_dtypes, passed, input_slots, updated_slots, compute_dtype,
                   scalars):
    probe = _make_trace(spec, lowering, key_args, slots, slot_dtypes, passed, input_slots, updated_slots, None,
                        compute_dtype, flatten=False)
    slot_shapes = [
        jax.ShapeDtypeStruct((nbytes // slot_dtypes[i].itemsize,), dtypes.to_jax(slot_dtypes[i]))
        for i, (_, nbytes) in enumerate(slots) if i in input_slots
    ]
    fresh, written = jax.eval_shape(probe, slot_shapes, list(scalars))
    written = [tuple(getattr(w, "shape", ())) for w in written]
    outputs, counts = [], []
    for (kind, is_list), value in zip([r for r in spec.returns if r[0] == "fresh"], fresh):
        values = value if is_list else [value]
        if is_list:
            counts.append(len(values))
        for v in values:
            if v is None:  # an undefined result (a gradient its output_mask did not ask for), as a meta says
                outputs.append(None)
                continue
            sizes = tuple(v.shape)
            outputs.append(OutputMeta(sizes, strided.contiguous_strides(sizes), dtypes.to_torch(v.dtype)))
    return outputs, counts, written


def _make_trace(spec, lowering, key_args, slots, slot_dtypes, passed, input_slots, updated_slots, outputs, compute_dtype,
                flatten=True, checked=False, rounded=None):
    """The program's function; `rounded`: the dtype a written floating value is rounded to before it is
    cast to its tensor's (an out= of a wider dtype than the op's result: add(half, half, out=double)
    overflows in half, as on CPU)."""
    fn = lowering.fn
    scope = str(spec.op)
    writes = spec.writes
    n_fresh = spec.n_fresh
    jax_compute = dtypes.to_jax(compute_dtype) if compute_dtype is not None else None
    promoted = frozenset(  # static scalars stay Python numbers: their lowering specializes on them (x ** 2)
        i for i in passed
        if lowering.promote is not None and spec.kinds[i] in _PROMOTABLE
        and (lowering.promote_args is None or spec.names[i] in lowering.promote_args)
        and not (lowering.static_scalars and spec.kinds[i] not in _TENSOR_KINDS)
    )
    slot_layout = [  # (jax dtype, length) of each slot's buffer
        (dtypes.to_jax(dtype), nbytes // dtype.itemsize) for dtype, (_, nbytes) in zip(slot_dtypes, slots)
    ]
    n_rng = RNG_SCALARS if lowering.rng else 0
    jax_rounded = dtypes.to_jax(rounded) if rounded is not None and (rounded.is_floating_point or rounded.is_complex) \
        else None
    layout = {}
    if lowering.layout_args:  # the key's strides: (tag, dtype, sizes, strides, offset, slot)
        layout["contiguous"] = tuple(strided.is_contiguous(*key_args[spec.index[name]][2:4])
                                     for name in lowering.layout_args)

    def trace(slot_arrays, scalars):
        with jax.named_scope(scope):
            bufs = [None] * len(slot_layout)
            for index, array in zip(input_slots, slot_arrays):
                bufs[index] = array
            for index, (jdtype, length) in enumerate(slot_layout):
                if bufs[index] is None:
                    bufs[index] = jnp.zeros((length,), jdtype)

            def read(entry, offset):
                _, dtype, sizes, strides, _, slot = entry
                return strided.read(strided.reinterpret(bufs[slot], dtypes.to_jax(dtype)), sizes, strides, offset)

            before = list(bufs)  # the slots' values before the op writes them
            call_scalars = scalars[: len(scalars) - n_rng]
            args, offsets = _rebuild(spec, key_args, call_scalars, read, lambda v, t: v,
                                     lambda v, dtype: jnp.asarray(v, dtypes.to_jax(dtype)), lambda vs, ts: list(vs))
            if jax_compute is not None:
                args = [_cast(a, jax_compute) if i in promoted else a for i, a in enumerate(args)]
            kwargs = {"key": _rng_key(scalars[-RNG_SCALARS:])} if n_rng else {}
            kwargs.update(layout)
            if checked:
                with checks.collecting() as flags:
                    result = fn(*(args[i] for i in passed), **kwargs)
            else:
                result = fn(*(args[i] for i in passed), **kwargs)
            results = _as_list(result, n_fresh + len(writes), spec)

            if not flatten:  # shape probe: the fresh results and the written values as the lowering made them
                return results[:n_fresh], list(results[n_fresh:])
            fresh = []
            for value in results[:n_fresh]:
                fresh.extend(value if isinstance(value, (list, tuple)) else [value])
            fresh_buffers = [
                strided.to_flat(jnp.broadcast_to(dtypes.cast(jnp.asarray(v), dtypes.to_jax(m.dtype)), m.sizes), m.strides)
                for v, m in zip(fresh, outputs) if m is not None
            ]
            for arg_index, value in zip(writes, results[n_fresh:]):
                entry = key_args[arg_index]
                in_place_list = spec.kinds[arg_index] not in _TENSOR_KINDS and not spec.is_out
                targets = [(0, entry)] if spec.kinds[arg_index] in _TENSOR_KINDS else list(enumerate(entry))
                values = value if isinstance(value, (list, tuple)) else [value]
                for (j, target), v in zip(targets, values):
                    if target is None:
                        continue
                    if in_place_list:  # _foreach_X_(list, ...): X_'s rule, each result castable to its tensor
                        cpu_errors.check_cast(dtypes.to_torch(jnp.result_type(v)), target[1])
                    if jax_rounded is not None and jnp.issubdtype(jnp.result_type(v), jnp.inexact):
                        v = jnp.asarray(v).astype(jax_rounded)
                    _, dtype, sizes, strides, _, slot = target
                    buf = strided.reinterpret(bufs[slot], dtypes.to_jax(dtype))
                    buf = strided.write(buf, jnp.asarray(v), sizes, strides, offsets[(arg_index, j)])
                    bufs[slot] = strided.reinterpret(buf, slot_layout[slot][0])
            if checked:  # a failed check leaves written tensors unchanged, as PyTorch's CPU kernel does
                flag = checks.combine(flags)
                kept = [jnp.where(flag[0] == 0, bufs[i], before[i]) for i in updated_slots]
                return fresh_buffers, [*kept, flag]
            return fresh_buffers, [bufs[i] for i in updated_slots]

    return trace


def _cast(value, dtype):
    if value is None:
        return None
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    return dtypes.cast(jnp.asarray(value), dtype) if hasattr(value, "dtype") else jnp.asarray(value, dtype)


def _as_list(result, expected: int, spec: OpSpec) -> list:
    if expected == 1:
        return [result]
    if not isinstance(result, (tuple, list)) or len(result) != expected:
        raise RuntimeError(f"lowering of {spec.name} returned {type(result).__name__}, expected {expected} results")
    return list(result)


def _rng_key(parts):
    seed_lo, seed_hi, offset_lo, offset_hi = (jnp.asarray(p).astype(jnp.uint32) for p in parts)
    key = jax.random.wrap_key_data(jnp.stack([seed_hi, seed_lo]), impl="threefry2x32")
    return jax.random.fold_in(jax.random.fold_in(key, offset_lo), offset_hi)


def compile_function(fn, sharding, args: tuple, donate_argnums: tuple = (), program_key: str | None = None,
                     options: tuple = ()):
    """The executable of any traced function for one device, through the compile cache (cache/).

    The one compile entry point: op programs (below) and DeferAndFuse's fused
    graphs (defer.py) both compile here. keep_unused: a cached executable is
    called with every flat argument.
    """
    (device,) = sharding.device_set
    with compile_notice.watch(fn):  # one line if it takes long
        lowered = jax.jit(fn, out_shardings=sharding, donate_argnums=donate_argnums, keep_unused=True).lower(*args)
        return cache.compile(lowered, device, program_key=program_key, options=options)


def compile_indexed(fn, sharding, args: tuple, signature, out_tree, donate_argnums: tuple = (), options: tuple = ()):
    """`compile_function`, recorded under the program key of `signature` (None: not indexable).

    A later process finds the executable by the signature alone, without tracing or
    lowering `fn`. `signature` must determine the program (see cache/key.py);
    `out_tree` is the pytree of `fn`'s results; `options`: XLA compile options (cache.compile).
    """
    (device,) = sharding.device_set
    program_key = cache.program_key(signature, device) if signature is not None and cache.settings().enabled else None
    if program_key is not None:
        executable = cache.lookup(program_key, device, jax.tree_util.tree_structure((args, {})), out_tree)
        if executable is not None:
            return executable
    return compile_function(fn, sharding, args, donate_argnums, program_key=program_key, options=options)


def compile_program(program: OpProgram, sharding, slot_arrays, scalars):
    """The program's executable for its device, through the compile cache (cache/)."""
    n_fresh = sum(meta is not None for meta in program.outputs)  # results: (fresh, updated)
    n_updated = len(program.updated_slots) + program.checks  # the error flag follows the updated slots
    out_tree = jax.tree_util.tree_structure(([0] * n_fresh, [0] * n_updated))
    signature = None
    if indexable(program):
        signature = (program.key, "value checks") if program.checks else program.key
    try:
        executable = compile_indexed(program.trace, sharding, (slot_arrays, scalars), signature, out_tree)
    except cpu_errors.FOREIGN as err:  # a lowering rejected the arguments: PyTorch's CPU error if it has one
        if isinstance(err, jax.errors.JaxRuntimeError):
            raise
        replacement = cpu_errors.as_cpu_error(program.spec, program.key, scalars, err)
        if replacement is err:
            raise
        raise replacement from None
    program.executable = executable
    program.enable_fast_path()
    return executable


def indexable(program: OpProgram) -> bool:
    """Whether the signature alone determines the program (see cache/key.py): aten ops lowered by our code or JAX."""
    if program.lowering is None:
        return False
    module = getattr(program.lowering.fn, "__module__", None) or ""
    return program.spec.op.namespace == "aten" and module.split(".")[0] in ("torch_tpu", "jax")
