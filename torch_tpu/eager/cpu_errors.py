"""PyTorch's own argument errors for calls our tracing rejects in its own words.

A program is built from a meta run (PyTorch's shapes and errors) and a JAX
trace. Some bad arguments pass the meta kernel and fail in JAX instead (a
`TypeError`/`ValueError` of a lowering: a negative dilation, 2-D boundaries for
bucketize), and some meta kernels raise another type than the CPU kernel (an
`AssertionError` for a 0-D embedding weight, a `RuntimeError` where CPU raises
`IndexError`). PyTorch's CPU kernel is the reference for argument errors: the
call is replayed on CPU tensors of the same shapes and dtypes (zeros), and its
error is raised instead. If the CPU accepts the call, the original error
stands (it is ours).

Owns: the replay. Does not own: which errors go through it (program.py, defer.py).
"""
from __future__ import annotations

import math
import warnings

import torch

from torch_tpu import _native
from torch_tpu.eager import keys
from torch_tpu.runtime.dtypes import cpp_name, scalar_type_name

# Errors a lowering or meta kernel raises that are not PyTorch-style argument errors.
FOREIGN = (TypeError, ValueError, IndexError, AssertionError, KeyError, RuntimeError)
_MAX_ELEMENTS = 1 << 24
_PYTORCH_NAMESPACES = ("aten", "prims")
_OVERLAP = "unsupported operation: "  # ATen's memory-overlap errors (MemoryOverlap.cpp)


def as_cpu_error(spec, key, scalars, err: BaseException) -> BaseException:
    """The error PyTorch's CPU kernel raises for this call (same shapes and dtypes), or `err`."""
    if not isinstance(err, FOREIGN) or isinstance(err, NotImplementedError):
        return err
    if spec.op.namespace not in _PYTORCH_NAMESPACES:  # a custom op (a jax_op): no CPU kernel of PyTorch's to ask
        return err
    key_args = key[2:2 + spec.n_args]
    cpu_err = _replay(spec, key_args, scalars)
    if cpu_err is None or (type(cpu_err) is type(err) and str(cpu_err) == str(err)):
        return err
    return cpu_err


def as_cpu_error_of_call(op, args, kwargs, err: BaseException) -> BaseException:
    """`as_cpu_error` for a call that never became a program (a decomposition raised): PyTorch's CPU
    kernel asked with zeros of the arguments' shapes and dtypes (the references word some checks
    otherwise: "scalar type torch.float32" for CPU's "scalar type Float")."""
    if not isinstance(err, FOREIGN) or isinstance(err, NotImplementedError) or op.namespace not in _PYTORCH_NAMESPACES:
        return err
    tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if any(t.numel() > _MAX_ELEMENTS or t.is_nested or t.layout != torch.strided for t in tensors):
        return err

    def on_cpu(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros(x.shape, dtype=x.dtype)
        return torch.device("cpu") if isinstance(x, torch.device) else x

    cpu_args, cpu_kwargs = torch.utils._pytree.tree_map(on_cpu, (args, kwargs))
    cpu_err = _error_of(lambda: op(*cpu_args, **cpu_kwargs))
    if cpu_err is None or (type(cpu_err) is type(err) and str(cpu_err) == str(err)):
        return err
    return cpu_err


def check_out_dtypes(spec, key_args, scalars, result_dtype) -> None:
    """Raise PyTorch's error for an out= tensor of a dtype its kernel refuses: neg(half, out=float)
    raises "Found dtype Float but expected Half" on every device (TensorIterator's same-dtype check),
    which the Python-reference meta kernels let through (they cast). Asked of the CPU kernel when an
    out= dtype is none of the inputs', the promoted result's, long or bool; only its dtype errors
    are raised (a CPU kernel's missing dtype, "not implemented for 'Half'", is not ours)."""
    if not spec.is_out or spec.op.namespace not in _PYTORCH_NAMESPACES:
        return
    expected = {torch.int64, torch.bool, result_dtype}
    written = []
    for i, kind in enumerate(spec.kinds):
        for entry in keys.tensor_entries(kind, key_args[i]):
            if i in spec.writes:
                written.append(entry[1])
            else:
                expected.add(entry[1])
    if all(dtype in expected for dtype in written):
        return
    cpu_err = _replay(spec, key_args, scalars)
    if cpu_err is not None and _is_dtype_error(cpu_err):
        raise cpu_err


def check_memory_overlap(spec, key_args, scalars, slots) -> None:
    """Raise PyTorch's error for a write into memory the call also reads or writes elsewhere: an expanded
    tensor (a zero stride: "more than one element of the written-to tensor refers to a single memory
    location"), or an argument sharing the written tensor's storage ("some elements of the input tensor
    and the written-to tensor refer to a single memory location"). Kernels differ (fill_, masked_fill_,
    index_put_ accept an expanded tensor; elementwise ops accept an exact alias), so the CPU kernel is
    asked, on zeros laid out as the key's tensors over one CPU storage per device storage, when a written
    tensor is expanded or shares its storage with another argument. Its warnings (index_fill_ on an
    expanded tensor) are PyTorch's too, and pass through."""
    if spec.op.namespace not in _PYTORCH_NAMESPACES:
        return
    written = [e for i in spec.writes for e in keys.tensor_entries(spec.kinds[i], key_args[i])]
    others = [e for i, kind in enumerate(spec.kinds) if i not in spec.writes for e in keys.tensor_entries(kind, key_args[i])]
    written_slots = [e[5] for e in written if e[0] == keys.TENSOR]
    shared = len(set(written_slots)) < len(written_slots) or any(
        e[0] == keys.TENSOR and e[5] in written_slots for e in others)
    if not shared and not any(_expanded(e) for e in written if e[0] == keys.TENSOR):
        return
    cpu_err = _replay(spec, key_args, scalars, slots=slots)
    if cpu_err is not None and _OVERLAP in str(cpu_err):
        raise cpu_err


def _expanded(entry) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(entry[2], entry[3]))


