"""DeferAndFuse's native recorder (csrc/native.cpp): seen signatures are recorded without Python.

Counters are asserted (`ops_recorded_python` counts the ops the Python recorder took), never
time; every value is compared against PyTorch on CPU.
"""
import threading

import pytest
import torch

import torch_tpu
from torch_tpu import _native, metrics
from torch_tpu.eager import defer, valuecheck


def _mlp_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_repeated_training_step_records_natively():
    """After warm-up a DeferAndFuse training step (forward, backward, AdamW) records no op in Python,
    and its losses and weights match the same steps on CPU."""
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model.load_state_dict(cpu_model.state_dict())
    model = model.to("tpu")
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    tx, ty = x.to("tpu"), y.to("tpu")
    losses, cpu_losses = [], []
    with torch_tpu.defer_and_fuse():
        assert _native.defer_path_enabled()
        for step in range(5):
            if step == 3:  # warmed up: every signature of the step has its program
                python_before = metrics.counts.ops_recorded_python
                deferred_before = metrics.counts.ops_deferred
            losses.append(_mlp_step(model, opt, tx, ty))
            cpu_losses.append(_mlp_step(cpu_model, cpu_opt, x, y))
        python_after = metrics.counts.ops_recorded_python
        deferred_after = metrics.counts.ops_deferred
    assert python_after == python_before, f"ops went through the Python recorder: {_native.defer_fallbacks()}"
    assert deferred_after - deferred_before > 20  # both steps were recorded (natively)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_native_nodes_match_python_nodes():
    """A natively recorded node is the node the Python recorder makes: program, wiring, scalars,
    the user's line, and the same fingerprint bytes (so both share one plan)."""
    x = torch.randn(16, device="tpu")
    y = torch.randn(16, device="tpu")
    torch.tpu.synchronize()
    graphs = []
    with torch_tpu.defer_and_fuse():
        for _ in range(2):
            before = metrics.counts.ops_recorded_python
            z = x * 2.5 + y  # THE_LINE
            z.mul_(0.5)
            graph = defer._graph
            graphs.append((metrics.counts.ops_recorded_python - before,
                           [(n.prog, n.refs, list(n.scalars), n.device, n.where) for n in graph.nodes],
                           bytes(graph.descs)))
            expected = (x.cpu() * 2.5 + y.cpu()) * 0.5
            torch.testing.assert_close(z.cpu(), expected)
    (first_python, first_nodes, first_descs), (second_python, second_nodes, second_descs) = graphs
    assert second_python == 0 and first_python >= 1  # the second round was recorded natively
    assert second_nodes == first_nodes and second_descs == first_descs
    code, line = second_nodes[0][4]
    assert code.co_filename == __file__
    with open(__file__) as f:
        assert "THE_LINE" in f.read().splitlines()[line - 1]


def test_views_and_in_place_ops_record_natively_and_match_cpu():
    """Views with storage offsets, in-place updates of a view (a pending base), list returns."""
    base_cpu = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    results = []
    with torch_tpu.defer_and_fuse():
        for _ in range(3):
            base = base_cpu.to("tpu")
            before = metrics.counts.ops_recorded_python
            row = base[2]
            row.add_(1.5)
            parts = torch.split(base * 2, 2, dim=1)
            total = parts[1].sum() + base.t()[1:3].exp().mean()
            results.append((metrics.counts.ops_recorded_python - before, base.cpu(), total.cpu()))
    expected = base_cpu.clone()
    expected[2].add_(1.5)
    parts = torch.split(expected * 2, 2, dim=1)
    expected_total = parts[1].sum() + expected.t()[1:3].exp().mean()
    for _, value, total in results:
        torch.testing.assert_close(value, expected)
        torch.testing.assert_close(total, expected_total)
    assert results[-1][0] == 0


def test_a_thread_waits_for_the_graph_lock():
    """While another thread holds the recorder's lock, an op is recorded after it is released
    (the native recorder gives way to the Python one, which waits), with correct results."""
    x = torch.ones(8, device="tpu")
    with torch_tpu.defer_and_fuse():
        (x * 3).cpu()  # the signature is seen
        out = {}
        defer.lock.acquire()
        try:
            worker = threading.Thread(target=lambda: out.setdefault("y", (x * 3).cpu()))
            worker.start()
            worker.join(timeout=0.5)
            assert worker.is_alive()  # it waits for the lock rather than recording beside it
        finally:
            defer.lock.release()
        worker.join(timeout=60)
        assert not worker.is_alive()
    torch.testing.assert_close(out["y"], torch.full((8,), 3.0))


@pytest.mark.one_mode
def test_recorder_lock_is_a_reentrant_lock():
    """defer.lock (native, so the recorder takes it without Python) behaves as threading.RLock: reentrant
    in its thread, refused to others (non-blocking, or after a timeout) until fully released; releasing
    a lock the thread does not hold is PyTorch-style RuntimeError, not a crash."""
    lock = _native.RecorderLock()
    assert lock.acquire() and lock.acquire(blocking=False)  # reentrant
    other = {}

    def try_from_another_thread():
        other["nonblocking"] = lock.acquire(blocking=False)
        other["timed"] = lock.acquire(timeout=0.05)

    worker = threading.Thread(target=try_from_another_thread)
    worker.start()
    worker.join(timeout=30)
    assert other == {"nonblocking": False, "timed": False}
    lock.release()
    worker = threading.Thread(target=try_from_another_thread)
    worker.start()
    worker.join(timeout=30)
    assert other == {"nonblocking": False, "timed": False}  # still held once
    lock.release()
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()
    got = []
    worker = threading.Thread(target=lambda: got.append(lock.acquire(timeout=5)) or lock.release())
    with lock:  # a waiting thread gets it once the block ends
        worker.start()
        worker.join(timeout=0.1)
        assert worker.is_alive()
    worker.join(timeout=30)
    assert got == [True]


@pytest.mark.one_mode
def test_recorder_lock_in_a_fork_child():
    """A fork child (a DataLoader worker) keeps what its forking thread held, as with RLock, and its
    lock works there: held by the parent's thread it is reentrant in the child, free it is free."""
    import os

    held, free = _native.RecorderLock(), _native.RecorderLock()
    held.acquire()
    pid = os.fork()
    if pid == 0:  # the child: only the lock machinery, no device work
        ok = held.acquire(blocking=False) and free.acquire(blocking=False)
        held.release(), held.release(), free.release()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    held.release()
    assert os.waitstatus_to_exitcode(status) == 0


def test_recording_is_native_again_once_the_lost_tensor_is_freed():
    """A failed value check marks its result lost, which sends ops to the Python recorder (it raises for
    lost inputs); freeing that tensor clears the flag by itself, and the next ops record natively."""
    x = torch.arange(16.0, device="tpu").reshape(4, 4)
    index = torch.tensor([[9]], device="tpu")
    with torch_tpu.defer_and_fuse():
        (x * 2).cpu()  # the signature is seen
        with pytest.raises(RuntimeError, match="out of bounds"):
            out = torch.gather(x, 1, index)
            out.cpu()
        assert valuecheck.any_lost
        before = metrics.counts.ops_recorded_python
        (x * 2).cpu()
        assert metrics.counts.ops_recorded_python == before + 1  # while `out` lives, the Python recorder
        del out
        before = metrics.counts.ops_recorded_python
        results = [(x * 2).cpu() for _ in range(3)]
        assert metrics.counts.ops_recorded_python == before, _native.defer_fallbacks()
        assert not valuecheck.any_lost
    for result in results:
        torch.testing.assert_close(result, torch.arange(16.0).reshape(4, 4) * 2)
