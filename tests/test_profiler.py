"""torch.profiler on tpu: the Chrome trace of an MLP training step has our programs as device rows
with durations, compile events and copies; torch_tpu.profiler.trace also writes XLA's trace."""
from __future__ import annotations

import glob
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

import torch_tpu
from torch_tpu import _native
from torch_tpu.config import config


def _mlp_step(width):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    ).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, width).to("tpu")  # a host->device copy
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()  # a device->host copy


def _events(path):
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def test_chrome_trace_has_programs_with_device_time_and_compiles(tmp_path):
    expected = _mlp_step(24)  # untraced reference value
    fast_before = _native.fast_path_enabled()  # after the runtime started (a mode sets it then)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        assert torch_tpu.profiler.is_active()
        # A width nothing else uses: its programs compile inside the trace.
        loss = _mlp_step(37)
        again = _mlp_step(24)
    assert not torch_tpu.profiler.is_active() and _native.fast_path_enabled() == fast_before
    assert again == expected  # profiling changes timing only
    assert loss > 0
    path = str(tmp_path / "trace.json")
    prof.export_chrome_trace(path)
    events = _events(path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no device rows in the trace"
    names = {e["name"] for e in kernels}
    if config.defer_and_fuse:
        assert any(n.startswith("fused[") for n in names), names
    else:
        assert {"aten::addmm", "aten::mm"} <= names, names
    assert all(e["dur"] > 0 for e in kernels)
    compiles = [e for e in events if e["name"].startswith("XLA compile: ")]
    assert compiles and all(e["dur"] > 0 for e in compiles)
    copies = {e["name"].split(" (")[0] for e in events if e.get("cat") == "gpu_memcpy"}
    assert {"Memcpy HtoD", "Memcpy DtoH"} <= copies, copies
    # Device rows sit inside the traced window of the host's ops (one clock).
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert cpu_ops
    lo = min(e["ts"] for e in cpu_ops)
    hi = max(e["ts"] + e["dur"] for e in cpu_ops)
    assert all(lo - 1e3 <= e["ts"] <= hi + 1e3 for e in kernels)
    # Each device row links to the host op that launched it: device time per op.
    averages = {e.key: e for e in prof.key_averages()}
    op = "aten::_local_scalar_dense" if config.defer_and_fuse else "aten::addmm"  # .item() runs the graph
    assert averages[op].device_time_total > 0
    assert "Self TPU" in prof.key_averages().table(sort_by="self_device_time_total", row_limit=5)


def test_cpu_only_profile_keeps_fast_path():
    torch.ones(1, device="tpu")
    fast_before = _native.fast_path_enabled()
    with profile(activities=[ProfilerActivity.CPU]):
        assert not torch_tpu.profiler.is_active()
        (torch.ones(4, device="tpu") + 1).sum().item()
    assert _native.fast_path_enabled() == fast_before


def test_trace_dir_captures_torch_and_xla_traces(tmp_path):
    log_dir = str(tmp_path / "run")
    with torch_tpu.profiler.trace(log_dir) as prof:
        _mlp_step(24)
    assert prof.key_averages()
    names = {e["name"] for e in _events(os.path.join(log_dir, "torch_trace.json")) if e.get("cat") == "kernel"}
    assert names
    assert glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))


def test_tensorboard_trace_handler_writes_device_rows(tmp_path):
    handler = torch.profiler.tensorboard_trace_handler(str(tmp_path))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], on_trace_ready=handler):
        assert (torch.ones(8, device="tpu") * 2).sum().item() == 16.0
    (path,) = glob.glob(str(tmp_path / "*.pt.trace.json"))
    assert [e for e in _events(path) if e.get("cat") == "kernel" and e["dur"] > 0]


def test_profile_memory_counts_tpu_allocations():
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], profile_memory=True) as prof:
        t = torch.empty(1 << 20, dtype=torch.uint8, device="tpu")
        del t
    (empty,) = [e for e in prof.key_averages() if e.key == "aten::empty"]
    assert empty.device_memory_usage == 1 << 20
