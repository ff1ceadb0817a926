"""The torch.tpu module surface and device registration."""
import subprocess
import sys

import pytest
import torch

import torch_tpu


def test_device_module_registered():
    """torch.tpu exists and 'tpu' is PyTorch's PrivateUse1 backend."""
    assert torch._C._get_privateuse1_backend_name() == "tpu"
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() == 4


def test_current_and_set_device():
    """set_device changes where device-less 'tpu' tensors go, per thread."""
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(2)
    try:
        assert torch.tpu.current_device() == 2
        assert torch.empty(3, device="tpu").device == torch.device("tpu:2")
    finally:
        torch.tpu.set_device(0)
    with torch.tpu.device(1):
        assert torch.zeros(2, device="tpu").device.index == 1
    assert torch.tpu.current_device() == 0


def test_invalid_device_index_errors():
    """An out-of-range index is a clear error, not a crash."""
    with pytest.raises(RuntimeError, match="Invalid device 'tpu:9'"):
        torch.empty(3, device="tpu:9")
    with pytest.raises(RuntimeError, match="Invalid device"):
        torch.tpu.set_device(7)


def test_device_properties_and_name():
    """Properties report the platform, kind and memory."""
    props = torch.tpu.get_device_properties(0)
    assert props.platform == "cpu"
    assert props.total_memory > 0
    assert "CPU" in torch.tpu.get_device_name()


def test_tensor_methods_generated():
    """Tensor.tpu(), Tensor.is_tpu exist like Tensor.cuda(), Tensor.is_cuda."""
    t = torch.ones(2).tpu()
    assert t.is_tpu and t.device.type == "tpu"


def test_synchronize_and_streams():
    """synchronize, streams and timing events behave like their CUDA counterparts."""
    x = torch.ones(100, device="tpu") * 3
    torch.tpu.synchronize()
    s = torch.tpu.current_stream()
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record(s)
    (x + 1).sum()
    end.record(s)
    assert start.elapsed_time(end) >= 0
    s.synchronize()


@pytest.mark.one_mode
def test_autoload_import_torch_alone():
    """PyTorch's device-backend autoload: a bare `import torch` makes 'tpu' usable."""
    code = "import torch; x = torch.ones(3, device='tpu'); print((x * 2).sum().item())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6.0"


@pytest.mark.one_mode
def test_import_torch_tpu_first():
    """`import torch_tpu` before `import torch` works (the autoload entry point tolerates it)."""
    code = "import torch_tpu, torch; print(torch.ones(2, device='tpu').sum().item())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"


@pytest.mark.one_mode
def test_import_is_light():
    """Importing torch_tpu does not start JAX (the runtime starts on first use)."""
    code = ("import sys, torch, torch_tpu; assert 'jax' not in sys.modules, 'jax imported'; "
            "assert not torch.tpu.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


@pytest.mark.one_mode
def test_version():
    assert torch_tpu.__version__


def test_pinned_host_memory_like_cuda():
    """pin_memory(), DataLoader(pin_memory=True) and non_blocking copies to the CPU work as on CUDA."""
    x = torch.randn(5)
    pinned = x.pin_memory()
    assert pinned.is_pinned() and not x.is_pinned()
    on_tpu = pinned.to("tpu", non_blocking=True)
    back = on_tpu.to("cpu", non_blocking=True)  # allocated pinned, like CUDA's non_blocking device->host copy
    torch.tpu.synchronize()
    assert back.is_pinned()
    torch.testing.assert_close(back, x)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4,
                                         pin_memory=True)
    batches = list(loader)
    assert all(b.is_pinned() for (b,) in batches)
    torch.testing.assert_close(torch.cat([b for (b,) in batches]), torch.arange(8.0))
