"""Registering "tpu" kernels with PyTorch's dispatcher.

At import only a catch-all fallback is registered (cheap, no JAX). The first
op that reaches it initialises the runtime and registers the real kernels:
one per lowered op, one per in-place/out= variant derived from its schema,
metadata-only view ops (PyTorch's own CPU kernels, redispatched: they only
touch sizes/strides/storage), the special kernels (copy_, resize_, item) and the
sparse COO kernels (eager/sparse.py, on the SparsePrivateUse1 key).
Ops with no kernel land in the fallback: decomposition, else CPU fallback.
Strided nested tensors (NestedTensorPrivateUse1) take the CPU fallback: PyTorch's
NestedTensorCPU kernels on copies; only unbind and select of dim 0 make views on the device.
"""
from __future__ import annotations

import functools
import threading
import warnings

import torch
from torch.utils import _pytree as pytree

from torch_tpu import _native, metrics
from torch_tpu.config import config
from torch_tpu.eager import cpu_errors
from torch_tpu.eager.opspec import RESIZED_ONLY_TO_ANOTHER_NUMEL, computes_in_out_dtype, functional_counterpart, spec

aten = torch.ops.aten
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_CPU_DEVICE = torch.device("cpu")
_libraries: list = []
_kernels: dict = {}  # op -> kernel, for ops reaching the fallback before registration
_registered = False
_lock = threading.RLock()


def register_fallback() -> None:
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_fallback, "PrivateUse1")
    # Strided nested tensors (torch.nested, nn.TransformerEncoder's fast path): PyTorch's own
    # NestedTensorCPU kernels, on copies (cpu_fallback).
    lib.fallback(_nested_fallback, "NestedTensorPrivateUse1")
    _libraries.append(lib)


def _has(op, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)


def register_all() -> None:
    """Register every tpu kernel (idempotent; called by runtime initialisation)."""
    global _registered
    with _lock:
        if _registered:
            return
        from torch_tpu import ops
        from torch_tpu.eager import defer  # noqa: F401  (installs DeferAndFuse's recorder in the executor)
        from torch_tpu.eager import sparse, special
        from torch_tpu.ops import registry

        ops.load_all()
        lib = torch.library.Library("aten", "IMPL")
        _libraries.append(lib)
        libraries = {"aten": lib}

        def add(op, kernel):
            if op in _kernels:
                raise RuntimeError(f"two tpu kernels for {op}")
            _kernels[op] = kernel
            namespace = op._schema.name.split("::")[0]  # our own ops live in "torch_tpu"
            if isinstance(kernel, _native.OpKernel):  # a boxed C++ kernel: no Python objects on a cache hit
                _native.register_boxed(kernel, namespace, op._schema.name.split("::")[1] +
                                       (f".{op._overloadname}" if op._overloadname != "default" else ""))
                return
            if namespace not in libraries:
                libraries[namespace] = torch.library.Library(namespace, "IMPL")
                _libraries.append(libraries[namespace])
            libraries[namespace].impl(op, kernel, "PrivateUse1")

        for op, kernel in special.kernels().items():
            add(op, kernel)
        for op, kernel in sparse.dense_kernels().items():  # dense -> sparse COO
            add(op, kernel)
        for op, kernel in sparse.sparse_kernels().items():  # sparse COO tpu tensors (eager/sparse.py)
            lib.impl(op, kernel, "SparsePrivateUse1")
        for op, kernel in sparse.csr_kernels().items():  # 2-D sparse CSR tpu tensors
            lib.impl(op, kernel, "SparseCsrPrivateUse1")
        for op in _nested_composites():  # strided nested tpu tensors, as the fallback does
            lib.impl(op, functools.partial(_nested_fallback, op), "NestedTensorPrivateUse1")
        for op in _NESTED_METADATA:  # they clone the CPU metadata: no copy of the buffer
            lib.impl(op, _redispatch_cpu(op, _NESTED_CPU), "NestedTensorPrivateUse1")
        lib.impl(aten.unbind.int, _nested_unbind, "NestedTensorPrivateUse1")  # views of the buffer, as ATen's
        lib.impl(aten.select.int, _nested_select, "NestedTensorPrivateUse1")
        torch_level = registry.kernels()
        for op, kernel in torch_level.items():  # torch-level kernels (ops/dynamic.py)
            add(op, kernel)
            for variant in mutating_variants(op):
                if variant not in _kernels and registry.get(variant) is None and variant not in torch_level:
                    add(variant, _written_by(variant, kernel))
        for op, lowering in registry.table().items():
            if op in _kernels or not lowering.eager:
                continue
            add(op, _prepared(op, _lowered_kernel(op, lowering, via_functional=False)))
            for variant in (mutating_variants(op) if not lowering.mutates else ()):
                if variant not in _kernels and registry.get(variant) is None:
                    add(variant, _prepared(variant, _lowered_kernel(variant, lowering, via_functional=True)))
        for op in metadata_ops():
            if op not in _kernels:
                add(op, _redispatch_cpu(op))
        _registered = True


