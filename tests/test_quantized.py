"""Quantized arithmetic against CPU: every float8 dtype's conversions bit for bit, torch._scaled_mm,
the int8 products (_int_mm, _weight_int8pack_mm), and torchao on "tpu": Float8Linear training and
int8 weight-only quantization."""
import copy
import re

import pytest
import torch

from conftest import TPU, no_fallback

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


def _special_and_random_floats():
    torch.manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31 - 1, (20000,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-30, 2**-127, 2**-126, 0.3, 1.5, 2.5, 3.0, 3.5, 240.0, 448.0, 463.9, 464.0,
                            500.0, 57344.0, 61440.0, 1e38, float("inf"), -float("inf"), float("nan"), -1.0, -448.0,
                            -500.0, 1e-3, 2**-10])
    return torch.cat([special, random_bits])


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_conversions_match_cpu_bit_for_bit(dtype):
    """To float8 from float32, float64, bfloat16, float16, integers and bool, and back: c10's rules (e4m3fn
    saturates at +-448 where XLA's convert gives NaN; e8m0fnu keeps the exponent of |x| where XLA gives NaN
    for zero and negatives). Every NaN stays NaN (its bits may differ, as they may between CPU and CUDA)."""
    floats = _special_and_random_floats()
    normal = floats.abs() >= torch.finfo(torch.float32).tiny  # XLA:CPU flushes float32 subnormals (precision.md)
    sources = [floats, floats.double(), floats.bfloat16(), floats.half(), torch.arange(-300, 300),
               torch.arange(-300, 300, dtype=torch.int32), torch.tensor([True, False])]
    for source in sources:
        if source.dtype == torch.float64:  # a double subnormal as float32 is flushed on the way
            source = source[normal]
        expected = source.to(dtype)
        got = source.to(TPU).to(dtype).cpu()
        nan = expected.float().isnan()
        assert torch.equal(got.float().isnan(), nan), f"{source.dtype} -> {dtype}: NaNs differ"
        assert torch.equal(got.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan]), f"{source.dtype} -> {dtype}"
    every_value = torch.arange(256, dtype=torch.uint8).view(dtype)
    on_tpu = every_value.to(TPU)
    assert torch.equal(on_tpu.cpu().view(torch.uint8), every_value.view(torch.uint8))  # copies keep the bits
    for wide in (torch.float32, torch.bfloat16, torch.float16):
        torch.testing.assert_close(on_tpu.to(wide).cpu(), every_value.to(wide), equal_nan=True, atol=0, rtol=0)


def _scaled_mm_cases():
    torch.manual_seed(0)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    a = (torch.randn(32, 64) * 8).to(e4m3)
    b = (torch.randn(48, 64) * 8).to(e4m3).t()  # column-major, as CUDA requires (tpu and CPU take either)
    sa, sb = torch.tensor(0.37), torch.tensor(1.9)
    rows, cols = torch.rand(32, 1) + 0.1, torch.rand(1, 48) + 0.1
    return {
        "tensorwise-float8-out": ((a, b, sa, sb), {}),
        "tensorwise-float32": ((a, b, sa, sb), {"out_dtype": torch.float32}),
        "tensorwise-bfloat16": ((a, b, sa, sb), {"out_dtype": torch.bfloat16}),
        "tensorwise-float16": ((a, b, sa, sb), {"out_dtype": torch.float16}),
        "tensorwise-e5m2-out": ((a, b, sa, sb), {"out_dtype": e5m2}),
        "rowwise-bfloat16": ((a, b, rows, cols), {"out_dtype": torch.bfloat16}),
        "rowwise-bias-float32": ((a, b, rows, cols), {"bias": torch.randn(48), "out_dtype": torch.float32}),
        "bias-bfloat16": ((a, b, sa, sb), {"bias": torch.randn(48, dtype=torch.bfloat16), "out_dtype": torch.bfloat16}),
        "e5m2-times-e4m3": ((a.float().to(e5m2), b, sa, sb), {"out_dtype": torch.float32}),
        "fnuz": ((a.float().to(torch.float8_e4m3fnuz), b.float().to(torch.float8_e4m3fnuz), sa, sb),
                 {"out_dtype": torch.float32}),
        "row-major-mat2": ((a, b.contiguous(), sa.view(1), sb.view(1, 1)), {"out_dtype": torch.float32}),
        "empty-k": ((a[:, :0], b[:0], sa, sb), {"out_dtype": torch.float32}),
        "saturates": ((torch.tensor([[400.0, 400.0]]).to(e4m3), torch.tensor([[1.0], [1.0]]).to(e4m3),
                       torch.tensor(1.0), torch.tensor(1.0)), {}),
    }


