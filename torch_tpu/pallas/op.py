"""`jax_op`: a function of JAX arrays (typically a `pl.pallas_call`) as a PyTorch operator.

The function becomes `torch.ops.<namespace>.<name>`, defined with `torch.library`:
- its schema is read from the function's signature (array parameters are tensors,
  `int`/`float`/`bool`/`str` and their sequences are static arguments, part of the
  compile key);
- its fake (meta) implementation comes from `jax.eval_shape`, so PyTorch's fake
  tensors, torch.compile and the executors' meta runs know its output shapes;
- its tpu kernel is an entry of the one lowering table (ops/registry.py): the
  executors read its tensor arguments from their storage buffers inside the op's
  program (strided views included: no host copy, no separate copy program), so in
  Strict mode it is one cached program and under DeferAndFuse it is traced into
  the fused program like any ATen op;
- autograd is opt-in: `vjp=True` differentiates the function with `jax.vjp`,
  `backward=` takes a JAX function; either becomes a second operator,
  `<namespace>::<name>_backward`, run the same way.

Owns: schema inference, the fake implementation, the op's registrations and its
backward. Does not own: how programs are traced and run (eager/), or the Pallas
interpret-mode decision (pallas/interpret.py).
"""
from __future__ import annotations

import collections.abc
import inspect
import math
import threading
import typing
from typing import Any, Callable

import torch

_ARRAY, _OPT_ARRAY, _ARRAY_LIST = "Tensor", "Tensor?", "Tensor[]"
_STATIC = {int: "int", float: "float", bool: "bool", str: "str"}
_lock = threading.Lock()
_defined: dict[str, "JaxOp"] = {}


class _Param(typing.NamedTuple):
    name: str
    type: str  # schema type
    default: Any  # inspect.Parameter.empty when required
    kw_only: bool


def _is_array_type(ann) -> bool:
    import jax

    if ann is jax.Array:
        return True
    return isinstance(ann, str) and ann.split(".")[-1] in ("Array", "ArrayLike")


