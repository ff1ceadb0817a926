"""Views: true strides, shared storage and aliasing, exactly as on CPU/CUDA."""
import pytest
import torch

from conftest import assert_close_tree

VIEWS = {
    "view": lambda t: t.view(4, 6),
    "reshape": lambda t: t.reshape(2, 12),
    "transpose": lambda t: t.transpose(0, 1),
    "permute": lambda t: t.permute(2, 0, 1),
    "t": lambda t: t[0].t(),
    "select": lambda t: t.select(1, 2),
    "slice": lambda t: t[:, 1:3],
    "step_slice": lambda t: t[:, ::2, 1::2],
    "index_int": lambda t: t[1],
    "narrow": lambda t: t.narrow(2, 1, 2),
    "expand": lambda t: t[:, :1].expand(2, 3, 4),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "squeeze": lambda t: t[:, :1].squeeze(1),
    "unfold": lambda t: t.reshape(-1).unfold(0, 5, 3),
    "as_strided": lambda t: t.as_strided((3, 3), (5, 2), 1),
    "diagonal": lambda t: t.diagonal(0, 1, 2),
    "view_dtype": lambda t: t.view(torch.int32),
    "flatten_view": lambda t: t.flatten(),
    "split": lambda t: t.split(1, dim=2)[2],
    "chunk": lambda t: t.chunk(2, dim=1)[1],
    "unbind": lambda t: t.unbind(0)[1],
    "movedim": lambda t: t.movedim(0, 2),
    "T_of_slice": lambda t: t[1, :, 1:].T,
}


def _base(device):
    return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(device)


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_metadata_and_values(name):
    """Each view has CPU's sizes, strides, offset, contiguity and values, and shares the base storage."""
    fn = VIEWS[name]
    cpu = fn(_base("cpu"))
    base = _base("tpu")
    view = fn(base)
    assert view.device.type == "tpu"
    assert view.shape == cpu.shape
    assert view.stride() == cpu.stride()
    assert view.storage_offset() == cpu.storage_offset()
    assert view.is_contiguous() == cpu.is_contiguous()
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert view._is_view() == cpu._is_view()
    assert_close_tree(view, cpu, 0, 0)


WRITABLE = [n for n in VIEWS if n not in ("expand", "as_strided", "unfold")]


@pytest.mark.parametrize("name", sorted(WRITABLE))
def test_inplace_on_view_updates_base(name):
    """An in-place op on a view changes the base, like CUDA."""
    fn = VIEWS[name]
    results = []
    for device in ("cpu", "tpu"):
        base = _base(device)
        view = fn(base)
        if view.dtype == torch.int32:
            view.add_(7)
        else:
            view.mul_(-2).add_(1)
        results.append((base, view))
    assert_close_tree(results[1], results[0], 0, 0)


@pytest.mark.parametrize("name", sorted(WRITABLE))
def test_base_update_visible_through_view(name):
    """Writing the base is seen through an existing view."""
    fn = VIEWS[name]
    results = []
    for device in ("cpu", "tpu"):
        base = _base(device)
        view = fn(base)
        base.add_(100)
        results.append(view)
    assert_close_tree(results[1], results[0], 0, 0)


def test_setitem_and_copy_into_views():
    """Indexing assignment and copy_ into strided views (scalars, tensors, broadcasts, cross-dtype)."""
    results = []
    for device in ("cpu", "tpu"):
        t = torch.zeros(4, 5, device=device)
        t[1] = 3
        t[:, 2] = torch.arange(4.0).to(device)
        t[2:, ::2] += 1
        t.t()[1].copy_(torch.tensor([9, 8, 7, 6], dtype=torch.int64))
        t[3, 4] = torch.tensor(-1.5)
        results.append(t)
    assert_close_tree(results[1], results[0], 0, 0)


def test_overlapping_inplace_same_storage():
    """x.add_(x) and ops whose operands share one storage read before they write."""
    results = []
    for device in ("cpu", "tpu"):
        x = torch.arange(6.0, device=device)
        x.add_(x)
        y = x.view(2, 3)
        y[0].mul_(y[1])
        results.append(x)
    assert_close_tree(results[1], results[0], 0, 0)


def test_view_chain_of_views_and_contiguous():
    """A view of a view of a view, then contiguous(), then in-place through the chain."""
    results = []
    for device in ("cpu", "tpu"):
        base = torch.arange(60.0, device=device).reshape(3, 4, 5)
        v = base.permute(2, 0, 1)[1:, :, ::2].transpose(0, 2)
        c = v.contiguous()
        assert c.is_contiguous()
        v.sub_(1000)
        results.append((base, c, v.stride()))
    assert_close_tree(results[1], results[0], 0, 0)


def test_detach_and_data_share_storage():
    """detach() and .data alias the same storage."""
    x = torch.ones(3, device="tpu", requires_grad=True)
    d = x.detach()
    d.add_(1)
    assert x.data_ptr() == d.data_ptr()
    assert x.cpu().tolist() == [2.0, 2.0, 2.0]
    x.data.mul_(3)
    assert d.tolist() == [6.0, 6.0, 6.0]


def test_out_variant_resizes():
    """out= writes into (and resizes) the given tensor, like CPU."""
    for device in ("cpu", "tpu"):
        out = torch.empty(0, device=device)
        torch.add(torch.ones(3, device=device), 2, out=out)
        assert out.shape == (3,)
        assert out.tolist() == [3.0, 3.0, 3.0]
    a = torch.ones(2, 2, device="tpu")
    out = torch.zeros(2, 2, device="tpu").t()
    torch.mul(a, 5, out=out)
    assert out.stride() == (1, 2) and out.cpu().tolist() == [[5.0, 5.0], [5.0, 5.0]]


def test_views_at_a_known_offset_read_and_write_like_a_runtime_offset():
    """strided.read/write with the offset a Python int (DeferAndFuse's constants: a slice of the buffer
    cut into blocks) and with the same offset as a runtime scalar (padded window) both give NumPy's strided view."""
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from torch_tpu.runtime import strided

    buf = jnp.arange(4 * 6 * 10, dtype=jnp.float32)
    cases = [  # (sizes, strides): column blocks, transposed blocks, every other element, heads of a projection
        ((4, 3), (60, 1)), ((3, 4), (1, 60)), ((4, 2, 5), (60, 10, 2)), ((2, 6, 4), (60, 10, 1)),
        ((4, 2, 6, 2), (60, 5, 10, 1)), ((4, 6), (60, 10)),
    ]
    for (sizes, strides), offset in itertools.product(cases, range(0, 60, 7)):
        extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
        if offset + extent > buf.shape[0]:
            continue
        # The oracle: NumPy's own strided view of the same buffer (byte strides).
        host = np.array(buf)
        view = np.lib.stride_tricks.as_strided(host[offset:], sizes, tuple(4 * s for s in strides))
        runtime = jax.jit(lambda b, o: strided.read(b, sizes, strides, o))(buf, jnp.int64(offset))
        np.testing.assert_array_equal(runtime, view)
        np.testing.assert_array_equal(strided.read(buf, sizes, strides, offset), view)
        value = -jnp.arange(np.prod(sizes), dtype=jnp.float32).reshape(sizes) - 1
        written = np.array(buf)
        np.lib.stride_tricks.as_strided(written[offset:], sizes, tuple(4 * s for s in strides))[...] = np.array(value)
        runtime = jax.jit(lambda b, v, o: strided.write(b, v, sizes, strides, o))(buf, value, jnp.int64(offset))
        np.testing.assert_array_equal(runtime, written)
        np.testing.assert_array_equal(strided.write(buf, value, sizes, strides, offset), written)
