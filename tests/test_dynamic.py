"""Value-dependent result shapes: nonzero, masked_select, unique, boolean-mask indexing, bincount, repeat_interleave."""

import pytest
import torch

from conftest import assert_matches_cpu, no_fallback
from torch_tpu import metrics


def _data():
    torch.manual_seed(0)
    x = torch.randn(6, 7)
    x[x.abs() < 0.3] = 0
    return x


@pytest.mark.parametrize("fn", [
    torch.nonzero,
    lambda x: torch.nonzero(x, as_tuple=True),
    torch.argwhere,
    lambda x: torch.where(x > 0),
    lambda x: torch.masked_select(x, x > 0),
    lambda x: torch.masked_select(x, torch.tensor([True, False, True, True, False, False, True], device=x.device)),
    lambda x: x[x > 0.5],
    lambda x: x[:, x[0] > 0],
    lambda x: x[x[:, 0] > 0, 1:],
    lambda x: torch.unique(x),
    lambda x: torch.unique(x.round(), return_inverse=True, return_counts=True),
    lambda x: torch.unique((x > 0).int(), dim=0, return_inverse=True, return_counts=True),
    lambda x: torch.unique(x.round(), dim=1),
    lambda x: torch.unique_consecutive(x.round().flatten(), return_inverse=True, return_counts=True),
    lambda x: torch.unique_consecutive((x > 0).int(), dim=0),
    lambda x: torch.bincount((x.abs() * 3).long().flatten()),
    lambda x: torch.bincount((x.abs() * 3).long().flatten(), weights=x.flatten(), minlength=20),
    lambda x: torch.repeat_interleave((x.abs() * 2).long()[0]),
    lambda x: torch.repeat_interleave(x[:3], (x.abs() * 2).long()[0, :3], dim=0),
], ids=["nonzero", "nonzero_tuple", "argwhere", "where1", "masked_select", "masked_select_broadcast",
        "mask_index", "mask_index_dim1", "mask_then_slice", "unique", "unique_inverse_counts", "unique_dim0",
        "unique_dim1", "unique_consecutive", "unique_consecutive_dim", "bincount", "bincount_weights",
        "repeat_interleave", "repeat_interleave_dim"])
def test_matches_cpu_without_fallback(fn):
    """Each dynamic op gives PyTorch's CPU result on tpu, with no CPU fallback."""
    with no_fallback():
        assert_matches_cpu(fn, _data())


def test_one_synchronisation_per_dynamic_op():
    """masked_select reads one size from the device (a single materialization), then runs a static program."""
    x = torch.randn(64, device="tpu")
    mask = x > 0
    before = metrics.counts.materializations
    torch.masked_select(x, mask)
    assert metrics.counts.materializations == before + 1


def test_mask_assignment_of_a_scalar_needs_no_synchronisation():
    """`x[mask] = value` is a select: no size is read from the device."""
    x = _data()
    t = x.to("tpu")
    before = metrics.counts.materializations
    with no_fallback():
        t[t > 0] = 1.5
        t.index_put_((t < 0,), torch.tensor(2.0, device="tpu"), accumulate=True)
    assert metrics.counts.materializations == before
    x[x > 0] = 1.5
    x.index_put_((x < 0,), torch.tensor(2.0), accumulate=True)
    torch.testing.assert_close(t.cpu(), x)
    with no_fallback():  # `x[mask] += v` reads x[mask] first: that one synchronises, like on CUDA
        t[t > 1] += 1.0
    x[x > 1] += 1.0
    torch.testing.assert_close(t.cpu(), x)


def test_mask_assignment_of_values_matches_cpu():
    """`x[mask] = tensor` (one value per selected element) goes through nonzero."""
    x = _data()
    t = x.to("tpu")
    values = torch.arange(float((x > 0).sum()))
    x[x > 0] = values
    with no_fallback():
        t[t > 0] = values.to("tpu")
    torch.testing.assert_close(t.cpu(), x)


def test_same_size_reuses_the_static_program():
    """The static-size program is cached by size: a second call with the same count compiles nothing."""
    a = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0], device="tpu")
    b = torch.tensor([0.0, 5.0, 6.0, 7.0, 0.0], device="tpu")
    c = torch.tensor([0.0, 0.0, 6.0, 7.0, 8.0], device="tpu")
    # Two warm-up calls: DeferAndFuse's fused count graph may donate its input on the first (a fresh value).
    torch.nonzero(a).cpu()
    torch.nonzero(b).cpu()
    compiled = metrics.counts.programs_compiled
    torch.nonzero(c).cpu()
    assert metrics.counts.programs_compiled == compiled


def test_cpu_index_tensors_are_accepted():
    """Like CUDA, tpu tensors take CPU index tensors (and CPU boolean masks) in indexing."""
    x = _data()
    index = torch.tensor([0, 3, 5])
    mask = torch.tensor([True, False, True, False, False, True])
    t = x.to("tpu")
    with no_fallback():
        torch.testing.assert_close(t[index].cpu(), x[index])
        torch.testing.assert_close(t[mask].cpu(), x[mask])
        t[index] = 0.0
    x[index] = 0.0
    torch.testing.assert_close(t.cpu(), x)


def test_print_does_not_fall_back():
    """print(tensor) (masked_select under the hood) runs natively."""
    t = _data().to("tpu")
    with no_fallback():
        text = str(t)
    assert "device='tpu:0'" in text


def test_out_variants_resize():
    """out= variants of dynamic ops resize the out tensor to the value-dependent size."""
    x = _data()
    t = x.to("tpu")
    out = torch.empty(0, device="tpu")
    with no_fallback():
        returned = torch.masked_select(t, t > 0, out=out)
        index_out = torch.empty(0, dtype=torch.long, device="tpu")
        torch.nonzero(t, out=index_out)
    assert returned is out
    torch.testing.assert_close(out.cpu(), torch.masked_select(x, x > 0))
    torch.testing.assert_close(index_out.cpu(), torch.nonzero(x))


def test_equal():
    """torch.equal compares shapes and values on the device and returns a Python bool."""
    a = torch.tensor([1.0, 2.0, float("nan")])
    t = a.to("tpu")
    with no_fallback():
        assert torch.equal(t[:2], a[:2].to("tpu"))
        assert not torch.equal(t, t)  # NaN != NaN, like PyTorch
        assert not torch.equal(t[:2], t[1:])
        assert not torch.equal(t, t[:2])


def test_bincount_rejects_negative_values():
    """bincount raises PyTorch's error for negative inputs."""
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(torch.tensor([1, -1], device="tpu"))
