"""Every supported dtype through representative ops of each family, and the float64 policy."""
import pytest
import torch

from conftest import assert_matches_cpu
from torch_tpu.config import config
from torch_tpu.runtime import dtypes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64]

OPS = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "eq": lambda a, b: a == b,
    "maximum": torch.maximum,
    "where": lambda a, b: torch.where(a != 0, a, b),
    "bitwise": lambda a, b: (a & b, a | b, a ^ b, ~a),
    "shift": lambda a, b: (a << 1, a >> 1),
    "abs_neg": lambda a, b: (a.abs(), -a),
    "sum_prod": lambda a, b: (a.sum(), a.sum(0), a.prod(1)),
    "cumsum": lambda a, b: a.cumsum(1),
    "max_argmax": lambda a, b: (a.amax(1), a.argmax(0)),
    "sort": lambda a, b: a.sort(dim=1, stable=True),
    "index": lambda a, b: (a[[0, 2]], a.index_select(1, torch.tensor([1, 0], device=a.device))),
    "scatter_add": lambda a, b: a.scatter_add(1, torch.zeros(4, 2, dtype=torch.long, device=a.device), b[:, :2]),
    "cat_flip": lambda a, b: (torch.cat([a, b]), a.flip(0), a.t().contiguous()),
    "matmul": lambda a, b: a @ b.t(),
    "nonzero_unique": lambda a, b: (torch.nonzero(a), torch.unique(a)),
    "exp_sin": lambda a, b: (torch.exp(a / 8), torch.sin(a)),
    "div": lambda a, b: a / (b + 100).to(a.dtype) if a.dtype != torch.bool else a,
}


def _inputs(dtype):
    torch.manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(4, 5) > 0.5, torch.rand(4, 5) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(4, 5) * 4).to(dtype), (torch.randn(4, 5) * 4).to(dtype)
    low = 0 if dtype == torch.uint8 else -20
    return torch.randint(low, 20, (4, 5), dtype=dtype), torch.randint(low, 20, (4, 5), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_dtype_matches_cpu(name, dtype):
    """The op gives PyTorch's CPU result (values and dtype) for this dtype, natively."""
    fn = OPS[name]
    a, b = _inputs(dtype)
    try:
        fn(a, b)
    except (RuntimeError, TypeError) as err:
        pytest.skip(f"PyTorch's CPU rejects {name} for {dtype}: {str(err).splitlines()[0][:80]}")
    low = dtype in (torch.bfloat16, torch.float16)
    previous = config.fallback
    config.fallback = "error"
    try:
        assert_matches_cpu(fn, a, b, atol=1e-2 if low else 1e-5, rtol=1.6e-2 if low else 1e-5)
    finally:
        config.fallback = previous


def test_float64_policy():
    """float64/complex128 work where XLA has them (CPU, GPU) and are refused with a clear error on TPUs."""
    dtypes.check_supported(torch.float64, "cpu")
    dtypes.check_supported(torch.float64, "gpu")
    for dtype in (torch.float64, torch.complex128):
        with pytest.raises(TypeError, match="no 64-bit floating point"):
            dtypes.check_supported(dtype, "tpu")


def test_complex32_is_refused():
    """complex32 has no XLA type: moving one to tpu raises a TypeError naming the dtype."""
    with pytest.raises(TypeError, match="complex32"):
        torch.zeros(2, dtype=torch.complex32).to("tpu")
