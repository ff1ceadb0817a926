"""from_pretrained onto tpu: what device_map="auto" does (and the public alternatives), weights
landing on tpu with no CPU copy left alive, and Transformers' threaded loading bit-exact against
its sequential loading and the saved CPU weights. Tiny model from a config; nothing downloaded."""
from __future__ import annotations

import gc
import os
import sys
import threading

import pytest
import torch

tf = pytest.importorskip("transformers")

import torch_tpu  # noqa: E402,F401
from torch_tpu.runtime import transfer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_zoo  # noqa: E402

tf.logging.set_verbosity_error()

TPU = torch.device("tpu", 0)
# Transformers 5.24 (core_model_loading.convert_and_load_state_dict_in_model) loads through a
# thread pool unless this is true.
SEQUENTIAL = "HF_DEACTIVATE_ASYNC_LOAD"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama2")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_zoo.shrink("llama", num_hidden_layers=2)).eval()
    model.save_pretrained(path)
    return str(path), {k: v.clone() for k, v in model.state_dict().items()}


def _load(path, **kwargs):
    return tf.AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _assert_bit_exact(model, expected):
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].device == TPU, f"{name} on {got[name].device}"
        assert got[name].dtype == value.dtype and torch.equal(got[name].cpu(), value), name


def _live_cpu_tensors():
    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.device.type == "cpu"]


def _new_cpu_copies(path, device_map):
    """CPU tensors created by a load that are still alive after it, whose numel is a parameter's."""
    before = _live_cpu_tensors()  # kept alive so no new tensor reuses one of their ids
    seen = {id(t) for t in before}
    model = _load(path, device_map=device_map)
    sizes = {p.numel() for p in model.parameters()}
    left = [t for t in _live_cpu_tensors() if id(t) not in seen and t.numel() in sizes]
    return model, left


def test_device_map_auto_alone_sees_no_tpu(saved):
    # No public hook makes "auto" see a PrivateUse1 device (docs/huggingface.md, "device_map=auto"):
    # Accelerate 1.15's get_max_memory counts torch.cuda devices in its fallback branch. This
    # notices when Accelerate learns to count tpu. max_memory={0: ...} places on tpu (tested in
    # test_huggingface.py), and so does a device context (below).
    path, _ = saved
    assert {p.device for p in _load(path, device_map="auto").parameters()} == {torch.device("cpu")}


def test_device_context_without_device_map_loads_onto_tpu(saved):
    # Transformers' public rule: with no device_map, the torch.device context (or
    # torch.set_default_device) is the device map.
    path, expected = saved
    with torch.device("tpu"):
        model = _load(path)
    _assert_bit_exact(model, expected)


def test_weights_land_on_tpu_with_no_cpu_copy_alive(saved):
    path, expected = saved
    model, left = _new_cpu_copies(path, "tpu")
    _assert_bit_exact(model, expected)
    assert left == [], [tuple(t.shape) for t in left]
    # The scan sees what a load keeps on CPU: the same load with device_map="cpu" leaves every weight.
    cpu_model, cpu_left = _new_cpu_copies(path, "cpu")
    assert len(cpu_left) >= len(list(cpu_model.parameters()))


def _net_cpu_bytes_of_load(path, device_map):
    """Bytes the CPU allocator handed out during a load and did not get back (torch.profiler's
    memory accounting: sees storages held from C++ too, which the gc scan cannot)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        model = _load(path, device_map=device_map)
    return model, sum(e.self_cpu_memory_usage for e in prof.key_averages())


def test_load_onto_tpu_keeps_no_cpu_allocation(saved):
    path, expected = saved
    model, net = _net_cpu_bytes_of_load(path, "tpu")
    _assert_bit_exact(model, expected)
    smallest = min(p.numel() * p.element_size() for p in model.parameters())
    assert net < smallest, net
    # The accounting sees a load that stays on CPU: every weight's bytes.
    cpu_model, cpu_net = _net_cpu_bytes_of_load(path, "cpu")
    assert cpu_net >= sum(p.numel() * p.element_size() for p in cpu_model.parameters())


@pytest.mark.parametrize("sequential", [False, True], ids=["threaded", "sequential"])
def test_threaded_and_sequential_loading_bit_exact(saved, sequential, monkeypatch):
    path, expected = saved
    threads = set()
    upload = transfer.upload

    def recording_upload(src, device):  # our own upload: which threads copy weights onto tpu
        threads.add(threading.get_ident())
        return upload(src, device)

    monkeypatch.setattr(transfer, "upload", recording_upload)
    if sequential:
        monkeypatch.setenv(SEQUENTIAL, "1")
    else:
        monkeypatch.delenv(SEQUENTIAL, raising=False)
    model = _load(path, device_map="tpu")
    _assert_bit_exact(model, expected)
    workers = threads - {threading.main_thread().ident}
    assert bool(workers) != sequential, threads
