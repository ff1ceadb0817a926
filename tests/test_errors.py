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


def test_dtype_errors():
    """In-place result-type errors match PyTorch's."""
    with pytest.raises(RuntimeError, match="can't be cast|not possible"):
        torch.ones(3, dtype=torch.int64, device="tpu").add_(0.5)


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