def check_cast(result_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """PyTorch's error for an in-place op whose result type cannot be cast to its tensor's `dtype`
    (some meta kernels, mul_'s and addcmul_'s, let it through)."""
    if torch.can_cast(result_dtype, dtype):
        return
    try:  # the CPU kernel's own words ("result type Float can't be cast to the desired output type Int")
        torch.empty(0, dtype=dtype).add_(torch.empty(0, dtype=result_dtype))
    except RuntimeError as err:
        raise err from None
    raise RuntimeError(f"result type {result_dtype} can't be cast to the desired output type {dtype}")


def _is_dtype_error(err: BaseException) -> bool:
    text = str(err)
    return (isinstance(err, RuntimeError) and ("dtype" in text or "scalar_type" in text or "scalar type" in text)
            and "not implemented for" not in text and "Unsupported dtype" not in text)


def _replay(spec, key_args, scalars, slots=None, max_size=None) -> BaseException | None:
    """The exception PyTorch's CPU kernel raises for these arguments on zeros, or None (it accepts them, or
    they cannot be replayed: too big, not rebuildable). Each tensor is contiguous, or, given the key's
    `slots`, a view with the key's strides and offset of one CPU storage per slot (aliasing as on device).
    `max_size`: every dimension cut to at most that size (a question about dtypes, not shapes)."""
    too_big = []
    storages = {}

    def tensor(entry, offset):
        sizes, strides = entry[2], entry[3]
        if max_size is not None:
            sizes = tuple(min(size, max_size) for size in sizes)
        nbytes = slots[entry[5]][1] if slots is not None else 0
        if math.prod(sizes) > _MAX_ELEMENTS or nbytes > _MAX_ELEMENTS * 8:
            too_big.append(entry)
        if too_big:
            return torch.zeros((), dtype=entry[1])
        if slots is None:
            return torch.zeros(sizes, dtype=entry[1])
        storage = storages.get(entry[5])
        if storage is None:
            storage = storages[entry[5]] = torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=entry[1]).set_(storage, offset, sizes, strides)

    try:
        args, _ = keys.rebuild(spec, key_args, [_host(s) for s in scalars], tensor, lambda v, t: v,
                               lambda v, dtype: torch.tensor(v, dtype=dtype), lambda vs, ts: list(vs))
    except Exception:  # noqa: BLE001
        return None
    if too_big:
        return None
    if "device" in spec.index:
        args[spec.index["device"]] = torch.device("cpu")
    return _error_of(lambda: spec.call(args), keep_warnings=slots is not None)


# The start of ATen's out= resize warning, which the executor gives itself when it resizes (once per call).
OUT_RESIZED_WARNING = "An output with one or more elements was resized"


