"""torch.autocast("tpu") follows CUDA's autocast rules, checked against PyTorch's own CUDA autocast test lists."""
from __future__ import annotations

import math
import threading

import pytest
import torch

from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists, AutocastTestLists

from torch_tpu import autocast
from torch_tpu.eager import kernels
from conftest import TPU

with torch.random.fork_rng(devices=[]):  # PyTorch's autocast test cases, with reproducible inputs (built on CPU)
    torch.manual_seed(0)
    _CUDA = AutocastTestLists(torch.device("cpu"))  # CUDA's cases
    _CPU = AutocastCPUTestLists(torch.device("cpu"))

# Which output dtype each of PyTorch's CUDA lists expects, and where its ops live.
_LOW, _FP32 = "autocast dtype", torch.float32
_LISTS = {  # list name: (module holding the ops or None for Tensor methods, expected dtype)
    "torch_fp16": (torch, _LOW),
    "torch_fp32": (torch, _FP32),
    "torch_need_autocast_promote": (torch, _FP32),
    "torch_expect_builtin_promote": (torch, None),  # each entry names its dtype
    "nn_fp16": (torch._C._nn, _LOW),
    "nn_fp32": (torch._C._nn, _FP32),
    "linalg_fp16": (torch._C._linalg, _LOW),
    "methods_fp16": (None, _LOW),
    "methods_fp32": (None, _FP32),
    "methods_expect_builtin_promote": (None, None),
}

SKIP = {
    "cudnn_convolution": "cuDNN-only op: no kernel exists for tpu or CPU",
    "cudnn_convolution_transpose": "cuDNN-only op: no kernel exists for tpu or CPU",
    "einsum": "PyTorch's list entry has its operands in the wrong slot (CUDA's own test skips it too); "
              "einsum decomposes to bmm, covered by 'bmm'",
}


@pytest.fixture(autouse=True)
def _keep_fallback_warnings(monkeypatch):
    """CPU fallbacks met here (ops the families do not lower) do not use up their one-time warnings."""
    monkeypatch.setattr(kernels, "_warned", set(kernels._warned))


def _cases():
    cases = []
    for list_name, (module, expected) in _LISTS.items():
        for i, entry in enumerate(getattr(_CUDA, list_name)):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            out_type = entry[2] if expected is None else expected
            marks = []
            if op in SKIP:
                marks.append(pytest.mark.skip(reason=SKIP[op]))
            cases.append(pytest.param(op, args, kwargs, module, out_type, id=f"{list_name}-{i}-{op}", marks=marks))
    return cases


def _to_tpu(value, amp_dtype):
    """Move a list argument to tpu; the lists' float16 stands for the autocast dtype."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.float16:
            value = value.to(amp_dtype)
        return value.to(TPU)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_tpu(v, amp_dtype) for v in value)
    return value


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class _Call:
    """One op call on tpu arguments. Its repr names only the op: pytest prints the arguments of failing
    frames, and printing tpu tensors element by element is slow."""

    def __init__(self, op, module, args, kwargs):
        self.op, self.module, self.args, self.kwargs = op, module, args, kwargs

    def __call__(self, cast_to=None):
        args = self.args if cast_to is None else _cast(self.args, cast_to)
        if self.module is not None:
            return getattr(self.module, self.op)(*args, **self.kwargs)
        return getattr(args[0], self.op)(*args[1:], **self.kwargs)

    def __repr__(self):
        return f"_Call({self.op})"


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _leaves(o)]
    return []


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("op, args, kwargs, module, out_type", _cases())
def test_cuda_autocast_lists(amp_dtype, op, args, kwargs, module, out_type):
    """Each case of PyTorch's CUDA autocast tests gives CUDA's dtype on tpu, bitwise equal to casting by hand."""
    call = _Call(op, module, _to_tpu(args, amp_dtype), kwargs)
    run_as = amp_dtype if out_type == _LOW else torch.float32
    expected_dtype = amp_dtype if out_type == _LOW else out_type
    with torch.autocast("tpu", dtype=amp_dtype):
        out = call()
    result = _first_tensor(out)
    # (dtypes and booleans bound first: pytest would print tpu tensors in assertion messages, which is slow)
    if isinstance(result, torch.Tensor):
        dtype = result.dtype
        assert dtype == expected_dtype, f"{op}: {dtype}, CUDA's rules give {expected_dtype}"
    # Autocast only casts: the same op on inputs cast by hand (autocast off) gives the same bits.
    same = _same(out, call(cast_to=run_as))
    assert same, f"{op}: autocast result differs from casting the inputs to {run_as} by hand"
    # And the values are PyTorch's: the CPU runs the op on the same inputs cast by hand (an oracle of its own).
    low = run_as in (torch.bfloat16, torch.float16)
    if low:
        # Low-precision results are PyTorch's CUDA kernels' (and ours): float32 arithmetic on the cast inputs,
        # rounded once. Its CPU kernels may round intermediates to the low dtype instead, by an amount that
        # depends on the CPU (addbmm's running sum; conv_transpose on an AVX2-only CPU): so the oracle is the
        # CPU's float32 result of the same low-precision inputs, rounded once (tests/opinfo_sweep.py's
        # OPMATH_REFERENCE does the same).
        cpu_call = _Call(op, module, _cast(_cast(_to_cpu(call.args), run_as), torch.float32), kwargs)
        expected = [e.to(run_as) if e.is_floating_point() else e for e in _leaves(cpu_call())]
    else:
        expected = _leaves(_Call(op, module, _to_cpu(call.args), kwargs)(cast_to=run_as))
    atol = 2e-2 if low else 1e-4
    for a, e in zip(_leaves(out), expected):
        torch.testing.assert_close(a.cpu().double(), e.double(), atol=atol, rtol=2e-2 if low else 1e-4,
                                   equal_nan=True, msg=lambda m: f"{op}: autocast differs from CPU: {m[:200]}")


def test_banned_like_cuda():
    """binary_cross_entropy is refused under autocast, as on CUDA, with the same advice."""
    for op, args, module in _CUDA.banned:
        with torch.autocast("tpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="unsafe to autocast"):
            getattr(module, op)(*_to_tpu(args, torch.bfloat16))


def test_registered_ops_are_cudas():
    """The tpu autocast kernels cover exactly CUDA's autocast ops (less the cuDNN-only ones)."""
    cuda_only = {"aten::cudnn_convolution", "aten::cudnn_convolution_transpose"}
    tpu_ops = autocast.ops()
    assert tpu_ops == autocast.ops("AutocastCUDA") - cuda_only
    assert {"aten::mm", "aten::linear", "aten::scaled_dot_product_attention", "aten::softmax.int"} <= tpu_ops