def register_lowered(op) -> None:
    """The tpu kernel of a lowering added after `register_all` ran (`torch_tpu.pallas.jax_op` ops).

    Before that, `register_all` registers it with the others.
    """
    from torch_tpu.ops import registry

    with _lock:
        if not _registered or op in _kernels:
            return
        kernel = _lowered_kernel(op, registry.get(op), via_functional=False)
        _kernels[op] = kernel
        namespace, name = op._schema.name.split("::")
        _native.register_boxed(kernel, namespace, name + (f".{op._overloadname}" if op._overloadname != "default" else ""))


def _lowered_kernel(op, lowering, via_functional: bool):
    from torch_tpu.eager import executor

    return executor.kernel(spec(op, lowering.mutates, lowering.runtime), lowering, via_functional)


def _prepared(op, kernel):
    from torch_tpu.ops import registry

    prepare = registry.preparation(op)
    if prepare is None:
        return kernel
    if registry.prepared_only_on_miss(op):
        # The boxed kernel stays registered: a call its preparation would change never finds a
        # program (its hit path also refuses tensors with conjugate/negative bits), and its Python
        # path (`slow`) prepares first.
        execute = kernel.slow

        def slow(*args, **kwargs):
            args, kwargs = prepare(*args, **kwargs)
            return execute(*args, **kwargs)

        kernel.slow = slow
        return kernel

    def prepared(*args, **kwargs):
        args, kwargs = prepare(*args, **kwargs)
        return kernel(*args, **kwargs)

    return prepared


def _written_by(variant, functional):
    """The in-place/out= variant of a torch-level kernel: run it, then resize and copy into the written tensors."""
    s = spec(variant)

    def kernel(*args, **kwargs):
        full = s.normalize(args, kwargs)
        inputs = [a for i, a in enumerate(full) if not (s.is_out and i in s.writes)]
        result = functional(*inputs)
        results = result if isinstance(result, tuple) else (result,)
        for i, value in zip(s.writes, results):
            target = full[i]
            if s.is_out and target.dtype != value.dtype:
                _raise_cpu_out_error(s, full)
            if s.is_out and target.shape != value.shape:
                target.resize_(value.shape)
            target.copy_(value)
        written = [full[i] for i in s.writes]
        return written[0] if len(written) == 1 else tuple(written)

    return kernel


def _raise_cpu_out_error(s, full) -> None:
    """These ops' out= tensors must have the result's dtype (nonzero, masked_select, unique, bincount):
    raise PyTorch's own error for the call, made by its CPU kernel on host copies (an error path only)."""
    host = [a.cpu() if isinstance(a, torch.Tensor) else a for a in full]
    try:
        s.call(host)
    except RuntimeError as err:
        raise RuntimeError(str(err)) from None
    raise RuntimeError(f"{s.name}: the out= tensor's dtype differs from the result's")


