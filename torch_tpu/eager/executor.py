"""Strict and Debug eager execution.

Strict (default): every dispatched op becomes one cached program (its view
reads, the lowering, its write-backs) and is launched asynchronously; the call
returns before the device finishes. Debug (TORCH_TPU_LAUNCH_BLOCKING=1): the
same, but each op waits for its results, so an error surfaces at the Python
line of the failing op.

DeferAndFuse (eager/defer.py) shares the signatures, the program cache and
the runtime scalars; its mode turns the native cache-hit path off, and
`execute` hands it every call after one flag check.

Owns: signatures (cache keys), the process-local program cache, launching,
output tensors and storage updates, error translation. Does not own: what an
op computes (ops/) or how its program is traced (program.py).
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import torch

from torch_tpu import _native, metrics, precision, recompiles, xla_options
from torch_tpu import profiler as _trace
from torch_tpu.cache import levels as cache_levels
from torch_tpu.config import config
from torch_tpu.eager import program as program_mod
from torch_tpu.eager import opspec
from torch_tpu.eager import valuecheck as _valuecheck
from torch_tpu.eager.opspec import Arg, OpSpec
from torch_tpu.ops.registry import Lowering
from torch_tpu.runtime import platform, storage, strided
from torch_tpu.runtime.errors import translate_runtime_error

_signature_of = _native.tensor_signature
_fast_signature = _native.fast_signature
_new_outputs = _native.new_outputs
_run_cached = _native.run_cached
_counts = metrics.counts
_native.set_fast_path(not (config.launch_blocking or config.defer_and_fuse or xla_options.active))
_native.set_value_check_hook(_valuecheck.launched)  # value-checked cache hits hand their flags here
_new_tensor = _native.new_tensor
_buffers = storage.buffers
_TENSOR, _CPU, _SCALAR, _SCALAR_LIST = program_mod.TENSOR, program_mod.CPU_SCALAR, program_mod.SCALAR, program_mod.SCALAR_LIST
_T, _OT, _TL, _OTL, _S, _OS, _SL, _GEN = (
    Arg.TENSOR, Arg.OPT_TENSOR, Arg.TENSOR_LIST, Arg.OPT_TENSOR_LIST, Arg.SCALAR, Arg.OPT_SCALAR, Arg.SCALAR_LIST,
    Arg.GENERATOR,
)

_NUMBERS = (int, float, bool, complex)

class _Programs(cache_levels.ExecutableTable):
    """Level 1 of the compile cache: signature -> OpProgram (with its executable), bounded like
    the compile cache's level 1 (`cache.levels.ExecutableTable`).

    The boxed kernels' per-op entries (native.cpp) are made from these programs;
    removing programs makes every kernel drop its entries.
    """

    def drop_oldest(self, n: int) -> None:
        super().drop_oldest(n)
        _native.invalidate_fast_entries()

    def clear(self):
        super().clear()
        _native.invalidate_fast_entries()

    def pop(self, *args):
        _native.invalidate_fast_entries()
        return super().pop(*args)

    def __delitem__(self, key):
        super().__delitem__(key)
        _native.invalidate_fast_entries()


programs: dict[tuple, program_mod.OpProgram] = _Programs()


def _device_error(spec: OpSpec, name: str, first: str, second: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {first} and {second}! "
        f"(when checking argument '{name}' for {spec.name})"
    )


def signature(spec: OpSpec, lowering: Lowering, full: list):
    """(key, slot addresses, slot buffer entries, runtime scalars, device, generator) of one call.

    The slow path of `_native.fast_signature` (same key layout): it also
    handles CPU scalar tensors, device-less factories and raises the
    PyTorch-style errors for mixed devices and bad arguments.
    """
    entries = []
    scalars = []
    slot_of: dict[int, int] = {}
    slot_addresses = []
    slot_nbytes = []
    device = -1
    static_scalars = lowering.static_scalars
    generator = None

    def tensor_entry(t, name, written):
        nonlocal device
        dtype, sizes, strides, offset, nbytes, index, address = _signature_of(t)
        if index < 0 or t.device.type != "tpu":
            if t.device.type == "cpu" and t.dim() == 0 and not written:
                scalars.append(t.item())
                return (_CPU, dtype)
            raise _device_error(spec, name, "tpu:%d" % max(device, 0), str(t.device))
        if device != index:
            if device >= 0:
                raise _device_error(spec, name, "tpu:%d" % device, "tpu:%d" % index)
            device = index
        slot = slot_of.get(address)
        if slot is None:
            slot = slot_of[address] = len(slot_addresses)
            slot_addresses.append(address)
            slot_nbytes.append(nbytes)
        if offset:  # a runtime scalar: one program serves every offset
            scalars.append(offset)
            return (_TENSOR, dtype, sizes, strides, program_mod.DYNAMIC, slot)
        return (_TENSOR, dtype, sizes, strides, 0, slot)

    writes = spec.writes
    for i, (kind, value) in enumerate(zip(spec.kinds, full)):
        if value is None:
            entries.append(None)
        elif kind <= _OT:
            if isinstance(value, torch.Tensor):
                entries.append(tensor_entry(value, spec.names[i], i in writes))
            elif type(value) in _NUMBERS:  # a wrapped number: PyTorch hands it back as a Python scalar
                entries.append((_SCALAR, type(value)))
                scalars.append(value)
            else:
                raise TypeError(f"{spec.name}: argument '{spec.names[i]}' must be a Tensor, not {type(value).__name__}")
        elif kind <= _OTL:
            entries.append(tuple(None if t is None else tensor_entry(t, spec.names[i], i in writes) for t in value))
        elif kind <= _OS:
            if static_scalars:
                entries.append(("V", value))
            else:
                entries.append((_SCALAR, type(value)))
                scalars.append(value)
        elif kind == _SL:
            entries.append((_SCALAR_LIST, tuple(map(type, value))))
            scalars.extend(value)
        elif kind == _GEN:
            generator = value
            entries.append(None)
        else:
            entries.append(tuple(value) if type(value) is list else value)

    if device < 0:
        device = _device_from_args(spec, full)
    slots = []
    slot_entries = []
    for address, nbytes in zip(slot_addresses, slot_nbytes):
        entry = _buffers.get(address)
        slot_entries.append(entry)
        slots.append((None if entry is None else entry[1], nbytes))
    key = (spec.name, device, *entries, tuple(slots))
    return key, slot_addresses, slot_entries, scalars, device, generator


def _device_from_args(spec: OpSpec, full: list) -> int:
    if "device" in spec.index:
        value = full[spec.index["device"]]
        if value is not None:
            d = torch.device(value)
            if d.type == "tpu":
                return d.index if d.index is not None else _native.current_device()
    return _native.current_device()


def _rng_scalars(generator, device: int):
    if generator is None:
        generator = _native.default_generator(device)
    elif generator.device.type != "tpu":
        raise RuntimeError(f"Expected a 'tpu' device type for generator but found '{generator.device.type}'")
    seed = generator.initial_seed()
    offset = generator.get_offset()
    generator.set_offset(offset + 1)
    return (seed & 0xFFFFFFFF, seed >> 32, offset & 0xFFFFFFFF, offset >> 32)


def resize_and_rerun(spec: OpSpec, lowering: Lowering, via_functional: bool, full: list, prog, generator, device: int):
    """Resize the out= tensors a program's first run found too small, and run the call again. An RNG op
    gives back the offset it took: the rerun draws this call's numbers (randperm(n, out=empty) draws
    as randperm(n))."""
    if lowering.rng:
        generator = generator if generator is not None else _native.default_generator(device)
        generator.set_offset(generator.get_offset() - 1)
    for index, (sizes, strides) in prog.resize.items():
        _resize_out(full[index], sizes, strides, spec)
    return execute(spec, lowering, via_functional, *full)


_MISS = object()
_NO_TRACE = contextlib.nullcontext()


def kernel(spec: OpSpec, lowering: Lowering, via_functional: bool):
    """The tpu kernel registered for one op: native for cache hits, `execute` otherwise."""
    k = _native.OpKernel()
    k.op, k.kinds, k.names, k.defaults, k.required = spec.name, spec.kinds, spec.names, spec.defaults, opspec.REQUIRED
    k.static_scalars, k.precision = lowering.static_scalars, lowering.precision
    k.use_fast = not (lowering.rng or lowering.host_check)  # the native paths would skip both
    k.slow = functools.partial(execute, spec, lowering, via_functional)
    k.programs, k.buffers, k.scalar_cache, k.miss = programs, _buffers, _scalar_cache, _MISS
    k.precision_key, k.translate, k.runtime_error = precision.matmul_precision, translate_runtime_error, jax.errors.JaxRuntimeError
    return k


def update_fast_path() -> None:
    """Native cache-hit paths run unless a mode needs every op in Python (Debug, DeferAndFuse, XLA options);
    in DeferAndFuse the native recorder (csrc/native.cpp) records seen signatures."""
    _native.set_fast_path(not (config.launch_blocking or config.defer_and_fuse or xla_options.active))
    _native.set_defer_path(config.defer_and_fuse and not config.launch_blocking and not xla_options.active)


def _no_recorder(spec: OpSpec, lowering: Lowering, via_functional: bool, full: list):
    raise RuntimeError("DeferAndFuse is on, but its recorder (torch_tpu.eager.defer) was never imported")


# DeferAndFuse's recorder: importing eager/defer.py installs its `record` here (kernels.register_all
# imports it), so this module, which defer builds on, never imports defer.
_record = _no_recorder


def execute(spec: OpSpec, lowering: Lowering, via_functional: bool, *args, **kwargs):
    """Run one dispatched op as its cached program; return what the op returns."""
    full = list(args) if not kwargs and len(args) == spec.n_args else spec.normalize(args, kwargs)
    if lowering.host_check is not None:
        # the functional op's arguments: a derived out= variant's out= tensors come last
        after = lowering.host_check(*(full[:len(lowering.op._schema.arguments)] if via_functional and spec.is_out
                                      else full))
        if after is not None:  # a check of the results on the host (an *_ex op's check_errors=True)
            result = _launch(spec, lowering, via_functional, full)
            after(result)
            return result
    return _launch(spec, lowering, via_functional, full)


def _launch(spec: OpSpec, lowering: Lowering, via_functional: bool, full: list):
    if config.defer_and_fuse:  # DeferAndFuse: record instead of launching (defer.py)
        return _record(spec, lowering, via_functional, full)
    if not (lowering.rng or config.launch_blocking or _trace.active or xla_options.active):
        # Cache hit: one native call does signature, lookup, launch and outputs.
        extra = (precision.matmul_precision(),) if lowering.precision else ()
        try:
            out = _run_cached(spec.name, spec.kinds, full, _buffers, lowering.static_scalars, programs, _scalar_cache,
                              extra, _MISS)
        except jax.errors.JaxRuntimeError as err:
            raise translate_runtime_error(err, spec.name) from None
        if out is not _MISS:
            return out
    return _execute_slow(spec, lowering, via_functional, full)


def _execute_slow(spec: OpSpec, lowering: Lowering, via_functional: bool, full: list):
    """The Python path: misses, first runs, RNG ops, debug mode, unusual arguments."""
    sig = _fast_signature(spec.name, spec.kinds, full, _buffers, lowering.static_scalars)
    if sig is None:
        sig = signature(spec, lowering, full)
    key, slot_addresses, slot_entries, scalars, device, generator = sig
    if _valuecheck.any_lost:  # reading the result of an op that failed a value check raises
        _valuecheck.raise_if_lost(slot_entries)
    if lowering.rng:
        scalars.extend(_rng_scalars(generator, device))
    key = state_key(key, lowering)
    prog = programs.get(key)
    if prog is None:
        prog = _miss(key, spec, lowering, scalars, via_functional)
    else:
        _counts.cache_hits += 1
    if prog.resize:
        return resize_and_rerun(spec, lowering, via_functional, full, prog, generator, device)

    arrays = [slot_entries[i][0] for i in prog.input_slots]
    if scalars:
        scalars = _device_scalars(scalars, device)
    executable = prog.executable
    try:
        first = executable is None
        if first:
            with _trace.compiling(spec.name, device) if _trace.active else _NO_TRACE:
                executable = program_mod.compile_program(prog, platform.get().shardings[device], arrays, scalars)
        if _trace.active:  # torch.profiler device rows (profiler.py)
            fresh, updated = _trace.run_program(spec.name, device, executable, arrays, scalars)
        else:
            fresh, updated = executable(arrays, scalars)
        if first:
            prog.adopt_direct_call(len(arrays) + len(scalars), fresh, updated)
        if config.launch_blocking:
            jax.block_until_ready((fresh, updated))
            _counts.synchronous_waits += 1
    except jax.errors.JaxRuntimeError as err:
        raise translate_runtime_error(err, spec.name) from None
    _counts.ops_executed += 1
    if updated:
        slot_dtypes = prog.slot_dtypes
        for slot, array in zip(prog.updated_slots, updated):  # a value-checked program's flag comes last
            _buffers[slot_addresses[slot]] = (array, slot_dtypes[slot])
    outs = _new_outputs(prog.layouts, fresh, device, _buffers)
    if prog.checks:  # checked at the next materialization point (now, in Debug mode)
        _valuecheck.launched(updated[-1], spec.name, fresh)  # written tensors keep their values on failure
    return _returns(spec, prog, full, outs)


def state_key(key: tuple, lowering: Lowering) -> tuple:
    """`key` (a call's signature) with the global state its program depends on.

    The default dtype when it is not float32 (the native paths key calls under float32 only and leave
    the others here: csrc/native.cpp, `default_dtype_is_float`), then XLA options other than the defaults,
    and last the float32 matmul precision of a product (`program.build` reads it from `key[-1]`).
    """
    key = (*key, *program_mod.default_dtype_entry())
    if xla_options.active:
        key = (*key, *xla_options.key())
    if lowering.precision:
        key = (*key, precision.matmul_precision())
    return key


def _miss(key, spec, lowering, scalars, via_functional):
    _counts.cache_misses += 1
    prog = program_mod.build(key, spec, lowering, scalars, via_functional)
    programs[key] = prog
    recompiles.op_compiled(key, spec)  # miss path only: why this site compiled again
    return prog


# Runtime scalars (learning rates, eps, alphas) as device arrays: a Python
# float passed to a program is a host->device copy per call; a cached,
# weakly-typed device scalar is not, and compiles to the same program.
_scalar_cache: dict = {}
_SCALAR_CACHE_LIMIT = 4096


def scalar_key(value, device: int) -> tuple:
    """The cache key of a runtime scalar: -0.0 == 0.0 as a dict key, so negative zero has its own
    (csrc/native.cpp builds the same keys)."""
    if not value and type(value) is float and math.copysign(1.0, value) < 0:
        return (float, "-0.0", device)
    return (type(value), value, device)


def same_scalars(a: list, b: list) -> bool:
    """Equal runtime scalar lists, telling -0.0 from 0.0 (list equality does not)."""
    return a == b and all(x or type(x) is not float or math.copysign(1.0, x) == math.copysign(1.0, y)
                          for x, y in zip(a, b))


def _device_scalars(scalars: list, device: int) -> list:
    out = []
    for value in scalars:
        cache_key = scalar_key(value, device)
        array = _scalar_cache.get(cache_key)
        if array is None:
            if len(_scalar_cache) >= _SCALAR_CACHE_LIMIT:
                _scalar_cache.clear()
            array = _scalar_cache[cache_key] = jax.device_put(value, platform.get().devices[device])
        out.append(array)
    return out


_returns = program_mod.returns  # shared with the torch.compile backend (compile/graph.py)


def _resize_out(t: torch.Tensor, sizes, strides, spec: OpSpec) -> None:
    if t.numel() != 0 and spec.name not in opspec.RESIZED_ONLY_TO_ANOTHER_NUMEL:
        import warnings

        warnings.warn(
            f"An output with one or more elements was resized since it had shape {list(t.shape)}, which does not "
            f"match the required output shape {list(sizes)}. This behavior is deprecated, and in a future PyTorch "
            "release outputs will not be resized unless they have zero elements. You can explicitly reuse an out "
            "tensor t by resizing it, inplace, to zero elements with t.resize_(0).",
            UserWarning,
            stacklevel=4,
        )
    t.resize_(sizes)
    if strides is not None and tuple(t.stride()) != tuple(strides) and strided.dense_permutation(sizes, strides):
        t.as_strided_(sizes, strides)  # a dense permutation: the same elements resize_ allocated


update_fast_path()
