"""Device-generic PyTorch on "tpu": torch.accelerator, torch.Stream/Event, the memory API,
torch.get_device_module, GradScaler, autocast availability, default devices (docs/device-generic.md).

Runs in Strict and DeferAndFuse alike; values are compared with the same code on CPU.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_close_tree, to_cpu
import torch_tpu
from torch_tpu import metrics

MiB = 1 << 20


def _work(x, n=4):
    """Some device work whose result depends on every step."""
    for _ in range(n):
        x = torch.tanh(x @ x) * 0.5 + x
    return x


# ------------------------------------------------------------------ device module / accelerator
def test_get_device_module_is_torch_tpu():
    mod = torch.get_device_module("tpu")
    assert mod is torch.tpu is torch.get_device_module(torch.device("tpu:1"))
    assert mod.is_available() and mod.device_count() == torch.accelerator.device_count()
    assert mod.is_bf16_supported() is True
    assert torch.bfloat16 in mod.get_amp_supported_dtype() and torch.float16 in mod.get_amp_supported_dtype()
    props = mod.get_device_properties(0)
    assert isinstance(props.name, str) and props.name == mod.get_device_name(0)
    assert props.multi_processor_count >= 1
    free, total = mod.mem_get_info(0)
    assert total == props.total_memory > 0
    assert 0 < free <= total
    assert (free, total)[1] == torch.accelerator.get_memory_info(0)[1]


def test_accelerator_device_index():
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == torch.tpu.device_count() >= 2
    start = torch.accelerator.current_device_index()
    try:
        torch.accelerator.set_device_index(1)
        assert torch.accelerator.current_device_index() == 1 == torch.tpu.current_device()
        assert torch.empty(2, device="tpu").device == torch.device("tpu:1")
        with torch.accelerator.device_index(0):
            assert torch.tpu.current_device() == 0
        assert torch.tpu.current_device() == 1
    finally:
        torch.accelerator.set_device_index(start)
    with pytest.raises(RuntimeError, match="Invalid device"):
        torch.accelerator.set_device_index(torch.tpu.device_count())


def test_accelerator_device_capability():
    dtypes = torch.accelerator.get_device_capability("tpu:0")["supported_dtypes"]
    assert {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool} <= set(dtypes)
    for dtype in dtypes:  # every dtype it names holds values on tpu
        ref = torch.tensor([0, 1]).to(dtype)
        back = ref.to("tpu").cpu()
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), ref.view(torch.uint8)), dtype


def test_accelerator_synchronize_waits_for_work():
    a = torch.randn(128, 128) / 16
    x = _work(a.to("tpu"))
    torch.accelerator.synchronize()
    event = torch.Event(device="tpu")
    event.record()
    assert event.query()  # nothing launched since the synchronize is unfinished
    torch.accelerator.synchronize(0)
    torch.tpu.synchronize("tpu:0")
    assert_close_tree(x, _work(a), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ memory
def test_memory_api_counts_tensors_allocated_and_freed():
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    base = torch.accelerator.memory_allocated()
    base_stats = torch.accelerator.memory_stats()
    big = torch.empty(4 * MiB, dtype=torch.uint8, device="tpu")  # a CUDA "large pool" block
    small = torch.ones(256, device="tpu")  # 1 KiB: small pool
    assert torch.accelerator.memory_allocated() == base + 4 * MiB + 1024
    assert torch.accelerator.memory_reserved() == torch.accelerator.memory_allocated()
    assert torch.accelerator.max_memory_allocated() == base + 4 * MiB + 1024
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == base + 4 * MiB + 1024
    assert stats["allocation.all.current"] == base_stats["allocation.all.current"] + 2
    assert stats["allocated_bytes.large_pool.current"] - base_stats["allocated_bytes.large_pool.current"] == 4 * MiB
    assert stats["allocated_bytes.small_pool.current"] - base_stats["allocated_bytes.small_pool.current"] == 1024
    assert stats["reserved_bytes.all.current"] == stats["allocated_bytes.all.current"]
    assert stats["num_ooms"] == base_stats["num_ooms"]
    assert torch.tpu.memory_stats()["allocated_bytes.all.current"] == stats["allocated_bytes.all.current"]
    del big, small
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_allocated() == base
    assert torch.accelerator.max_memory_allocated() == base + 4 * MiB + 1024  # the peak stays
    after = torch.accelerator.memory_stats()
    assert after["allocation.all.freed"] >= base_stats["allocation.all.freed"] + 2
    assert after["allocated_bytes.all.freed"] >= base_stats["allocated_bytes.all.freed"] + 4 * MiB + 1024
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == base
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["allocation.all.freed"] == 0
    free, total = torch.accelerator.get_memory_info()
    assert 0 < free <= total == torch.tpu.get_device_properties().total_memory


def test_memory_api_per_device_and_oom_count():
    before = torch.accelerator.memory_allocated(1)
    t = torch.zeros(1024, device="tpu:1")
    assert torch.accelerator.memory_allocated("tpu:1") == before + 4096
    assert torch.accelerator.memory_allocated(0) == torch.tpu.memory_allocated(0)
    ooms = torch.accelerator.memory_stats(1)["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2**50, dtype=torch.uint8, device="tpu:1")
    assert torch.accelerator.memory_stats(1)["num_ooms"] == ooms + 1
    del t
    assert torch.accelerator.memory_allocated(1) == before


def test_empty_host_cache_keeps_pinned_memory():
    pinned = torch.arange(8.0).pin_memory()
    assert pinned.is_pinned()
    torch.accelerator.empty_host_cache()  # nothing is cached: live pinned tensors are untouched
    assert pinned.is_pinned() and torch.equal(pinned, torch.arange(8.0))
    assert_close_tree(pinned.to("tpu", non_blocking=True), torch.arange(8.0))


# ------------------------------------------------------------------ streams and events
def test_streams_are_distinct_and_current_per_block():
    default = torch.accelerator.current_stream()
    assert default.device == torch.device("tpu:0") and default.stream_id == 0
    s = torch.Stream(device="tpu")
    assert s.device == torch.device("tpu:0") and s.stream_id != 0 and s != default
    with s:
        assert torch.accelerator.current_stream() == s
        assert torch.tpu.current_stream() == s
    assert torch.accelerator.current_stream() == default
    t = torch.tpu.Stream()
    assert isinstance(t, torch.Stream) and t != s
    with torch.tpu.stream(t):
        assert torch.tpu.current_stream() == t
    assert torch.tpu.current_stream() == torch.tpu.default_stream() == default
    torch.accelerator.set_stream(t)
    assert torch.accelerator.current_stream() == t
    torch.accelerator.set_stream(default)
    other = torch.Stream(device="tpu:1")
    assert other.device == torch.device("tpu:1")


def test_stream_ordering_matches_cpu():
    """Work on two streams joined by wait_stream/wait_event computes what one stream would."""
    a = torch.randn(64, 64) / 8

    def run(device):
        x = a.to(device)
        if device == "cpu":
            y = _work(x)
            y.mul_(2)
            return y + 1
        s1, s2 = torch.Stream(device="tpu"), torch.Stream(device="tpu")
        with s1:
            y = _work(x)
        s2.wait_stream(s1)
        with s2:
            y.mul_(2)
            done = s2.record_event()
        s1.wait_event(done)
        with s1:
            z = y + 1
        s1.synchronize()
        assert s1.query() and s2.query()
        return z

    assert_close_tree(run("tpu"), run("cpu"), atol=1e-4, rtol=1e-4)


def test_events_time_device_work():
    x = torch.randn(256, 256, device="tpu") / 16
    start = torch.Event(device="tpu", enable_timing=True)
    end = torch.Event(device="tpu", enable_timing=True)
    start.record()
    y = _work(x, 8)
    end.record()
    end.synchronize()
    assert end.query() and start.query()
    elapsed = start.elapsed_time(end)
    assert elapsed > 0
    assert to_cpu(y).isfinite().all()
    untimed = torch.Event(device="tpu")
    untimed.record()
    untimed.wait()  # the current stream waits: a no-op on one in-order device, must not fail
    untimed.synchronize()
    assert untimed.query()
    with pytest.raises(ValueError, match="enable_timing"):  # PyTorch's own check
        untimed.elapsed_time(end)


def test_untimed_event_record_keeps_deferred_graph():
    """Stream syncs (untimed events) do not cut DeferAndFuse's graph; synchronizing one runs it."""
    with torch_tpu.defer_and_fuse():
        x = torch.ones(4, device="tpu") * 3
        flushes = metrics.counts.flushes
        event = torch.Event(device="tpu")
        event.record()
        torch.tpu.current_stream().wait_event(event)
        assert metrics.counts.flushes == flushes
        event.synchronize()
        assert metrics.counts.flushes == flushes + 1 and event.query()
    assert x.sum().item() == 12.0