_AGREED = sorted({e[0] for e in _CUDA.torch_fp16} & {e[0] for e in _CPU.torch_16} - set(SKIP))


@pytest.mark.parametrize("op", _AGREED)
def test_matches_cpu_autocast_where_lists_agree(op):
    """For ops both CPU's and CUDA's lists run in low precision, tpu autocast matches CPU autocast (bfloat16)."""
    entry = next(e for e in _CPU.torch_16 if e[0] == op)
    args = entry[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _first_tensor(getattr(torch, op)(*args))
    with torch.autocast("tpu", dtype=torch.bfloat16):
        actual = _first_tensor(getattr(torch, op)(*_to_tpu(args, torch.bfloat16))).cpu()
    assert actual.dtype == expected.dtype == torch.bfloat16
    # Both compute from bfloat16-rounded inputs; each rounds the exact result of those (once, or after
    # each partial sum). Ours must be as close to it as CPU's, within one bfloat16 ulp of the output scale.
    exact = _first_tensor(getattr(torch, op)(*_cast(_cast(args, torch.bfloat16), torch.float64)))
    ulp = 2.0 ** (math.floor(math.log2(exact.abs().max().item())) - 7)
    ours, cpus = (actual.double() - exact).abs(), (expected.double() - exact).abs()
    within = bool((ours <= cpus + ulp).all())
    assert within, f"{op}: tpu error {ours.max().item():.3g}, CPU autocast error {cpus.max().item():.3g}, ulp {ulp:.3g}"


def test_default_dtype_is_bfloat16():
    """torch.autocast("tpu") without dtype= runs in bfloat16; the device module lists the supported dtypes."""
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16
    assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]
    assert torch.tpu.is_bf16_supported()
    a = torch.randn(8, 8, device=TPU)
    with torch.autocast("tpu"):
        product, total = (a @ a).dtype, (a + a).dtype
    assert (product, total) == (torch.bfloat16, torch.float32)  # sum: off the lists, unchanged
    product = (a @ a).dtype
    assert product == torch.float32


def test_default_dtype_is_per_thread():
    """PyTorch keeps the autocast dtype per thread: other threads start at float16 (pass dtype= there)."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_autocast_dtype("tpu")))
    thread.start()
    thread.join()
    assert seen == [torch.float16]


def test_gpt_forward_under_autocast():
    """The demo GPT under autocast: bfloat16 logits, float32 loss, as with CUDA and CPU autocast."""
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    idx = torch.randint(0, 96, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu_logits, cpu_loss = model(idx, idx)
    model.to(TPU)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        logits, loss = (t.cpu() for t in model(idx.to(TPU), idx.to(TPU)))
    assert (logits.dtype, loss.dtype) == (cpu_logits.dtype, cpu_loss.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(loss, cpu_loss, rtol=2e-2, atol=2e-2)
