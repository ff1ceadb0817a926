"""Bad input gets PyTorch-style errors; CPU fallback is visible and can be forbidden."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import UNLOWERED_OP_SOURCE
from torch_tpu import metrics


def test_mixed_devices_error():
    """tpu + cpu (non-scalar) raises the familiar same-device error."""
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="tpu") + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="tpu:0") + torch.ones(3, device="tpu:1")


def test_cpu_scalar_tensor_is_allowed():
    """A 0-dim CPU tensor mixes with tpu tensors, as with CUDA."""
    out = torch.ones(3, device="tpu") * torch.tensor(2.5)
    assert out.device.type == "tpu" and out.tolist() == [2.5, 2.5, 2.5]


def test_shape_errors_are_pytorchs():
    """Shape errors come from PyTorch's own checks, not a JAX traceback."""
    with pytest.raises(RuntimeError, match="must match the size|broadcast"):
        torch.ones(3, device="tpu") + torch.ones(4, device="tpu")
    with pytest.raises(RuntimeError):
        torch.ones(2, 3, device="tpu") @ torch.ones(2, 3, device="tpu")


def test_local_scalar_dense_like_cpu():
    """aten._local_scalar_dense, called directly: CPU's first element, and CPU's error on no element."""
    for device in ("cpu", "tpu"):
        x = (torch.arange(6.0, device=device) + 1).view(2, 3).t()[1:]
        assert torch.ops.aten._local_scalar_dense(x) == 2.0
        with pytest.raises(RuntimeError, match="^_local_scalar_dense: Empty tensor not supported$"):
            torch.ops.aten._local_scalar_dense(torch.empty(2, 0, device=device))


def test_dtype_errors():
    """In-place result-type errors match PyTorch's."""
    with pytest.raises(RuntimeError, match="can't be cast|not possible"):
        torch.ones(3, dtype=torch.int64, device="tpu").add_(0.5)


# Ops that PyTorch does not define on complex numbers (no order; real-only functions). JAX orders complex numbers
# lexicographically, so their lowerings computed where every PyTorch device refuses (found by PyTorch's
# test_foreach on tpu: _foreach_minimum of complex tensors).
_COMPLEX_REFUSED = {
    "clamp": lambda z: torch.clamp(z, 0, 1), "clamp_min": lambda z: z.clamp_min(1),
    "clamp_max_tensor": lambda z: z.clamp_max(z), "clamp_": lambda z: z.clone().clamp_(0, 1), "relu": torch.relu,
    "minimum": lambda z: torch.minimum(z, z), "maximum": lambda z: torch.maximum(z, z),
    "fmax": lambda z: torch.fmax(z, z), "max": lambda z: z.max(), "max_dim": lambda z: z.max(0),
    "amin": lambda z: z.amin(1), "argmax": lambda z: z.argmax(), "sort": lambda z: z.sort(),
    "topk": lambda z: z.topk(1), "median": lambda z: z.median(), "cummax": lambda z: z.cummax(0),
    "lt": lambda z: z < z, "ge_scalar": lambda z: z >= 1, "sign": torch.sign, "round": torch.round,
    "atan2": lambda z: torch.atan2(z, z), "heaviside": lambda z: torch.heaviside(z, z),
    "searchsorted": lambda z: torch.searchsorted(z[0], z), "unique": torch.unique,
    "unique_dim": lambda z: torch.unique(z, dim=0), "softmax": lambda z: torch.softmax(z, 0),
    "elu": torch.nn.functional.elu, "foreach_minimum": lambda z: torch._foreach_minimum([z], 1.0),
    "foreach_clamp_max": lambda z: torch._foreach_clamp_max([z], [z]),
}


@pytest.mark.parametrize("name", sorted(_COMPLEX_REFUSED))
def test_ops_undefined_on_complex_raise_pytorchs_error(name):
    """Complex arguments of an op PyTorch does not define on complex numbers raise CPU's error, not a value."""
    fn = _COMPLEX_REFUSED[name]
    z = torch.tensor([[1 + 2j, -3 + 0.5j], [2 - 1j, 0.5 + 0.5j]], dtype=torch.complex64)
    with pytest.raises((RuntimeError, NotImplementedError)) as cpu_err:
        fn(z)
    with pytest.raises(type(cpu_err.value)) as tpu_err:
        fn(z.to("tpu"))
    assert str(tpu_err.value) == str(cpu_err.value)


def test_complex_check_of_a_big_call_asks_cpu_on_cut_shapes(monkeypatch):
    """A big complex call is asked of the CPU kernel on shapes cut to 2 (a 512x512 complex matmul costs no CPU
    matmul of that size); when the cut shapes do not fit its arguments (topk(k=5)) the whole call is asked,
    and a refusal is still raised."""
    from torch_tpu.eager import cpu_errors

    asked = []
    replay = cpu_errors._replay
    monkeypatch.setattr(cpu_errors, "_replay", lambda *a, **k: asked.append(k.get("max_size")) or replay(*a, **k))
    z = torch.randn(512, 512, dtype=torch.complex64)
    zt = z.to("tpu")
    asked.clear()
    torch.testing.assert_close((zt @ zt).cpu(), z @ z, rtol=1e-4, atol=1e-3)
    assert asked and set(asked) == {2}
    asked.clear()
    with pytest.raises(RuntimeError, match="topk does not support complex"):
        zt.topk(5)
    assert asked[:2] == [2, None]  # (the error path asks once more: build() maps errors to CPU's)


def test_nansum_of_complex_computes_as_on_cuda():
    """CPU's refusal of a complex nansum is its own (ATen checks it for CPU tensors only): tpu computes it."""
    z = torch.tensor([1 + 2j, float("nan"), -3 + 0.5j], dtype=torch.complex64)
    expected = torch.tensor(-2 + 2.5j)
    assert torch.nansum(z.to("tpu")).cpu() == expected


def test_unsupported_dtype_is_clear():
    """A dtype XLA cannot hold is refused with PyTorch's TypeError for a backend without it (MPS's wording),
    wherever a tpu tensor of it would be made."""
    message = "Trying to convert torch.complex32 to the tpu backend but it does not have support for that dtype"
    for make in (lambda: torch.ones(3, dtype=torch.complex32).to("tpu"),
                 lambda: torch.zeros(3, dtype=torch.complex32, device="tpu"),
                 lambda: torch.ones(3, device="tpu").chalf()):
        with pytest.raises(TypeError, match=message):
            make()


exec(UNLOWERED_OP_SOURCE)


def test_fallback_warns_once_and_counts():
    """An op with no lowering or decomposition runs on CPU, warns once, and is counted."""
    op = "tpu_test.unlowered.default"
    before = metrics.fallbacks[op]
    a = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="not lowered for the 'tpu' device"):
        out = torch.ops.tpu_test.unlowered(a.to("tpu"))
    torch.testing.assert_close(out.cpu(), a * 2 + 1)
    assert out.device.type == "tpu"
    assert metrics.fallbacks[op] == before + 1
    assert op in metrics.report()


def test_fallback_error_mode():
    """TORCH_TPU_FALLBACK=error turns a CPU fallback into NotImplementedError."""
    code = UNLOWERED_OP_SOURCE + "import torch_tpu\ntorch.ops.tpu_test.unlowered(torch.randn(3, 4, device='tpu'))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCH_TPU_FALLBACK="error"))
    assert out.returncode != 0
    assert "NotImplementedError" in out.stderr and "tpu_test.unlowered" in out.stderr
