"""Reductions whose lowering takes a platform-specific form (ops/reduction.py)."""
import pytest
import torch

from conftest import assert_matches_cpu

# (shape, dims): a few long rows summed over the leading dims take the pairwise-rows form on
# XLA:CPU; the others reduce as usual. The results are PyTorch's either way.
CASES = [
    ((8, 128, 256), 0),  # a position embedding's gradient summed over the batch
    ((8, 128, 256), (0, 1)),
    ((3, 5, 4096), (1, 0)),
    ((7, 8192), 0),  # an odd number of rows
    ((64, 4096), 0),
    ((65, 4096), 0),  # too many rows: the usual reduction
    ((8, 128, 256), -1),  # not leading dims
]


def test_bfloat16_sum_tolerance_bites():
    """The tolerance above rejects a bfloat16 running sum (the failure it guards against)."""
    torch.manual_seed(0)
    row = torch.randn(8192).bfloat16() + 1  # a long row with a drifting sum
    running = torch.zeros((), dtype=torch.bfloat16)
    for v in row.tolist():  # rounded to bfloat16 after every add
        running = running + torch.tensor(v, dtype=torch.bfloat16)
    total = row.sum()  # float32 accumulation, rounded once
    with pytest.raises(AssertionError):
        torch.testing.assert_close(running, total, atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("shape,dims", CASES)
def test_sum_over_leading_dims(shape, dims, keepdim):
    """torch.sum over leading dims (float32 with gradients, bfloat16 accumulated in float32, int64)."""
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    assert_matches_cpu(lambda t: t.sum(dims, keepdim=keepdim), x, grads=True, atol=1e-4, rtol=1e-5)
    # CPU accumulates bfloat16 in float32 and rounds once: the results may differ only where the two float32
    # sums (in different orders) round to neighbouring bfloat16 values, one ulp (2**-7 relative) at most.
    # A plain bfloat16 running sum is off by several ulp on these rows (test_bfloat16_sum_tolerance_bites).
    assert_matches_cpu(lambda t: t.sum(dims, keepdim=keepdim), x.detach().bfloat16(), atol=1e-3, rtol=2**-7)
    ints = torch.randint(-9, 9, shape)
    assert_matches_cpu(lambda t: t.sum(dims, keepdim=keepdim), ints)


def test_few_long_rows_are_added_without_a_library_reduction():
    """On XLA:CPU the rows are added in one elementwise pass: no reduce in the op's program."""
    import jax

    from torch_tpu.ops import reduction
    from torch_tpu.runtime import platform

    if platform.get().platform != "cpu":
        pytest.skip("an XLA:CPU form")
    x = jax.numpy.ones((8, 128, 256))
    text = jax.jit(lambda v: reduction.sum_dim(v, [0])).lower(x).as_text()
    assert "reduce" not in text and "add" in text
    text = jax.jit(lambda v: reduction.sum_dim(v, [2])).lower(x).as_text()
    assert "reduce" in text