def _schema_type(name: str, ann, default) -> str:
    """The schema type of one parameter, from its annotation (else its default; else an array)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is inspect.Parameter.empty:
        if default is inspect.Parameter.empty:
            return _ARRAY
        if default is None:
            return _OPT_ARRAY
        if type(default) in _STATIC:
            return _STATIC[type(default)]
        if isinstance(default, (tuple, list)) and default and type(default[0]) in (int, float, bool):
            return _STATIC[type(default[0])] + "[]"
        raise TypeError(f"jax_op: cannot tell the type of parameter '{name}' from its default {default!r}; "
                        "annotate it (jax.Array, int, float, bool, str or a sequence of those)")
    if _is_array_type(ann):
        return _ARRAY
    if ann in _STATIC:
        return _STATIC[ann]
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = _schema_type(name, rest[0], inspect.Parameter.empty)
            if not inner.endswith("?"):
                return inner + "?"
    if origin in (list, tuple, collections.abc.Sequence):
        element = args[0] if args else None
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis) and len(set(args)) != 1:
            element = None
        if element is not None and _is_array_type(element):
            return _ARRAY_LIST
        if element in (int, float, bool):
            return _STATIC[element] + "[]"
    raise TypeError(f"jax_op: parameter '{name}' has an unsupported annotation {ann!r}: use jax.Array, "
                    "Optional[jax.Array], Sequence[jax.Array], int, float, bool, str or a sequence of int/float/bool")


def _return_kind(ann) -> int | None:
    """1 for one array, n for a fixed tuple of n arrays, None for any pytree (returned as Tensor[])."""
    if _is_array_type(ann):
        return 1
    if typing.get_origin(ann) is tuple:
        args = typing.get_args(ann)
        if args and Ellipsis not in args and all(_is_array_type(a) for a in args):
            return len(args)
    return None


def _default_literal(value) -> str | None:
    if value is None:
        return "None"
    if type(value) is bool:
        return "True" if value else "False"
    if type(value) in (int, float) and math.isfinite(value):
        return repr(value)
    if type(value) is str and all(c.isalnum() or c in "_-. " for c in value):
        return f'"{value}"'
    if isinstance(value, (tuple, list)) and all(type(v) in (int, bool) for v in value):
        return "[" + ", ".join(str(int(v)) if type(v) is int else ("True" if v else "False") for v in value) + "]"
    return None


def _signature(fn: Callable, static_argnames) -> tuple[list[_Param], int | None]:
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable string annotations: fall back to the raw ones
        hints = {}
    params = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"jax_op: *{p.name} / **{p.name} parameters are not supported; name every argument")
        ann = hints.get(p.name, p.annotation)
        kind = _schema_type(p.name, ann, p.default)
        if p.name in static_argnames and kind.startswith("Tensor"):
            kind = _schema_type(p.name, inspect.Parameter.empty, p.default) if p.default is not p.empty else "int"
        params.append(_Param(p.name, kind, p.default, p.kind == p.KEYWORD_ONLY))
    return params, _return_kind(hints.get("return", sig.return_annotation))


def _schema(params: list[_Param], returns: int | None) -> str:
    literals = [None if p.default is inspect.Parameter.empty else _default_literal(p.default) for p in params]
    # A positional parameter without a schema default ends the defaults before it (the wrapper still fills them).
    for i, p in enumerate(params):
        if not p.kw_only and literals[i] is None:
            for j in range(i):
                if not params[j].kw_only:
                    literals[j] = None
    parts, star = [], False
    for p, literal in zip(params, literals):
        if p.kw_only and not star:
            parts.append("*")
            star = True
        parts.append(f"{p.type} {p.name}" + (f"={literal}" if literal is not None else ""))
    out = "Tensor" if returns == 1 else "Tensor[]" if returns is None else "(" + ", ".join(["Tensor"] * returns) + ")"
    return f"({', '.join(parts)}) -> {out}"


def _jax_dtype(dtype: torch.dtype):
    from torch_tpu.runtime import dtypes

    return dtypes.to_jax(dtype)


def _concrete(name: str, sizes) -> tuple[int, ...]:
    out = []
    for s in sizes:
        if not isinstance(s, int):  # a SymInt (dynamic shapes): a kernel's shapes are static
            raise RuntimeError(f"{name}: jax_op needs static shapes, got a symbolic size {s}; "
                               "compile with dynamic=False or mark the dimension static")
        out.append(s)
    return tuple(out)


class JaxOp:
    """The PyTorch operator made from one JAX function (what `jax_op` returns); call it like the function."""

    def __init__(self, qualname: str, fn: Callable, *, vjp: bool = False, backward: Callable | None = None,
                 static_argnames=(), _params=None, _returns=None, _trace_fn=None):
        if not isinstance(qualname, str) or qualname.count("::") != 1 or not all(qualname.split("::")):
            raise ValueError(f"jax_op: the name must be 'namespace::name' with exactly one '::', got {qualname!r}")
        if vjp and backward is not None:
            raise ValueError("jax_op: give vjp=True or backward=, not both")
        self.qualname = qualname
        self.namespace, self.name = qualname.split("::")
        self.fn = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__name__ = getattr(fn, "__name__", self.name)
        if _params is None:
            _params, _returns = _signature(fn, set(static_argnames))
        self.params, self.returns = _params, _returns
        self._trace_fn = _trace_fn  # (schema args) -> pytree of arrays; default: call fn
        # How a call's arguments bind to the parameters (None: already in schema order).
        self._call_signature = inspect.signature(fn) if _trace_fn is None else None
        self._trees: dict = {}  # abstract signature -> (out treedef, out avals)
        self.schema = _schema(self.params, self.returns)
        with _lock:
            if qualname in _defined:
                raise RuntimeError(f"jax_op: an operator named {qualname!r} is already defined")
            self._register()
            _defined[qualname] = self
        self.backward_op = None
        if vjp or backward is not None:
            self._register_autograd(backward)

    # ------------------------------------------------------------------ the JAX side
    def call_jax(self, *args):
        """The function on JAX arrays and static values, given in schema order: a pytree of arrays."""
        if self._trace_fn is not None:
            return self._trace_fn(*args)
        positional = [a for a, p in zip(args, self.params) if not p.kw_only]
        keywords = {p.name: a for a, p in zip(args, self.params) if p.kw_only}
        from torch_tpu.pallas import interpret

        with interpret.interpreting(self.qualname):
            return self.fn(*positional, **keywords)

    def _flat(self, out) -> list:
        import jax

        leaves = jax.tree_util.tree_leaves(out)
        if self.returns is not None:
            if self.returns == 1 and not isinstance(out, (tuple, list)):
                leaves = [out]
            elif not isinstance(out, (tuple, list)) or len(out) != self.returns:
                raise TypeError(f"{self.qualname}: the function is annotated to return "
                                f"{self.returns} array(s), it returned {type(out).__name__}")
        for leaf in leaves:
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                raise TypeError(f"{self.qualname}: the function must return arrays (or a pytree of them), "
                                f"got a {type(leaf).__name__}")
        return leaves

    def lowering(self, *args):
        """The op's entry in the lowering table: schema-ordered JAX values -> the op's results."""
        leaves = self._flat(self.call_jax(*args))
        if self.returns == 1:
            return leaves[0]
        return tuple(leaves) if self.returns is not None else list(leaves)

    def abstract(self, *args):
        """(out treedef, [ShapeDtypeStruct]) for torch arguments (fake, meta or real), via jax.eval_shape."""
        import jax

        def spec(value, p):
            if isinstance(value, torch.Tensor):
                return jax.ShapeDtypeStruct(_concrete(self.qualname, value.shape), _jax_dtype(value.dtype))
            if isinstance(value, (list, tuple)) and p.type == _ARRAY_LIST:
                return [spec(v, p) for v in value]
            return value

        specs = [spec(a, p) for a, p in zip(args, self.params)]
        cache_key = repr(specs)
        found = self._trees.get(cache_key)
        if found is not None:
            return found
        arrays = [i for i, p in enumerate(self.params) if p.type.startswith("Tensor")]

        def run(*array_args):
            full = list(specs)
            for i, a in zip(arrays, array_args):
                full[i] = a
            return self.call_jax(*full)

        try:
            jaxpr, out = jax.make_jaxpr(run, return_shape=True)(*(specs[i] for i in arrays))
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError) as err:
            raise RuntimeError(
                f"{self.qualname}: the JAX function's output shape (or control flow) depends on the values of "
                "its inputs, which a compiled kernel cannot do; give it static sizes (e.g. jnp.nonzero(..., "
                f"size=n)) or pass such values as static int arguments. JAX said: {str(err).splitlines()[0]}"
            ) from None
        leaves = self._flat(out)
        from torch_tpu.pallas import interpret

        if interpret.uses_pallas(jaxpr):
            interpret.note(self.qualname)
        found = self._trees[cache_key] = (jax.tree_util.tree_structure(out), leaves)
        return found

    # ------------------------------------------------------------------ registration
    def _register(self):
        from torch_tpu.eager import kernels
        from torch_tpu.ops import registry
        from torch_tpu.runtime import dtypes

        self.library = torch.library.Library(self.namespace, "FRAGMENT")
        self.library.define(self.name + self.schema)
        self.op = getattr(getattr(torch.ops, self.namespace), self.name).default
        qualname = self.qualname

        def fake(*args, **kwargs):
            full = self._normalize(args, kwargs)
            device = next((t.device for t in _tensors(full)), torch.device("meta"))
            _, leaves = self.abstract(*full)
            outs = [torch.empty(leaf.shape, dtype=dtypes.to_torch(leaf.dtype), device=device) for leaf in leaves]
            return outs[0] if self.returns == 1 else tuple(outs) if self.returns is not None else outs

        torch.library.register_fake(qualname, fake, lib=self.library)

        def cpu(*args, **kwargs):
            raise RuntimeError(
                f"{qualname} is a jax_op: it runs on 'tpu' tensors, but every tensor argument is on the CPU; "
                "move them with .to('tpu')")

        self.library.impl(self.name, cpu, "CPU")
        registry.register(self.op, self.lowering)
        kernels.register_lowered(self.op)  # now if the runtime is up, else with every other kernel

    def _normalize(self, args, kwargs) -> list:
        full = list(args)
        for p in self.params[len(full):]:
            full.append(kwargs[p.name] if p.name in kwargs else p.default)
        return full

    # ------------------------------------------------------------------ autograd
    def _register_autograd(self, backward):
        params = self.params
        differentiable = [i for i, p in enumerate(params) if p.type == _ARRAY]
        forward = self

        def backward_jax(*args):
            import jax
            import jax.numpy as jnp

            primal, cts, mask = list(args[:-2]), list(args[-2]), args[-1]
            diff = [i for i, keep in zip(differentiable, mask) if keep]
            tree, avals = forward.abstract_from_arrays(primal)
            cts = jax.tree_util.tree_unflatten(tree, [c.astype(a.dtype) for c, a in zip(cts, avals)])
            if backward is not None:
                grads = backward(*primal, cts)
                grads = grads if isinstance(grads, (tuple, list)) else (grads,)
                n_arrays = len(differentiable)
                if len(grads) != n_arrays:
                    raise TypeError(f"{forward.qualname}: backward returned {len(grads)} gradients, expected one "
                                    f"per array argument ({n_arrays})")
                by_index = dict(zip(differentiable, grads))
                grads = [by_index[i] for i in diff]
            else:
                def f(*arrays):
                    full = list(primal)
                    for i, a in zip(diff, arrays):
                        full[i] = a
                    return forward.call_jax(*full)

                _, pullback = jax.vjp(f, *(primal[i] for i in diff))
                grads = pullback(cts)
            return [jnp.zeros(primal[i].shape, primal[i].dtype) if g is None else jnp.asarray(g).astype(primal[i].dtype)
                    for i, g in zip(diff, grads)]

        bwd_params = list(params) + [_Param("grads", _ARRAY_LIST, inspect.Parameter.empty, False),
                                     _Param("mask", "bool[]", inspect.Parameter.empty, False)]
        bwd_params = [p._replace(kw_only=False, default=inspect.Parameter.empty) for p in bwd_params]
        self.backward_op = JaxOp(self.qualname + "_backward", backward_jax, _params=bwd_params, _returns=None,
                                 _trace_fn=backward_jax)

        # NOTE(torch 2.13): torch.library.register_autograd rejects its own backward's structure for
        # operators returning Tensor[] (our pytree outputs), so the Autograd kernel is registered here.
        forward_op, backward_op = self.op, self.backward_op.op

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *full):
                with torch._C._AutoDispatchBelowAutograd():
                    out = forward_op(*forward._positional(full), **forward._keywords(full))
                outs = [out] if isinstance(out, torch.Tensor) else list(out)
                tensors = [full[i] for i in differentiable]
                ctx.save_for_backward(*[t for t in tensors if t is not None])
                ctx.present = [t is not None for t in tensors]
                ctx.others = [None if i in differentiable else a for i, a in enumerate(full)]
                ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
                ctx.mark_non_differentiable(*[o for o in outs if not o.dtype.is_floating_point])
                return tuple(outs)

            @staticmethod
            def backward(ctx, *grads):
                saved = iter(ctx.saved_tensors)
                tensors = [next(saved) if present else None for present in ctx.present]
                full = list(ctx.others)
                for i, t in zip(differentiable, tensors):
                    full[i] = t
                flat = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                        for g, (shape, dtype, device) in zip(grads, ctx.out_meta)]
                mask = [t is not None and t.dtype.is_floating_point and ctx.needs_input_grad[i]
                        for i, t in zip(differentiable, tensors)]
                results = [None] * len(full)
                if any(mask):
                    computed = iter(backward_op(*full, flat, mask))
                    for i, keep in zip(differentiable, mask):
                        if keep:
                            results[i] = next(computed)
                return tuple(results)

        def autograd_kernel(*args, **kwargs):
            outs = Function.apply(*forward._normalize(args, kwargs))
            return outs[0] if forward.returns == 1 else tuple(outs) if forward.returns is not None else list(outs)

        self.library.impl(self.name, autograd_kernel, "Autograd")

    def _positional(self, full):
        return [a for a, p in zip(full, self.params) if not p.kw_only]

    def _keywords(self, full):
        return {p.name: a for a, p in zip(full, self.params) if p.kw_only}

    def abstract_from_arrays(self, args):
        """`abstract` for JAX values (inside a trace)."""
        import jax

        def spec(value, p):
            if p.type.startswith("Tensor") and value is not None:
                if isinstance(value, (list, tuple)):
                    return [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in value]
                return jax.ShapeDtypeStruct(value.shape, value.dtype)
            return value

        specs = [spec(a, p) for a, p in zip(args, self.params)]
        arrays = [i for i, p in enumerate(self.params) if p.type.startswith("Tensor")]

        def run(*array_args):
            full = list(specs)
            for i, a in zip(arrays, array_args):
                full[i] = a
            return self.call_jax(*full)

        out = jax.eval_shape(run, *(specs[i] for i in arrays))
        return jax.tree_util.tree_structure(out), self._flat(out)

    # ------------------------------------------------------------------ calling
    def __call__(self, *args, **kwargs):
        bound = self._call_signature.bind(*args, **kwargs) if self._call_signature is not None else None
        if bound is not None:
            bound.apply_defaults()
            full = [bound.arguments[p.name] for p in self.params]
            full = [list(a) if isinstance(a, tuple) and p.type.endswith("[]") else a for a, p in zip(full, self.params)]
        else:
            full = list(args)
        positional = [a for a, p in zip(full, self.params) if not p.kw_only]
        keywords = {p.name: a for a, p in zip(full, self.params) if p.kw_only}
        result = self.op(*positional, **keywords)
        if self.returns is not None:
            return result
        tree, _ = self.abstract(*full)
        return _unflatten(tree, list(result))

    def __repr__(self):
        return f"jax_op({self.qualname!r}{self.schema})"


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


def _unflatten(tree, leaves):
    import jax

    return jax.tree_util.tree_unflatten(tree, leaves)


def jax_op(name: str, fn: Callable | None = None, /, *, vjp: bool = False, backward: Callable | None = None,
           static_argnames=()):
    """Bind a function of JAX arrays as the PyTorch operator `torch.ops.<namespace>.<name>`.

    Usable as `jax_op("ns::name", fn)` or as a decorator `@jax_op("ns::name")`. Returns a
    `JaxOp`: call it with tpu tensors (and the static arguments), get tpu tensors back in
    the function's output structure. See docs/kernels.md.
    """
    if fn is None:
        return lambda f: JaxOp(name, f, vjp=vjp, backward=backward, static_argnames=static_argnames)
    return JaxOp(name, fn, vjp=vjp, backward=backward, static_argnames=static_argnames)