def mutating_variants(op) -> list:
    """The in-place and out= overloads whose functional counterpart is `op`."""
    name = op._schema.name.split("::")[1]
    found = []
    for packet_name in (name + "_", name):
        packet = getattr(aten, packet_name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            candidate = getattr(packet, overload)
            if spec(candidate).writes and functional_counterpart(candidate) == op and not _has(candidate, "CompositeImplicitAutograd"):
                found.append(candidate)
    return found


def metadata_ops() -> list:
    """aten ops that only change tensor metadata and have CPU kernels: views and inplace views."""
    out = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        packet = getattr(aten, base, None)
        if packet is None:
            continue
        op = getattr(packet, overload or "default", None)
        if op is None:
            continue
        if torch.Tag.inplace_view in op.tags or (spec(op).is_view and not spec(op).writes):
            out.append(op)
    return out


def _redispatch_cpu(op, keys=_CPU):
    """`op`'s kernel for the CPU key `keys`, called on tpu tensors (device-generic kernels only)."""
    def kernel(*args, **kwargs):
        return op.redispatch(keys, *args, **kwargs)

    return kernel


# ------------------------------------------------------------------ fallback
_decomposing = threading.local()
_warned: set = set()


def _fallback(op, *args, **kwargs):
    from torch_tpu.runtime import platform

    platform.get()  # initialises the runtime and registers the kernels
    kernel = _kernels.get(op)
    if kernel is not None:
        return kernel(*args, **kwargs)
    s = spec(op)
    if s.is_view and _has(op, "CPU"):
        return op.redispatch(_CPU, *args, **kwargs)
    decomposition = _decomposition(op)
    if decomposition is not None:
        if computes_in_out_dtype(s) and kwargs.get("dtype") is None and "out" in kwargs:
            kwargs = {**kwargs, "dtype": kwargs["out"].dtype}  # as ATen's kernel (PyTorch's reference casts after)
        active = getattr(_decomposing, "ops", None)
        if active is None:
            active = _decomposing.ops = set()
        if op not in active:
            active.add(op)
            try:
                metrics.counts.decompositions += 1
                metrics.decomposed[str(op)] += 1
                if s.name in RESIZED_ONLY_TO_ANOTHER_NUMEL and kwargs.get("out") is not None:
                    return _into_out_as_it_is(decomposition, args, kwargs)
                return decomposition(*args, **kwargs)
            except cpu_errors.FOREIGN as err:  # PyTorch's CPU error for the same arguments, if it has one
                replacement = cpu_errors.as_cpu_error_of_call(op, args, kwargs, err)
                if replacement is err:
                    raise
                raise replacement from None
            finally:
                active.discard(op)
    return cpu_fallback(op, args, kwargs)


def _into_out_as_it_is(decomposition, args, kwargs):
    """A factory's out= (opspec.RESIZED_ONLY_TO_ANOTHER_NUMEL): the reference's result, written into
    `out` in out's own shape unless the numel differs (the reference would resize it)."""
    out = kwargs["out"]
    result = decomposition(*args, **{**kwargs, "out": torch.empty(0, dtype=out.dtype, device=out.device)})
    if result.numel() != out.numel():
        out.resize_(result.shape)
    return out.copy_(result.view(out.shape))


def _nested_composites() -> list:
    """aten ops PyTorch decomposes (CompositeImplicitAutograd) except on nested tensors, where its
    NestedTensorCPU kernel runs: on tpu the decomposition would be chosen over the fallback, and
    it reads a nested tensor's sizes (linear, matmul, chunk, narrow...)."""
    found = []
    for name in torch._C._dispatch_get_registrations_for_dispatch_key("NestedTensorCPU"):
        namespace, _, rest = name.partition("::")
        if namespace != "aten" or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            continue
        packet, _, overload = rest.partition(".")
        found.append(getattr(getattr(aten, packet), overload or "default"))
    return found


_NESTED_METADATA = (aten._nested_tensor_size.default, aten._nested_tensor_strides.default,
                    aten._nested_tensor_storage_offsets.default)
_NESTED_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.NestedTensorCPU)


