"""The lowering registry's tables (pure Python: no device needed)."""
import pytest
import torch

from torch_tpu.ops import registry

aten = torch.ops.aten


def test_kernel_and_prepare_register_once():
    """registry.kernel / registry.prepare accept an op once; a second registration is an error."""
    table = {}
    registry._add_once(table, [aten.nonzero.default], lambda x: x)
    with pytest.raises(RuntimeError, match="already registered"):
        registry._add_once(table, [aten.nonzero.default], lambda x: x)
    with pytest.raises(TypeError, match="OpOverloads"):
        registry._add_once(table, [aten.nonzero], lambda x: x)


def test_dynamic_ops_are_kernels_and_mask_indexing_is_prepared():
    """nonzero/masked_select/unique are torch-level kernels; index/index_put get a preparation."""
    from torch_tpu.ops import load_all

    load_all()
    kernels = registry.kernels()
    for op in (aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.equal.default):
        assert op in kernels
    for op in (aten.index.Tensor, aten.index_put_.default, aten.mm.default, aten.clone.default):
        assert registry.preparation(op) is not None
    assert registry.preparation(aten.add.Tensor) is None


def test_composite_implicit_ops_are_refused():
    """An op PyTorch decomposes before dispatch cannot be registered."""
    with pytest.raises(RuntimeError, match="CompositeImplicitAutograd"):
        registry.register(aten.linalg_eigvals.default, lambda a: a)