@pytest.mark.parametrize("case", list(_scaled_mm_cases()))
def test_scaled_mm_matches_cpu(case):
    """The product is exact (float8 in bfloat16, float32 sums); the scales multiply the sum where CPU scales
    the operands, so float32 results agree to float32 rounding and rounded results (bfloat16, float8) exactly
    or to one step where the two roundings straddle a boundary."""
    args, kwargs = _scaled_mm_cases()[case]
    expected = torch._scaled_mm(*args, **kwargs)
    with no_fallback():
        got = torch._scaled_mm(*[a.to(TPU) for a in args], **{k: v.to(TPU) if isinstance(v, torch.Tensor) else v
                                                             for k, v in kwargs.items()})
    assert got.device.type == "tpu" and got.dtype == expected.dtype and got.shape == expected.shape
    assert got.stride() == expected.stride()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(expected.dtype, 2**-2)  # one step
    atol = 1e-6 * expected.float().abs().max().item() if expected.numel() else 0  # cancellation near zero
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("bad", ["shapes", "vector", "int8", "bfloat16-operands", "float64-scale", "one-rowwise-scale",
                                 "1-d-scales", "bias-size"])
def test_scaled_mm_refuses_what_cpu_refuses(bad):
    e4m3 = torch.float8_e4m3fn
    a, b, s = torch.ones(32, 64).to(e4m3), torch.ones(64, 48).to(e4m3), torch.tensor(1.0)
    args, kwargs = {
        "shapes": ((a, b[:16], s, s), {}),
        "vector": ((a, b[:, 0], s, s), {}),
        "int8": ((a.view(torch.int8), b, s, s), {}),
        "bfloat16-operands": ((a.bfloat16(), b.bfloat16(), s, s), {}),
        "float64-scale": ((a, b, s.double(), s), {}),
        "one-rowwise-scale": ((a, b, torch.ones(32, 1), s), {}),
        "1-d-scales": ((a, b, torch.ones(32), torch.ones(48)), {}),
        "bias-size": ((a, b, s, s), {"bias": torch.ones(10)}),
    }[bad]
    with pytest.raises((RuntimeError, ValueError)) as on_cpu:
        torch._scaled_mm(*args, out_dtype=torch.float32, **kwargs)
    with no_fallback(), pytest.raises(on_cpu.type, match=re.escape(str(on_cpu.value))):
        torch._scaled_mm(*[x.to(TPU) for x in args], out_dtype=torch.float32,
                         **{k: v.to(TPU) for k, v in kwargs.items()})


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torchao_float8_linear_trains_like_cpu(compiled):
    """torchao's Float8Linear (dynamic tensorwise scaling: float8 casts, amax, torch._scaled_mm in the forward
    and both backward products) trains an MLP for five AdamW steps on "tpu" as on CPU, all ops on the device."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    batches = [(torch.randn(32, 64), torch.randn(32, 32)) for _ in range(5)]
    curves = {}
    for device in ("cpu", TPU):
        m = copy.deepcopy(model).to(device)
        float8.convert_to_float8_training(m)
        assert type(m[0]).__name__ == "Float8Linear"
        step_model = torch.compile(m, backend="tpu") if compiled and device == TPU else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        with no_fallback():
            for x, y in batches:
                loss = torch.nn.functional.mse_loss(step_model(x.to(device)), y.to(device))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        curves[device] = (losses, [p.detach().cpu() for p in m.parameters()])
    torch.testing.assert_close(curves[TPU][0], curves["cpu"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(curves[TPU][1], curves["cpu"][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("self_dtype", [torch.int8, torch.uint8], ids=str)
def test_int_mm_is_exact(self_dtype):
    """int8 (or uint8) x int8 summed in int32, every value exact; CPU's checks."""
    torch.manual_seed(0)
    a = torch.randint(-128, 128, (33, 700), dtype=torch.int8).view(self_dtype)
    b = torch.randint(-128, 128, (700, 17), dtype=torch.int8)
    with no_fallback():
        got = torch._int_mm(a.to(TPU), b.to(TPU))
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), torch._int_mm(a, b))
    for bad in [(a.int(), b.int()), (a, b.view(torch.uint8)), (a[0], b), (a, b[:5])]:
        with pytest.raises(RuntimeError) as on_cpu:
            torch._int_mm(*bad)
        with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value))):
            torch._int_mm(*[x.to(TPU) for x in bad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_weight_int8pack_mm_matches_cpu(dtype):
    """x @ w.T * scales for an int8 weight, rounded once; a scale of another dtype is CPU's error."""
    torch.manual_seed(0)
    x, w = torch.randn(9, 64).to(dtype), torch.randint(-128, 128, (24, 64), dtype=torch.int8)
    scales = torch.rand(24) / 100
    expected = torch.ops.aten._weight_int8pack_mm(x, w, scales.to(dtype))
    with no_fallback():
        got = torch.ops.aten._weight_int8pack_mm(x.to(TPU), w.to(TPU), scales.to(dtype).to(TPU))
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 0  # rounded once from the same float32 sum: equal
    torch.testing.assert_close(got.cpu(), expected, rtol=tolerance, atol=tolerance)
    if dtype != torch.float32:
        with pytest.raises(RuntimeError, match="expected scalar type .* but found Float"):
            torch.ops.aten._weight_int8pack_mm(x.to(TPU), w.to(TPU), scales.to(TPU))


def test_torchao_int8_weight_only_quantization_matches_cpu():
    """torchao's quantize_(Int8WeightOnlyConfig()) on a tpu model: its int8 weights (and their scales) and its
    outputs agree with CPU's. XLA:CPU divides by a broadcast scalar as a multiplication by its reciprocal (as
    CUDA divides by a Python scalar), so a scale may differ by an ulp and a weight by one step at a rounding tie."""
    quantization = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).eval()
    x = torch.randn(8, 64)
    results = {}
    for device in ("cpu", TPU):
        m = copy.deepcopy(model).to(device)
        quantization.quantize_(m, quantization.Int8WeightOnlyConfig())
        with torch.no_grad(), no_fallback():
            results[device] = (m(x.to(device)).cpu(), m[0].weight.qdata.cpu(), m[0].weight.scale.cpu())
    (out, qdata, scale), (cpu_out, cpu_qdata, cpu_scale) = results[TPU], results["cpu"]
    assert (qdata.int() - cpu_qdata.int()).abs().max() <= 1 and (qdata != cpu_qdata).float().mean() < 0.01
    torch.testing.assert_close(scale, cpu_scale, rtol=2**-23, atol=0)
    torch.testing.assert_close(out, cpu_out, rtol=1e-2, atol=5e-3)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_float8_recipes_match_cpu(recipe):
    """torchao's float8 recipes on a bfloat16 model (rowwise: torch._scaled_mm with [M, 1] and [1, N] scales):
    the output and a weight gradient as on CPU."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).bfloat16()
    results = {}
    for device in ("cpu", TPU):
        m = copy.deepcopy(model).to(device)
        float8.convert_to_float8_training(m, config=float8.Float8LinearConfig.from_recipe_name(recipe))
        with no_fallback():
            out = m(x.to(device))
            out.float().square().sum().backward()
        results[device] = (out.detach().cpu(), m[0].weight.grad.cpu())
    torch.testing.assert_close(results[TPU], results["cpu"], rtol=2**-7, atol=1e-6)
