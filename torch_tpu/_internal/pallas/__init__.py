"""`torch_tpu._internal.pallas`: the face the TorchTPU vLLM plugin imports.

`jax_op(name, fn, donate_argnums=..., mesh=..., input_partition_specs=...,
output_partition_specs=...)` is `torch_tpu.pallas.jax_op` with the wheel's
keywords: with a `mesh` the function runs under `jax.shard_map` over it.
`custom_jax_kernel` is its deprecated predecessor (static arguments by
position). Donation is accepted and checked; arguments stay valid afterwards
(PyTorch owns tpu storages: the kernel's results are fresh buffers).
"""
from __future__ import annotations

import functools
import inspect
import warnings

from torch_tpu.pallas import op as _op
from torch_tpu.pallas import get_pallas_mesh  # noqa: F401  (re-exported)

__all__ = ["jax_op", "custom_jax_kernel", "get_pallas_mesh"]


def _check_donation(name: str, params, donate_argnums):
    if donate_argnums is None:
        return ()
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    arrays = [i for i, p in enumerate(params) if p.type.startswith("Tensor")]
    for i in donate:
        if not isinstance(i, int) or i not in arrays:
            raise ValueError(f"{name}: donate_argnums={donate_argnums!r}: argument {i} is not an array argument "
                             f"(array arguments: {arrays})")
    return donate


def _sharded(fn, params, mesh, input_partition_specs, output_partition_specs):
    """fn under jax.shard_map over `mesh`, static arguments closed over."""
    import jax
    from jax.sharding import PartitionSpec

    arrays = [i for i, p in enumerate(params) if p.type.startswith("Tensor")]
    in_specs = tuple(input_partition_specs) if input_partition_specs is not None else (PartitionSpec(),) * len(arrays)
    if len(in_specs) != len(arrays):
        raise ValueError(f"input_partition_specs has {len(in_specs)} entries for {len(arrays)} array arguments")
    out_specs = output_partition_specs if output_partition_specs is not None else PartitionSpec()

    def call(*args):
        positional = [a for a, p in zip(args, params) if not p.kw_only]
        keywords = {p.name: a for a, p in zip(args, params) if p.kw_only}
        slots = [i for i, p in enumerate(params) if not p.kw_only]

        def inner(*array_values):
            pos, kw = list(positional), dict(keywords)
            for i, v in zip(arrays, array_values):
                if params[i].kw_only:
                    kw[params[i].name] = v
                else:
                    pos[slots.index(i)] = v
            return fn(*pos, **kw)

        return jax.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*(args[i] for i in arrays))

    return call


def jax_op(name: str, fn=None, /, *, donate_argnums=None, mesh=None, input_partition_specs=None,
           output_partition_specs=None, vjp: bool = False, backward=None):
    """`torch_tpu.pallas.jax_op` with the TorchTPU wheel's keywords (usable as a decorator)."""
    if fn is None:
        return functools.partial(jax_op, name, donate_argnums=donate_argnums, mesh=mesh,
                                 input_partition_specs=input_partition_specs,
                                 output_partition_specs=output_partition_specs, vjp=vjp, backward=backward)
    params, returns = _op._signature(fn, set())
    _check_donation(name, params, donate_argnums)
    trace = None
    if mesh is not None:
        sharded = _sharded(fn, params, mesh, input_partition_specs, output_partition_specs)

        def trace(*args):
            from torch_tpu.pallas import interpret

            with interpret.interpreting(name):
                return sharded(*args)
    elif input_partition_specs is not None or output_partition_specs is not None:
        raise ValueError(f"{name}: partition specs need a mesh (see get_pallas_mesh)")
    made = _op.JaxOp(name, fn, vjp=vjp, backward=backward, _params=params, _returns=returns, _trace_fn=trace)
    if trace is not None:  # called like the function itself
        made._call_signature = inspect.signature(fn)
    return made


class _CustomJaxKernel:
    """What `custom_jax_kernel` returns: one operator per kind of static arguments, made on first call."""

    def __init__(self, fn, name, static_argnums, donate_argnums):
        self.fn, self.name = fn, name
        self.static_argnums = frozenset((static_argnums,) if isinstance(static_argnums, int) else static_argnums)
        self.donate_argnums = donate_argnums
        self.ops: dict = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        import torch

        kinds = []
        for i, a in enumerate(args):
            if i not in self.static_argnums:
                if isinstance(a, torch.Tensor) or a is None:
                    kinds.append("Tensor?" if a is None else "Tensor")
                elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
                    kinds.append("Tensor[]")
                else:
                    raise TypeError(f"{self.name}: argument {i} is a {type(a).__name__}, not a tensor; "
                                    "list it in static_argnums")
            else:
                kinds.append(_op._schema_type(f"arg{i}", inspect.Parameter.empty, a))
        key = tuple(kinds)
        made = self.ops.get(key)
        if made is None:
            params = [_op._Param(f"arg{i}", k, inspect.Parameter.empty, False) for i, k in enumerate(kinds)]
            _check_donation(self.name, params, self.donate_argnums)
            fn = self.fn

            def trace(*values):
                from torch_tpu.pallas import interpret

                with interpret.interpreting(self.name):
                    return fn(*(tuple(v) if isinstance(v, list) and params[i].type.endswith("[]")
                                and not params[i].type.startswith("Tensor") else v for i, v in enumerate(values)))

            suffix = "" if not self.ops else f"_{len(self.ops)}"
            made = self.ops[key] = _op.JaxOp(self.name + suffix, fn, _params=params, _returns=None, _trace_fn=trace)
        return made(*(list(a) if isinstance(a, tuple) else a for a in args))


def custom_jax_kernel(fn=None, /, *, name: str | None = None, static_argnums=(), donate_argnums=None):
    """Deprecated (use `jax_op`): bind `fn` as a PyTorch operator; `static_argnums` name its static arguments.

    Wraps library kernels whose parameters carry no annotations, e.g.
    `custom_jax_kernel(tokamax.ragged_dot)` or `custom_jax_kernel(functools.partial(f, k=2))`.
    """
    warnings.warn("torch_tpu._internal.pallas.custom_jax_kernel is deprecated; use torch.tpu.pallas.jax_op",
                  DeprecationWarning, stacklevel=2)
    if fn is None:
        return functools.partial(custom_jax_kernel, name=name, static_argnums=static_argnums,
                                 donate_argnums=donate_argnums)
    if name is None:
        base = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "kernel")
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in base).strip("_") or "kernel"
        name = f"custom_jax_kernel::{base}_{id(fn):x}"
    return _CustomJaxKernel(fn, name, static_argnums, donate_argnums)