def _error_of(call, keep_warnings: bool = False) -> BaseException | None:
    """The exception a CPU call raises, or None. Its Python warnings are silenced, but with `keep_warnings`
    (the memory-overlap replay) those about expanded tensors pass on: only that replay reproduces them. The
    CPU kernel's own (C++) warnings pass on too (arange's out= numel warning is given by this replay), except
    the out= resize warning, which the executor gives once when it resizes."""
    error = None
    caught = []

    def replay():
        nonlocal error
        with warnings.catch_warnings(record=True) as python_warnings:
            warnings.simplefilter("always")
            try:
                call()
            except Exception as cpu_err:  # noqa: BLE001  (PyTorch's own error)
                error = cpu_err.with_traceback(None)  # raised at the user's call, not inside this replay
        caught.extend(python_warnings)

    with warnings.catch_warnings(record=True) as cpp_warnings:
        warnings.simplefilter("always")
        _native.capture_cpp_warnings(replay)  # the C++ warnings arrive here, when it returns
    for w in caught if keep_warnings else ():
        if "expanded tensors" in str(w.message):
            warnings.warn(w.message, stacklevel=5)
    for w in cpp_warnings:
        if not str(w.message).startswith(OUT_RESIZED_WARNING):
            warnings.warn(w.message, stacklevel=5)
    return error


def _host(value):
    """A runtime scalar as a Python value (the executors may hold it as a device scalar)."""
    if hasattr(value, "shape") and not isinstance(value, (int, float, bool, complex)):
        try:
            return value.item()
        except Exception:  # noqa: BLE001
            return value
    return value


_ALPHA_OPS = frozenset(("add", "sub", "rsub"))
_SUB_OPS = frozenset(("sub", "rsub", "subtract"))
_DIM_MASK_OPS = frozenset(("argmax", "argmin", "max", "min"))  # the meta kernels skip the 64-dim check


def _is_bool(x) -> bool:
    return isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)


_REPLAY_EXACT_ELEMENTS = 1 << 16
# CPU refusals of complex inputs that other devices do not make (CUDA has a complex nansum).
_CPU_ONLY_COMPLEX_REFUSALS = ("nansum on CPU does not support complex inputs",)


def check_complex(spec, key_args, scalars) -> None:
    """Raise PyTorch's error for complex arguments of an op that is not defined on complex numbers. JAX
    orders complex numbers lexicographically, so our lowerings of clamp, minimum/maximum, max/min,
    sort, topk, comparisons... computed where every PyTorch device refuses ("clamp is not supported
    for complex types", '"lt_cpu" not implemented for 'ComplexFloat''). Asked of the CPU kernel at
    build time, for calls with a complex tensor; only its refusals of complex dtypes are raised."""
    entries = [entry for kind, arg in zip(spec.kinds, key_args) for entry in keys.tensor_entries(kind, arg)]
    if spec.op.namespace not in _PYTORCH_NAMESPACES or not any(entry[1].is_complex for entry in entries):
        return
    # The CPU kernel runs on zeros of the call's shapes. A big call (a large complex matmul would cost
    # seconds) is asked first with every dimension cut to 2: a refusal of the dtype comes before any work,
    # and an acceptance ends the question; another error (arguments that no longer fit the cut shapes, as
    # topk(k=5)) leaves it open, and the call is replayed whole.
    big = any(math.prod(entry[2]) > _REPLAY_EXACT_ELEMENTS for entry in entries)
    cpu_err = _replay(spec, key_args, scalars, max_size=2) if big else None
    if not big or (cpu_err is not None and not _is_complex_refusal(cpu_err)):
        cpu_err = _replay(spec, key_args, scalars)
    if cpu_err is not None and _is_complex_refusal(cpu_err):
        raise cpu_err


def _is_complex_refusal(err: BaseException) -> bool:
    text = str(err)
    if not isinstance(err, (RuntimeError, NotImplementedError)) or any(m in text for m in _CPU_ONLY_COMPLEX_REFUSALS):
        return False
    return "for 'Complex" in text or "complex" in text.lower()


def check_arguments(spec, meta_args) -> None:
    """Argument checks ATen's kernels make on every device that the meta kernels (Python references)
    skip, at build time: alpha_check (BinaryOps.h) for add/sub/rsub (a float alpha with a bool
    tensor, a bool alpha with a non-bool result), sub_check (a bool operand), heaviside's same-dtype
    check, relu of bool, frexp's int32 exponent out=, the 64-dim limit of argmax/argmin/max/min
    over a dim, searchsorted/bucketize's out= dtype, a complex value/weight of real addcmul/addcdiv/
    lerp; and their non-contiguous operand warning. A `_foreach_X` op is checked as X, element by element."""
    base = spec.name.split(".")[1].rstrip("_")
    if base.startswith("_foreach_") and meta_args and isinstance(meta_args[0], (list, tuple)):
        for i in range(len(meta_args[0])):
            _check_call(spec, base[len("_foreach_"):], [a[i] if isinstance(a, (list, tuple)) else a for a in meta_args])
        return
    _check_call(spec, base, meta_args)


