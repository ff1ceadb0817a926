"""The strict executor: cached programs, runtime scalars, async execution, debug mode."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import assert_close_tree
from torch_tpu import metrics
from torch_tpu.eager import executor


def test_one_program_per_signature():
    """The same op on the same metadata compiles once; new shapes compile anew."""
    x = torch.ones(17, device="tpu")
    (x * 2).cpu()
    compiled = metrics.counts.programs_compiled
    for _ in range(5):
        x = x * 2
    assert metrics.counts.programs_compiled == compiled
    (torch.ones(18, device="tpu") * 2).cpu()
    assert metrics.counts.programs_compiled > compiled


def test_float_scalars_are_runtime_inputs():
    """A changing Python float (a learning rate) does not recompile."""
    p = torch.ones(33, device="tpu")
    g = torch.full((33,), 0.5, device="tpu")
    p.add_(g, alpha=-0.1)
    p.mul_(0.5)
    compiled = metrics.counts.programs_compiled
    for step in range(10):
        p.add_(g, alpha=-0.1 / (step + 1))
        p.mul_(1 - 0.01 * step)
    assert metrics.counts.programs_compiled == compiled
    expected = torch.ones(33)
    gc = torch.full((33,), 0.5)
    expected.add_(gc, alpha=-0.1)
    expected.mul_(0.5)
    for step in range(10):
        expected.add_(gc, alpha=-0.1 / (step + 1))
        expected.mul_(1 - 0.01 * step)
    torch.testing.assert_close(p.cpu(), expected)


def test_negative_zero_scalar_is_not_positive_zero():
    """-0.0 == 0.0 as a cache key; the device scalar of one must not serve the other (1/(x*-0.0) is -inf)."""
    x = torch.ones(3, device="tpu")
    for _ in range(3):  # repeated: the Strict hit path, DeferAndFuse's repeated graph reusing its scalars
        for scale in (0.0, -0.0, 0.0, -0.0):
            got = (1 / (x * scale)).cpu()
            torch.testing.assert_close(got, 1 / (torch.ones(3) * scale))
            assert torch.signbit(got).tolist() == [str(scale) == "-0.0"] * 3


def test_async_returns_before_result_is_needed():
    """Ops return without waiting: no device->host transfer until a materialization point."""
    transfers = metrics.counts.d2h_transfers
    x = torch.randn(64, 64, device="tpu")
    for _ in range(10):
        x = torch.tanh(x @ x)
    assert metrics.counts.d2h_transfers == transfers
    x.sum().item()
    assert metrics.counts.d2h_transfers == transfers + 1


def test_view_read_op_and_writeback_are_one_program():
    """An in-place op on a strided view runs as one program (no separate gather/scatter ops)."""
    base = torch.zeros(8, 8, device="tpu")
    torch.tpu.synchronize()  # DeferAndFuse runs recorded ops here: count only the add_
    before = metrics.counts.ops_executed
    base[::2, 1::3].add_(1.0)
    torch.tpu.synchronize()
    assert metrics.counts.ops_executed == before + 1


def _run(code, tmp_path=None, **env):
    full_env = dict(os.environ, **env)
    if tmp_path is None:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)
    script = tmp_path / "script.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=full_env, timeout=300)


DEBUG_SCRIPT = """
import torch, torch_tpu
from torch_tpu import metrics
x = torch.ones(3, device='tpu')
y = x + 1
print("waits", metrics.counts.synchronous_waits)
z = x @ torch.ones(4, 4, device='tpu')  # FAILING_LINE
"""


def test_debug_mode_waits_and_raises_at_failing_line(tmp_path):
    """TORCH_TPU_LAUNCH_BLOCKING=1: each op waits for its result; the failing line is in the traceback."""
    out = _run(DEBUG_SCRIPT, tmp_path, TORCH_TPU_LAUNCH_BLOCKING="1")
    assert out.returncode != 0
    assert "FAILING_LINE" in out.stderr and "RuntimeError" in out.stderr
    waits = int(out.stdout.split("waits")[1].split()[0])
    assert waits >= 1
    strict = _run(DEBUG_SCRIPT, tmp_path, TORCH_TPU_LAUNCH_BLOCKING="0")
    assert int(strict.stdout.split("waits")[1].split()[0]) == 0


def test_bad_env_value_is_a_clear_error():
    out = _run("import torch, torch_tpu", TORCH_TPU_LAUNCH_BLOCKING="maybe")
    assert out.returncode != 0 and "TORCH_TPU_LAUNCH_BLOCKING" in out.stderr


def test_program_cache_is_keyed_by_layout():
    """Contiguous and transposed inputs are different signatures with the right results."""
    a = torch.arange(6.0).view(2, 3)
    for t in (a, a.t()):
        out = (t.to("tpu") if t.is_contiguous() else a.to("tpu").t()) + 1
        assert torch.equal(out.cpu(), t + 1)
    keys = [k for k in executor.programs if k[0] == "aten.add.Tensor"]
    assert len(keys) >= 2


def test_metrics_report_mentions_everything():
    """The report lists ops, compiles, cache hits, transfers and fallbacks."""
    report = metrics.report()
    for word in ("ops executed", "programs compiled", "cache hits", "host->device", "device->host", "CPU fallbacks"):
        assert word in report
    counters = metrics.counters()
    assert counters["ops_executed"] > 0
    metrics.reset()
    assert metrics.counters()["ops_executed"] == 0


def test_python_execute_takes_the_native_hit_path():
    """executor.execute (where a kernel goes when its native call misses) serves a cached program natively."""
    import torch_tpu
    from torch_tpu import _native
    from torch_tpu.eager.opspec import spec
    from torch_tpu.ops import registry

    x, y = torch.ones(3, device="tpu"), torch.full((3,), 2.0, device="tpu")
    with torch_tpu.execution_mode("strict"):
        (x + y).cpu()  # compiles and caches the program
        before = _native.fast_op_count()
        out = executor.execute(spec(torch.ops.aten.add.Tensor), registry.get(torch.ops.aten.add.Tensor), False, x, y)
        assert _native.fast_op_count() == before + 1
    torch.testing.assert_close(out.cpu(), torch.full((3,), 3.0))


def test_boxed_kernels_serve_cache_hits_like_the_python_path():
    """Cache hits run in the boxed C++ kernels: in-place on views, list and multi-output returns,
    wrapped numbers, static scalars and dtype arguments give CPU's results, each counted as a hit."""
    import torch_tpu
    from torch_tpu import _native

    a = torch.randn(4, 6)
    cases = [
        lambda t: t * 1.5 - 2,  # wrapped numbers (runtime scalars)
        lambda t: t[1:].add_(1.0, alpha=3),  # in-place on a view: returns its argument
        lambda t: torch.topk(t, 2, dim=1),  # two fresh outputs
        lambda t: torch._foreach_mul([t, t[0]], 2.0),  # a list return
        lambda t: t.sum(dim=1, dtype=torch.float64),  # a dtype argument, static ints
        lambda t: torch.cat([t, t.t().contiguous().view(4, 6)], 0),  # a tensor list
        lambda t: torch.nn.functional.leaky_relu(t, 0.2),  # a static scalar lowering
    ]
    with torch_tpu.execution_mode("strict"):
        for case in cases:
            for _ in range(2):  # the second call is a cache hit
                t = a.to("tpu")
                before = _native.fast_op_count()
                got = case(t)
                hits = _native.fast_op_count() - before
                expected_input = a.clone()
                expected = case(expected_input)
                assert_close_tree(got, expected)
                torch.testing.assert_close(t.cpu(), expected_input)  # what it wrote, through views too
            assert hits >= 1, case


