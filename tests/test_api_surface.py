"""The rest of the public surface: env vars, CLI, RNG/device helpers, platform choice."""
import os
import subprocess
import sys

import pytest
import torch

import torch_tpu
from conftest import UNLOWERED_OP_SOURCE


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))


@pytest.mark.one_mode
def test_set_num_cpu_devices_before_init():
    """torch_tpu.set_num_cpu_devices(n) before first use gives n devices; after init it refuses a change."""
    code = ("import torch, torch_tpu\n"
            "torch_tpu.set_num_cpu_devices(3)\n"
            "print(torch.tpu.device_count())\n"
            "try:\n    torch_tpu.set_num_cpu_devices(5)\nexcept RuntimeError as e:\n    print('refused')\n")
    out = _python(code, TORCH_TPU_NUM_CPU_DEVICES="")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "refused"]


@pytest.mark.one_mode
def test_platform_env_var():
    """TORCH_TPU_PLATFORM=cpu selects XLA:CPU; an unknown platform is a clear error."""
    out = _python("import torch; print(torch.tpu.get_device_properties(0).platform)", TORCH_TPU_PLATFORM="cpu")
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr
    bad = _python("import torch, torch_tpu", TORCH_TPU_PLATFORM="quantum")
    assert bad.returncode != 0 and "TORCH_TPU_PLATFORM" in bad.stderr


@pytest.mark.one_mode
def test_num_cpu_devices_env_var():
    """TORCH_TPU_NUM_CPU_DEVICES=2 gives two devices."""
    out = _python("import torch; print(torch.tpu.device_count())", TORCH_TPU_NUM_CPU_DEVICES="2")
    assert out.stdout.strip() == "2", out.stderr


@pytest.mark.one_mode
def test_cli_info():
    """`torch-tpu info` lists the platform and devices."""
    exe = os.path.join(os.path.dirname(sys.executable), "torch-tpu")
    out = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCH_TPU_NUM_CPU_DEVICES="2"))
    assert out.returncode == 0, out.stderr
    assert "platform: cpu, devices: 2" in out.stdout and "tpu:1" in out.stdout


def test_init_and_seed_helpers():
    """init/is_initialized, seed, seed_all, rng state of all devices, capability, reserved memory."""
    torch.tpu.init()
    assert torch.tpu.is_initialized()
    torch.tpu.seed()
    torch.tpu.seed_all()
    seeds = {g.initial_seed() for g in torch.tpu.default_generators}
    assert len(seeds) == 1
    states = torch.tpu.get_rng_state_all()
    a = torch.rand(3, device="tpu:1").cpu()
    torch.tpu.set_rng_state_all(states)
    assert torch.equal(a, torch.rand(3, device="tpu:1").cpu())
    assert torch.tpu.get_device_capability() == (0, 0)
    assert torch.tpu.memory_reserved() == torch.tpu.memory_allocated()
    assert torch.tpu.max_memory_reserved() == torch.tpu.max_memory_allocated()
    assert len(torch.tpu.default_generators) == torch.tpu.device_count()


def test_metrics_sections():
    """metrics.add_section adds lines to the report."""
    torch_tpu.metrics.add_section("test-section", lambda: {"answer": 42})
    try:
        assert "test-section: answer" in torch_tpu.metrics.report()
    finally:
        torch_tpu.metrics._sections.pop("test-section")


def test_fallback_silent_mode():
    """TORCH_TPU_FALLBACK=silent runs on CPU without a warning but still counts."""
    code = (UNLOWERED_OP_SOURCE + "import warnings, torch_tpu\nwarnings.simplefilter('error')\n"
            "torch.ops.tpu_test.unlowered(torch.randn(3, 4, device='tpu'))\n"
            "print(torch_tpu.metrics.fallbacks['tpu_test.unlowered.default'])\n")
    out = _python(code, TORCH_TPU_FALLBACK="silent")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
