"""Real storage: unique data pointers, real sizes, buffers released with the storage; memory stats."""
import gc

import pytest
import torch

from torch_tpu.runtime import storage


def test_unique_data_ptr_and_real_nbytes():
    """Every storage has its own address and its true byte size; views share it."""
    a = torch.empty(10, device="tpu")
    b = torch.empty(10, device="tpu")
    assert a.data_ptr() != b.data_ptr()
    assert a.untyped_storage().nbytes() == 40
    assert a[3:].data_ptr() == a.data_ptr() + 12
    # ranges never overlap (safetensors/tied-weight checks rely on it)
    lo, hi = sorted([a, b], key=lambda t: t.data_ptr())
    assert lo.data_ptr() + lo.untyped_storage().nbytes() <= hi.data_ptr()


def test_storage_lifetime_10000_tensors():
    """Allocate and drop 10,000 tensors: live buffers and memory_allocated return to baseline."""
    gc.collect()
    base_buffers = storage.live_buffer_count()
    base_bytes = torch.tpu.memory_allocated()
    x = torch.ones(64, device="tpu")
    kept = []
    for i in range(10_000):
        y = x * float(i)
        if i % 1000 == 0:
            kept.append(y.sum())
    assert storage.live_buffer_count() <= base_buffers + 1 + len(kept) + 2
    del y, kept, x
    gc.collect()
    assert storage.live_buffer_count() == base_buffers
    assert torch.tpu.memory_allocated() == base_bytes


def test_memory_stats_count_live_bytes():
    """memory_allocated/max_memory_allocated/reset_peak track live tpu storage bytes."""
    gc.collect()
    torch.tpu.reset_peak_memory_stats()
    start = torch.tpu.memory_allocated()
    t = torch.empty(1024, 1024, device="tpu")
    assert torch.tpu.memory_allocated() == start + 4 * 1024 * 1024
    assert torch.tpu.max_memory_allocated() >= start + 4 * 1024 * 1024
    del t
    assert torch.tpu.memory_allocated() == start
    assert torch.tpu.max_memory_allocated() >= start + 4 * 1024 * 1024
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == start
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == start
    assert "num_device_buffers" in stats
    torch.tpu.empty_cache()


def test_memory_per_device():
    """Each device counts its own bytes."""
    before = torch.tpu.memory_allocated(1)
    t = torch.zeros(256, device="tpu:1")
    assert torch.tpu.memory_allocated(1) == before + 1024
    assert torch.tpu.memory_allocated("tpu:1") == before + 1024
    del t


def test_out_of_memory_is_torch_oom():
    """An allocation past the device limit raises torch.OutOfMemoryError and loses nothing."""
    keep = torch.ones(4, device="tpu")
    with pytest.raises(torch.OutOfMemoryError, match="TPU out of memory"):
        torch.empty(2**50, dtype=torch.uint8, device="tpu")
    assert keep.sum().item() == 4.0


def test_per_process_memory_fraction():
    """set_per_process_memory_fraction caps allocations."""
    total = torch.tpu.get_device_properties(3).total_memory
    torch.tpu.set_per_process_memory_fraction(0.0001, 3)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.001), dtype=torch.uint8, device="tpu:3")
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0, 3)


def test_resize_grows_and_keeps_data():
    """resize_ to a larger size keeps the old elements (new storage), smaller keeps the storage."""
    t = torch.arange(4.0, device="tpu")
    ptr = t.data_ptr()
    t.resize_(2)
    assert t.data_ptr() == ptr and t.tolist() == [0.0, 1.0]
    t.resize_(6)
    assert t[:4].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert t.untyped_storage().nbytes() == 24


def test_untyped_storage_roundtrip():
    """Storage-level copies to and from the device keep bytes."""
    t = torch.tensor([1.5, -2.0, 3.25], device="tpu")
    s = t.untyped_storage()
    assert s.device.type == "tpu"
    cpu = s.cpu()
    assert torch.frombuffer(bytearray(cpu), dtype=torch.float32).tolist() == [1.5, -2.0, 3.25]


def test_storage_bytes_and_slices():
    """A tpu storage's single bytes read and write as on CPU; a slice, which on tpu could not share the
    storage's memory, raises, and a uint8 view of its bytes (the advised form) shares them."""
    cpu = torch.arange(8, dtype=torch.float32)
    t = cpu.to("tpu")
    s, cs = t.untyped_storage(), cpu.untyped_storage()
    assert [s[i] for i in (4, 7, -1)] == [cs[i] for i in (4, 7, -1)]
    s[7] = 65
    cs[7] = 65
    assert torch.equal(t.cpu(), cpu)
    assert cs[8:16].nbytes() == 8  # CPU slices stay as they are
    with pytest.raises(NotImplementedError, match="Slicing a tpu storage"):
        s[8:16]
    v = torch.empty(0, dtype=torch.uint8, device="tpu").set_(s, 8, (8,))
    assert bytes(v.cpu().numpy()) == bytes(cs)[8:16]
    v.zero_()
    assert t.cpu().tolist() == [0.0, 16.0, 0.0, 0.0, 4.0, 5.0, 6.0, 7.0]


def _lazy_clone_story(device):
    """Tensor._lazy_clone (copy-on-write) written through a view of its source, then itself, as
    test_torch.py's test_lazy_clone_view_materialize does: what each side holds and which is copy-on-write."""
    t = torch.tensor([[0.0, 1.0], [2.0, 3.0]], device=device)
    original = torch._C._data_address(t)
    clone = t._lazy_clone()
    seen = [torch._C._is_cow_tensor(t), torch._C._is_cow_tensor(clone)]
    view = t.view([4])
    view += 1  # the source is copied; the clone keeps the original allocation
    seen += [torch._C._is_cow_tensor(t), torch._C._is_cow_tensor(clone), torch._C._data_address(clone) == original,
             torch._C._data_address(t) == torch._C._data_address(view) != original]
    clone += 10  # the last holder of the original allocation takes it without a copy
    seen += [torch._C._is_cow_tensor(clone), torch._C._data_address(clone) == original]
    again = clone._lazy_clone()
    clone.mul_(2)  # a second clone, read after its source was written
    return seen, [x.cpu() for x in (t, view, clone, again)]


def test_lazy_clone_is_copy_on_write_like_cpu():
    seen, values = _lazy_clone_story("tpu")
    cpu_seen, cpu_values = _lazy_clone_story("cpu")
    assert seen == cpu_seen
    for got, want in zip(values, cpu_values):
        assert torch.equal(got, want)
