"""Factory functions with device="tpu", and host/device copies, against CPU."""
import pytest
import torch

from conftest import assert_close_tree

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool]

FACTORIES = {
    "zeros": lambda d, dt: torch.zeros(2, 3, device=d, dtype=dt),
    "ones": lambda d, dt: torch.ones(5, device=d, dtype=dt),
    "full": lambda d, dt: torch.full((2, 2), 7, device=d, dtype=dt),
    "full_like": lambda d, dt: torch.full_like(torch.empty(3, device=d, dtype=dt), 1),
    "zeros_like": lambda d, dt: torch.zeros_like(torch.empty(3, 1, device=d, dtype=dt)),
    "eye": lambda d, dt: torch.eye(3, 4, device=d, dtype=dt),
    "tensor": lambda d, dt: torch.tensor([[1, 2], [3, 4]], device=d, dtype=dt),
    "empty_shape": lambda d, dt: tuple(torch.empty(2, 0, 3, device=d, dtype=dt).shape),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factories_match_cpu(name, dtype):
    """Each factory gives CPU's values and dtype on tpu."""
    expected = FACTORIES[name]("cpu", dtype)
    actual = FACTORIES[name]("tpu", dtype)
    if isinstance(actual, torch.Tensor):
        assert actual.device.type == "tpu"
    assert_close_tree(actual, expected, 0, 0)


@pytest.mark.parametrize("args", [(10,), (2, 9), (1, 2, 0.25), (-3, 3, 0.5), (5, 0, -1)])
def test_arange(args):
    """arange with int and float steps."""
    assert_close_tree(torch.arange(*args, device="tpu"), torch.arange(*args), 0, 0)


@pytest.mark.parametrize("args", [(0, 1, 5), (-2, 2, 1), (0, 10, 7), (3, -3, 4)])
def test_linspace(args):
    assert_close_tree(torch.linspace(*args, device="tpu"), torch.linspace(*args), 1e-6, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES + [torch.uint8, torch.int8, torch.int16, torch.complex64, torch.float64], ids=str)
def test_roundtrip_all_dtypes(dtype):
    """cpu -> tpu -> cpu keeps values for every supported dtype."""
    x = (torch.randn(4, 3) * 10).to(dtype)
    y = x.to("tpu")
    assert y.dtype == dtype and y.device.type == "tpu"
    assert torch.equal(y.cpu(), x)


def test_copy_casts_and_non_contiguous_sources():
    """Copies between devices with dtype casts and strided sources/destinations."""
    src = torch.randn(4, 6)
    t = src.t().to("tpu", dtype=torch.bfloat16)
    assert t.shape == (6, 4) and t.dtype == torch.bfloat16
    assert torch.equal(t.cpu(), src.t().to(torch.bfloat16))
    dst = torch.empty(6, 4, dtype=torch.float64)
    dst.copy_(t)
    assert torch.equal(dst, src.t().to(torch.bfloat16).double())
    back = torch.empty(3, 8, device="tpu")[:, ::2]
    back.copy_(src[:3, :4], non_blocking=True)
    assert torch.equal(back.cpu(), src[:3, :4])


@pytest.mark.parametrize("dtype, number", [(torch.float32, float("nan")), (torch.float64, 1e300), (torch.int32, 7),
                                           (torch.complex64, 1 + 2j), (torch.float32, True), (torch.bfloat16, 3)])
def test_copy_from_a_python_number_like_cpu(dtype, number):
    """`t.copy_(number)` (GradScaler's tests write `grad.copy_(torch.inf)`) fills t as CPU's copy_ does."""
    got = torch.zeros(2, 3, dtype=dtype, device="tpu")[:, ::2].copy_(number)
    want = torch.zeros(2, 3, dtype=dtype)[:, ::2].copy_(number)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


def test_device_to_device_copy():
    """tpu:i -> tpu:j copies land on j with the same values."""
    a = torch.arange(6.0, device="tpu:0").view(2, 3)
    b = a.t().to("tpu:2")
    assert b.device == torch.device("tpu:2")
    assert torch.equal(b.cpu(), torch.arange(6.0).view(2, 3).t())
    c = torch.zeros(3, 2, device="tpu:3")
    c.copy_(b)
    assert torch.equal(c.cpu(), b.cpu())


def test_item_tolist_bool_repr():
    """Materialization points: item, tolist, bool, print."""
    t = torch.tensor([1.5, 2.5], device="tpu")
    assert t[1].item() == 2.5
    assert t.tolist() == [1.5, 2.5]
    assert bool(t.sum() > 3)
    assert not bool(torch.tensor(0, device="tpu"))
    text = repr(t)
    assert "tensor([1.5000, 2.5000], device='tpu:0')" == text
    assert "device='tpu:0'" in str(torch.ones(2, 2, dtype=torch.int64, device="tpu"))


def test_uninitialized_empty_reads_as_zeros():
    """torch.empty has a real storage; reading it before a write gives zeros (CUDA: garbage)."""
    t = torch.empty(3, device="tpu")
    assert t.cpu().tolist() == [0.0, 0.0, 0.0]
