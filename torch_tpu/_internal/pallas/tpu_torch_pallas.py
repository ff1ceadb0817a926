"""The module torch 2.13's Inductor Pallas code generator imports for device "tpu".

Generated code (torch/_inductor/codegen/pallas.py) exports each kernel with
`jax.export`, then calls:

    register_custom_kernel(name, key, serialized_mlir_module=exported.mlir_module_serialized)
    lookup_custom_kernel(name, key) -> bool
    call_custom_kernel(name, key, inputs=[tpu tensors], output_shapes=[tpu tensors], donate_argnums=[...])
        (older keyword: input_output_aliases={input index: output index}) -> [fresh tpu tensors]

A registered module is run through the same path as `jax_op`: one operator per
kernel and argument layout, whose lowering inlines the StableHLO module into the
op's program (`jax.export.Exported.call`), so its inputs are read from their
storage buffers inside that program (no host copy) and it joins DeferAndFuse's
fused programs. Donation is accepted and checked: the kernel's results are fresh
buffers and the donated tensors keep their values (Inductor copies results into
the aliased tensors afterwards, which is what it needs).

Owns: the (name, key) -> module registry and turning a module into an operator.
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading

import torch

from torch_tpu.pallas import op as _op

__all__ = ["register_custom_kernel", "lookup_custom_kernel", "call_custom_kernel"]

_lock = threading.Lock()
_modules: dict[tuple[str, str], bytes] = {}
_ops: dict[tuple, _op.JaxOp] = {}


def _restore_x64() -> None:
    """NOTE(torch 2.13): Inductor's generated code for device "tpu" sets `jax_enable_x64` to False for the
    whole process before exporting its kernel (TPUs run int32); torch_tpu's programs need 64-bit types
    (int64 indices, float64 tensors), so it is turned back on before any of our programs runs."""
    import jax

    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def register_custom_kernel(name: str, key: str, serialized_mlir_module: bytes | None = None, *args) -> None:
    """Register a serialized StableHLO module (`jax.export.Exported.mlir_module_serialized`) as (name, key)."""
    _restore_x64()
    if serialized_mlir_module is None and args:
        serialized_mlir_module = args[0]
    if not isinstance(serialized_mlir_module, (bytes, bytearray)):
        raise TypeError(f"register_custom_kernel({name!r}, {key!r}): serialized_mlir_module must be bytes "
                        f"(jax.export's mlir_module_serialized), got {type(serialized_mlir_module).__name__}")
    with _lock:
        previous = _modules.get((name, key))
        if previous is not None and previous != bytes(serialized_mlir_module):
            raise RuntimeError(f"register_custom_kernel: a different module is already registered as ({name!r}, {key!r})")
        _modules[(name, key)] = bytes(serialized_mlir_module)


def lookup_custom_kernel(name: str, key: str) -> bool:
    """Whether (name, key) has a registered module."""
    return (name, key) in _modules


def _donated(name, n_inputs, donate_argnums, input_output_aliases) -> tuple[int, ...]:
    if donate_argnums is not None and input_output_aliases:
        raise TypeError(f"call_custom_kernel({name!r}): give donate_argnums or input_output_aliases, not both")
    donated = list(donate_argnums or ()) + list((input_output_aliases or {}).keys())
    for i in donated:
        if not isinstance(i, int) or not 0 <= i < n_inputs:
            raise ValueError(f"call_custom_kernel({name!r}): donated input index {i} is out of range for "
                             f"{n_inputs} inputs")
    return tuple(donated)


def call_custom_kernel(name: str, key: str, inputs=(), output_shapes=(), donate_argnums=None,
                       input_output_aliases=None) -> list[torch.Tensor]:
    """Run the module registered as (name, key) on tpu tensors; one fresh tensor per entry of `output_shapes`.

    `output_shapes` are tensors (or (shape, dtype) pairs) whose shapes and dtypes the results take.
    """
    _restore_x64()
    module = _modules.get((name, key))
    if module is None:
        raise KeyError(f"call_custom_kernel: no kernel registered as ({name!r}, {key!r}); "
                       "call register_custom_kernel first")
    _check_platform(name, module)
    inputs = list(inputs)
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"call_custom_kernel({name!r}): input {i} is a {type(t).__name__}, not a tensor")
    _donated(name, len(inputs), donate_argnums, input_output_aliases)
    outs = tuple((tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else (tuple(o[0]), o[1])
                 for o in output_shapes)
    layout = (name, key, tuple((tuple(t.shape), t.dtype) for t in inputs), outs)
    made = _ops.get(layout)
    if made is None:
        with _lock:
            made = _ops.get(layout)
            if made is None:
                made = _ops[layout] = _operator(name, module, layout)
    return list(made.op(inputs))


def _check_platform(name: str, module: bytes) -> None:
    """Mosaic kernels (TPU custom calls) run on a TPU only: say so instead of XLA's missing-handler error."""
    from torch_tpu.runtime import platform

    current = platform.get().platform
    if current != "tpu" and b"tpu_custom_call" in module:
        raise RuntimeError(
            f"call_custom_kernel({name!r}): the kernel is a compiled Mosaic TPU kernel (Inductor's Pallas code for "
            f"device 'tpu'), which runs only on a TPU; the 'tpu' device runs on the {current!r} platform here. "
            "Use torch.compile(backend='tpu') on this platform.")


def _operator(name: str, module: bytes, layout) -> _op.JaxOp:
    """One operator for one registered module and argument layout: its lowering inlines the module."""
    import inspect

    import jax

    from torch_tpu.runtime import dtypes

    out_avals = [jax.ShapeDtypeStruct(shape, dtypes.to_jax(dtype)) for shape, dtype in layout[3]]
    exported = {}

    def call(arrays):
        in_avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
        found = exported.get(in_avals)
        if found is None:
            # NOTE(jax 0.10): an Exported is a public dataclass; we take the calling convention, tree and
            # shardings of a stand-in with the same signature and swap in the registered module.
            stand_in = jax.export.export(jax.jit(lambda *xs: [jax.numpy.zeros(o.shape, o.dtype) for o in out_avals]))(
                *in_avals)
            found = exported[in_avals] = dataclasses.replace(
                stand_in, mlir_module_serialized=module, fun_name=name,
                module_kept_var_idx=tuple(range(len(in_avals))))
        return list(found.call(*arrays))

    digest = hashlib.sha1(repr(layout).encode() + module).hexdigest()[:16]
    params = [_op._Param("inputs", _op._ARRAY_LIST, inspect.Parameter.empty, False)]
    return _op.JaxOp(f"tpu_torch_pallas::kernel_{digest}", call, _params=params, _returns=None, _trace_fn=call)