_OPMATH_SCALARS = frozenset(("addcmul", "addcdiv", "lerp"))


def _check_call(spec, base: str, meta_args) -> None:
    if base in _OPMATH_SCALARS:
        name = "value" if "value" in spec.index else "weight"
        scalar = _host(meta_args[spec.index[name]]) if name in spec.index else None
        dtype = meta_args[0].dtype
        if isinstance(scalar, complex) and dtype.is_floating_point:  # ATen converts it to the opmath type
            raise RuntimeError(f"value cannot be converted to type {'double' if dtype == torch.float64 else 'float'} "
                               "without overflow")
    if base in _SUB_OPS and len(meta_args) > 1:
        a, b = _host(meta_args[0]), _host(meta_args[1])
        if _is_bool(a) and _is_bool(b):
            raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                               "Use the `^` or `logical_xor()` operator instead.")
        if _is_bool(a) or _is_bool(b):
            raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                               "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.")
    elif base == "heaviside" and meta_args[0].dtype != meta_args[1].dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")
    elif base == "relu" and meta_args[0].dtype == torch.bool:
        raise RuntimeError("Boolean inputs not supported for relu")
    elif (base in _DIM_MASK_OPS and "dim" in spec.index and meta_args[spec.index["dim"]] is not None
          and meta_args[0].dim() > 64):
        raise RuntimeError("only tensors with up to 64 dims are supported")  # ATen's dim mask is 64 bits
    elif base == "frexp" and spec.is_out and meta_args[spec.index["exponent"]].dtype != torch.int32:
        raise RuntimeError("torch.frexp() expects exponent to have int dtype but got "
                           f"{cpp_name(meta_args[spec.index['exponent']].dtype)}")
    if "alpha" in spec.index and base in _ALPHA_OPS:
        _check_alpha(meta_args[0], meta_args[1], _host(meta_args[spec.index["alpha"]]))
    if base in _BUCKETIZE_OPERANDS and spec.is_out:
        out_dtype, out_int32 = meta_args[spec.index["out"]].dtype, _host(meta_args[spec.index["out_int32"]])
        if out_dtype != (torch.int32 if out_int32 else torch.int64):
            raise RuntimeError("torch.searchsorted(): output tensor's dtype is wrong, it can only be Int(int32) or "
                               "Long(int64) depending on whether out_int32 flag is True, but we got output tensor's "
                               f"dtype {scalar_type_name(out_dtype)} and out_int32 flag is {bool(out_int32)}")
    for name, what in _BUCKETIZE_OPERANDS.get(base, ()):
        t = meta_args[spec.index[name]] if name in spec.index else None
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            _warn_once(f"torch.searchsorted(): {what} tensor is non-contiguous, this will lower the performance due "
                       "to extra data copy when converting non-contiguous tensor to contiguous, please use contiguous "
                       f"{what} tensor if possible. This message will only appear once per program.")


# ATen's bucketization kernels copy a non-contiguous operand and say so (TORCH_WARN_ONCE); reading a
# strided view is a copy (a gather) here too.
_BUCKETIZE_OPERANDS = {
    "searchsorted": (("self", "input value"), ("sorted_sequence", "boundary"), ("sorter", "sorter")),
    "bucketize": (("self", "input value"), ("boundaries", "boundary")),
}
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """TORCH_WARN_ONCE: once per process, or every time under torch.set_warn_always(True)."""
    if message in _warned and not torch.is_warn_always_enabled():
        return
    _warned.add(message)
    warnings.warn(message, UserWarning, stacklevel=2)


def _check_alpha(a, b, alpha) -> None:
    if alpha is None:
        return
    dtype = torch.result_type(a, b)
    if isinstance(alpha, bool) and dtype != torch.bool:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")
    if not (dtype.is_floating_point or dtype.is_complex) and not isinstance(alpha, (bool, int)):
        raise RuntimeError("For integral input tensors, argument alpha must not be a floating point number.")
    if not dtype.is_complex and isinstance(alpha, complex):
        raise RuntimeError("For non-complex input tensors, argument alpha must not be a complex number.")