def test_torch_tpu_event_and_stream_are_torch_types():
    s = torch.tpu.current_stream()
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    assert isinstance(start, torch.Event) and isinstance(start, torch.tpu.Event) and start.device.type == "tpu"
    assert not isinstance(torch.Event(device="cpu"), torch.tpu.Event)
    start.record(s)
    y = _work(torch.randn(128, 128, device="tpu") / 16)
    end.record(s)
    s.synchronize()
    assert start.elapsed_time(end) > 0
    e = s.record_event()
    assert isinstance(e, torch.Event)
    e.synchronize()
    assert e.query()
    del y


# ------------------------------------------------------------------ amp, default device
def test_autocast_available():
    assert torch.amp.is_autocast_available("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out = torch.randn(4, 4, device="tpu") @ torch.randn(4, 4, device="tpu")
    assert out.dtype == torch.bfloat16


def test_grad_scaler_ops_match_cpu():
    grads = [torch.tensor([1.0, 2.0, float("inf")]), torch.tensor([[3.0, -4.0]]), torch.tensor(5.0)]
    for with_inf in (True, False):
        cpu = [g.clone() for g in (grads if with_inf else grads[1:])]
        tpu = [g.to("tpu") for g in cpu]
        found_cpu, found_tpu = torch.zeros(1), torch.zeros(1, device="tpu")
        inv_cpu, inv_tpu = torch.full((1,), 0.25), torch.full((1,), 0.25, device="tpu")
        torch._amp_foreach_non_finite_check_and_unscale_(cpu, found_cpu, inv_cpu)
        torch._amp_foreach_non_finite_check_and_unscale_(tpu, found_tpu, inv_tpu)
        assert_close_tree(tpu, cpu)
        assert_close_tree(found_tpu, found_cpu)
    for found, tracker in ((1.0, 1), (0.0, 0), (0.0, 1)):
        results = []
        for device in ("cpu", "tpu"):
            scale = torch.full((1,), 1024.0, device=device)
            growth = torch.full((1,), tracker, dtype=torch.int32, device=device)
            torch._amp_update_scale_(scale, growth, torch.full((1,), found, device=device), 2.0, 0.5, 2)
            results.append((scale, growth))
        assert_close_tree(results[1], to_cpu(results[0]))
    assert "_amp_foreach_non_finite_check_and_unscale_" not in str(dict(metrics.fallbacks))
    assert "_amp_update_scale_" not in str(dict(metrics.fallbacks))


def test_grad_scaler_fp16_training_matches_cpu():
    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
        data = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
        losses, scales = [], []
        for step, x in enumerate(data):
            x = x.to(device)
            with torch.autocast(device, dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            if step == 1:
                loss = loss * float("inf")  # an overflowing step: skipped, scale backs off
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
            scales.append(scaler.get_scale())
        return losses, scales, [p.detach() for p in model.parameters()]

    losses, scales, params = train("tpu")
    ref_losses, ref_scales, ref_params = train("cpu")
    assert scales == ref_scales == [1024.0, 512.0, 512.0, 1024.0]
    assert_close_tree(losses, ref_losses, atol=2e-2, rtol=2e-2)
    assert_close_tree(params, ref_params, atol=2e-2, rtol=2e-2)


def test_default_device_factories():
    factories = {
        "ones": lambda: torch.ones(2), "randn": lambda: torch.randn(2), "arange": lambda: torch.arange(3),
        "empty": lambda: torch.empty(1), "tensor": lambda: torch.tensor([1.0, 2.0]), "eye": lambda: torch.eye(2),
        "full": lambda: torch.full((2,), 3.0), "linspace": lambda: torch.linspace(0, 1, 3),
        "zeros_like": lambda: torch.zeros_like(torch.ones(2)), "Linear": lambda: torch.nn.Linear(2, 2).weight,
    }
    torch.set_default_device("tpu")
    try:
        placed = {name: make() for name, make in factories.items()}
    finally:
        torch.set_default_device(None)
    assert {name: t.device.type for name, t in placed.items()} == dict.fromkeys(factories, "tpu")
    assert_close_tree(placed["arange"], torch.arange(3))
    with torch.device("tpu:1"):
        inside = {name: make() for name, make in factories.items()}
    assert {name: str(t.device) for name, t in inside.items()} == dict.fromkeys(factories, "tpu:1")
    assert torch.ones(1).device.type == "cpu"
    assert_close_tree(inside["linspace"], torch.linspace(0, 1, 3))


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_legacy_typed_storages_of_tpu_tensors():
    """torch.tpu.FloatStorage and its siblings, as torch.cuda's: storage_type(), isinstance, construction."""
    t = torch.arange(3.0, device="tpu")
    assert t.storage_type() is torch.tpu.FloatStorage
    assert torch.ones(2, dtype=torch.int64, device="tpu").storage_type() is torch.tpu.LongStorage
    assert isinstance(t.storage(), torch.tpu.FloatStorage) and not isinstance(t.storage(), torch.FloatStorage)
    assert not isinstance(torch.ones(2).storage(), torch.tpu.FloatStorage)
    assert t.storage().type() == "torch.tpu.FloatStorage"
    made = torch.tpu.BFloat16Storage([1.0, 2.5])
    assert (made.device.type, made.dtype, made.tolist()) == ("tpu", torch.bfloat16, [1.0, 2.5])
    assert torch.tpu.FloatStorage(4).size() == 4


def test_dlpack_round_trips_share_whole_storages_and_copy_views():
    """torch.from_dlpack / to_dlpack / __dlpack__ of tpu tensors (kDLExtDev capsules): a tensor that spans
    its storage is shared (a write through the import shows in the export), a view of part of a storage
    comes back as a copy of its values, copy=False for such a view and a tensor requiring grad raise
    BufferError, and a cross-device import copies; every value against the CPU tensor."""
    from torch.utils.dlpack import DLDeviceType, from_dlpack, to_dlpack

    cpu = torch.arange(12, dtype=torch.float32)
    x = cpu.to("tpu")
    assert x.__dlpack_device__() == (DLDeviceType.kDLExtDev, 0)
    shared = torch.from_dlpack(x)
    assert shared.device == x.device and shared.data_ptr() == x.data_ptr()
    shared[0] = 100.0
    cpu[0] = 100.0
    assert torch.equal(x.cpu(), cpu)
    transposed = torch.from_dlpack(x.view(3, 4).t())  # spans the storage: shared, strides kept
    assert transposed.stride() == (1, 4) and torch.equal(transposed.cpu(), cpu.view(3, 4).t())
    head, tail = from_dlpack(to_dlpack(x[:5])), torch.from_dlpack(x[2:])
    assert torch.equal(head.cpu(), cpu[:5]) and torch.equal(tail.cpu(), cpu[2:])
    head.add_(1)  # a copy: the exported storage is unchanged
    assert torch.equal(x.cpu(), cpu)
    with pytest.raises(BufferError, match="without a copy"):
        x[2:].__dlpack__(copy=False)
    with pytest.raises(BufferError, match="require gradient"):
        torch.from_dlpack(torch.ones(2, device="tpu", requires_grad=True))
    del x, shared
    assert torch.equal(transposed.cpu(), cpu.view(3, 4).t())  # the capsule keeps the storage alive
    assert torch.equal(torch.from_dlpack(transposed, device="cpu"), cpu.view(3, 4).t())
