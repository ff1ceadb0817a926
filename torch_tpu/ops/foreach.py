"""`_foreach_*` ops (what torch.optim uses on "tpu"), derived from the elementwise table.

`_foreach_X.<overload>` applies the lowering of `X` to each list element
(scalars and single tensors broadcast across the list), promoting each
element by PyTorch's rules, all inside one program.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
from torch._prims_common import elementwise_dtypes

from torch_tpu.ops import reduction, registry
from torch_tpu.ops.registry import aten, lowers
from torch_tpu.runtime import dtypes

# Which overload of X serves each overload of _foreach_X (first that exists).
_BASE_OVERLOADS = {
    "List": ("Tensor", "default", "Tensor_Tensor"),
    "Scalar": ("Scalar", "Tensor", "default", "Tensor_Scalar"),
    "ScalarList": ("Scalar", "Tensor", "default", "Tensor_Scalar"),
    "Tensor": ("Tensor", "default"),
    "ScalarAndTensor": ("Scalar",),
    "default": ("default",),
}
# Overloads we do not derive: per-element scalars given as a 1-D CPU tensor.
_SKIP = {"_foreach_addcmul.Tensor", "_foreach_addcdiv.Tensor"}


def _meta_like(value):
    """A stand-in with the dtype and dimensionality category PyTorch promotes on."""
    if isinstance(value, (bool, int, float, complex)):
        return value
    dtype = jnp.asarray(value).dtype
    if getattr(value, "weak_type", False):  # a runtime Python scalar
        return {"b": False, "i": 0, "u": 0, "f": 0.0, "c": 0j}[dtype.kind]
    return torch.empty((0,) * jnp.ndim(value), dtype=dtypes.to_torch(dtype), device="meta")


def _apply(base: registry.Lowering, args: list):
    """The base lowering on one element's arguments, promoted like the op itself would."""
    if base.promote is not None:
        names = base.op._schema.arguments
        participants = [
            _meta_like(a) for a, arg in zip(args, names)
            if a is not None and (base.promote_args is None or arg.name in base.promote_args)
            and str(arg.type) in ("Tensor", "Optional[Tensor]", "number", "Optional[number]")
        ]
        compute, _ = elementwise_dtypes(*participants, type_promotion_kind=base.promote.value)
        jdtype = dtypes.to_jax(compute)
        args = [
            jnp.asarray(a).astype(jdtype)
            if a is not None and (base.promote_args is None or arg.name in base.promote_args)
            and str(arg.type) in ("Tensor", "Optional[Tensor]", "number", "Optional[number]")
            else a
            for a, arg in zip(args, names)
        ]
    return base.fn(*args)


def _flat_shape(element_args) -> tuple | None:
    """The one shape (at least 1-D) of every array among one element's arguments, else None."""
    shapes = {tuple(a.shape) for a in element_args if hasattr(a, "shape") and not getattr(a, "weak_type", False)}
    if len(shapes) != 1:
        return None
    (shape,) = shapes
    return shape if len(shape) >= 1 else None


def _apply_flat(base: registry.Lowering, args: list):
    """`_apply` on 1-D views of equal-shaped elements, results back in that shape.

    NOTE(xla-cpu): an optimizer step updates each weight matrix and its moments in place
    (donated buffers) with several foreach ops. Done in the matrices' N-d shape over flat
    storage buffers, XLA:CPU copied every such donated input first and every result again
    (38 copies in the demo GPT's fused AdamW step); on 1-D values it updates them in place.
    The values are the same: the op is elementwise.
    """
    shape = _flat_shape(args)
    if shape is None or len(shape) == 1:
        return _apply(base, args)
    flat = [a.reshape(-1) if hasattr(a, "shape") and tuple(a.shape) == shape else a for a in args]
    result = _apply(base, flat)
    if isinstance(result, (list, tuple)):
        return type(result)(r.reshape(shape) for r in result)
    return result.reshape(shape)


def _derive(foreach_op, base: registry.Lowering):
    apply = _apply_flat if torch.Tag.pointwise in base.op.tags else _apply

    def lowering(*args):
        n = next(len(a) for a in args if isinstance(a, list))
        return [apply(base, [a[i] if isinstance(a, list) else a for a in args]) for i in range(n)]

    registry.register(foreach_op, lowering, precision=base.precision)


def _register_all():
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::_foreach_") or name.split(".")[0].endswith("_") or name[6:] in _SKIP:
            continue
        packet_name, _, overload = name[len("aten::"):].partition(".")
        overload = overload or "default"
        op = getattr(getattr(aten, packet_name), overload)
        if registry.get(op) is not None or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            continue
        base_packet = getattr(aten, packet_name[len("_foreach_"):], None)
        if base_packet is None:
            continue
        for candidate in _BASE_OVERLOADS.get(overload, ()):
            base = registry.get(getattr(base_packet, candidate, None)) if candidate in base_packet.overloads() else None
            if base is not None and not base.rng:
                _derive(op, base)
                break


@lowers(aten._foreach_norm.Scalar, static_scalars=True)
def foreach_norm(tensors, ord=2, dtype=None):
    return [reduction.linalg_vector_norm(t, ord, None, False, dtype) for t in tensors]


@lowers(aten._foreach_zero.default)
def foreach_zero(tensors):
    return [jnp.zeros_like(t) for t in tensors]


@lowers(aten._foreach_copy.default)
def foreach_copy(tensors, src, non_blocking=False):
    return [jnp.broadcast_to(s.astype(t.dtype), t.shape) for t, s in zip(tensors, src)]


_register_all()