def _nested_fallback(op, *args, **kwargs):
    from torch_tpu.runtime import platform

    platform.get()
    return cpu_fallback(op, args, kwargs, what="on nested tensors")


def _nested_components(nt, indices):
    """Components `indices` of strided nested tpu tensor `nt` as views of its storage (ATen's NestedTensor_unbind:
    the fallback's would be copies, and writes to them would not reach `nt`)."""
    storage = nt.untyped_storage()
    flat = torch.empty(0, dtype=nt.dtype, device=nt.device).set_(storage, 0, (storage.nbytes() // nt.element_size(),))
    sizes, strides = nt._nested_tensor_size(), nt._nested_tensor_strides()
    offsets = nt._nested_tensor_storage_offsets()
    return [flat.as_strided(sizes[i].tolist(), strides[i].tolist(), int(offsets[i])) for i in indices]


def _nested_unbind(nt, dim=0):
    if dim != 0:  # ATen refuses other dims itself
        return _nested_fallback(aten.unbind.int, nt, dim)
    return _nested_components(nt, range(nt.size(0)))


def _nested_select(nt, dim, index):
    if dim != 0:  # a nested view of the other dims: the fallback's copy
        return _nested_fallback(aten.select.int, nt, dim, index)
    count = nt.size(0)
    if not -count <= index < count:
        raise IndexError(f"index {index} is out of bounds for dimension 0 with size {count}")
    return _nested_components(nt, [index])[0]


def _decomposition(op):
    from torch._decomp import decomposition_table

    return decomposition_table.get(op)


def cpu_fallback(op, args, kwargs, what: str = ""):
    """Run `op` on the CPU with copies of its tpu arguments; write results back.

    `what` says which inputs the device has no kernel for ("on nested tensors"), if not all."""
    name = str(op)
    where = f"the 'tpu' device{' ' + what if what else ''}"
    if config.fallback == "error":
        raise NotImplementedError(
            f"The operator '{name}' is not implemented for {where} "
            f"({'PyTorch has no device-generic kernel for them' if what else 'no lowering and no decomposition'}), "
            "and TORCH_TPU_FALLBACK=error forbids running it on the CPU."
        )
    metrics.fallbacks[name] += 1
    if config.fallback == "warn" and (name, what) not in _warned:
        _warned.add((name, what))
        warnings.warn(
            f"The operator '{name}' is not lowered for {where}; running it on the CPU "
            "(slow: copies to and from the host). Set TORCH_TPU_FALLBACK=error to make this an error.",
            stacklevel=3,
        )
    device = target = None  # the first tpu tensor's device; a device argument's (where results go)
    originals = {}

    def to_cpu(x):
        nonlocal device, target
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            device = device or x.device
            c = _native.nested_to(x, _CPU_DEVICE) if x.is_nested else x.cpu()
            originals[id(c)] = x
            return c
        if isinstance(x, torch.Generator) and x.device.type == "tpu":
            return None
        if isinstance(x, torch.device):
            target = target or x
            return _CPU_DEVICE if x.type == "tpu" else x
        return x

    cpu_args, cpu_kwargs = pytree.tree_map(to_cpu, (args, kwargs))
    result = op(*cpu_args, **cpu_kwargs)
    s = spec(op)
    full = s.normalize(cpu_args, cpu_kwargs)
    for i in s.writes:
        for c in (full[i] if isinstance(full[i], (list, tuple)) else [full[i]]):
            if isinstance(c, torch.Tensor) and id(c) in originals:
                if c.is_nested:
                    _native.nested_copy_(originals[id(c)], c)
                else:
                    if originals[id(c)].shape != c.shape:  # the CPU kernel resized its out=
                        originals[id(c)].resize_(c.shape)
                    originals[id(c)].copy_(c)
    device = target or device or torch.device("tpu", torch.tpu.current_device())

    def back(x):
        if isinstance(x, torch.Tensor):
            if id(x) in originals:
                return originals[id(x)]
            if x.device == device:
                return x
            return _native.nested_to(x, device) if x.is_nested else x.to(device)
        return x

    return pytree.tree_map(back, result)