def test_forgetting_programs_forgets_the_boxed_kernels_entries():
    """executor.programs.clear() sends the next call back through the Python path (it recompiles)."""
    import torch_tpu

    x = torch.randn(5, device="tpu")
    with torch_tpu.execution_mode("strict"), torch_tpu.cache.configured(enabled=False):
        (x * 3.0).cpu()
        (x * 3.0).cpu()
        executor.programs.clear()
        misses = metrics.counts.cache_misses
        torch.testing.assert_close((x * 3.0).cpu(), x.cpu() * 3.0)
        assert metrics.counts.cache_misses == misses + 1


def test_prepared_ops_hit_in_their_boxed_kernels():
    """Advanced indexing, repeat_interleave.Tensor and det/slogdet keep their boxed C++ kernels: a
    repeated call is a native cache hit that never enters the Python path, and calls that need a
    preparation (boolean masks, CPU index tensors, no output_size) still give CPU's results."""
    import torch_tpu
    from torch_tpu import _native
    from torch_tpu.eager import kernels

    aten = torch.ops.aten
    a = torch.randn(5, 4)
    m = torch.randn(3, 4, 4)
    index, mask, repeats = torch.tensor([4, 0, 2]), a[:, 0] > 0, torch.tensor([2, 0, 3, 1])

    def put(t, idx, value):
        t[idx] = value
        return t

    # (op, call on (tensor, index-like), whether its second call is a native hit)
    cases = [
        (aten.index.Tensor, lambda t, d: t[index.to(d)], True),
        (aten.index.Tensor, lambda t, d: t[index.to(d), 1:], True),
        (aten.index.Tensor, lambda t, d: t[mask.to(d)], False),  # nonzero: a size read first
        (aten.index.Tensor, lambda t, d: t[index], False),  # a CPU index tensor for a device tensor
        (aten.index_put_.default, lambda t, d: put(t, index.to(d), 7.0), True),
        (aten.index_put_.default, lambda t, d: put(t, mask.to(d), -1.0), True),  # a mask, one value: no size read
        (aten.index_put_.default, lambda t, d: put(t, mask.to(d), t[mask.to(d)] * 2), False),
        (aten.repeat_interleave.Tensor, lambda t, d: torch.repeat_interleave(repeats.to(d), output_size=6), True),
        (aten.repeat_interleave.Tensor, lambda t, d: torch.repeat_interleave(repeats.to(d)), False),
        (aten._linalg_det.default, lambda t, d: torch.linalg.det(m.to(d)), True),  # contiguous: LU of A^T
        (aten._linalg_det.default, lambda t, d: torch.linalg.det(m.to(d).mT), True),  # not: LU of A
        (aten._linalg_slogdet.default, lambda t, d: torch.linalg.slogdet(m.to(d)), True),
        (aten._linalg_det.default, lambda t, d: aten._linalg_det(m.to(d)), True),  # det, LU, pivots
    ]
    kernels.register_all()
    with torch_tpu.execution_mode("strict"):
        for op, case, native in cases:
            kernel = kernels._kernels[op]
            assert isinstance(kernel, _native.OpKernel), op  # registered boxed, not behind a Python wrapper
            python_calls = []
            slow = kernel.slow

            def counted(*args, **kwargs):
                python_calls.append(1)
                return slow(*args, **kwargs)

            kernel.slow = counted
            try:
                for _ in range(2):
                    python_calls.clear()
                    t = a.to("tpu")
                    got = case(t, "tpu")
                    expected_input = a.clone()
                    assert_close_tree(got, case(expected_input, "cpu"), atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(t.cpu(), expected_input)
            finally:
                kernel.slow = slow
            assert (not python_calls) == native, (op, python_calls)
