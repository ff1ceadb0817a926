"""Shared test setup: 4 XLA:CPU devices, and the one CPU-comparison helper."""
from __future__ import annotations

import contextlib
import os

# Multi-device tests run on one CPU; must be set before the runtime starts.
os.environ.setdefault("TORCH_TPU_NUM_CPU_DEVICES", "4")
# Tests never touch the user's compile cache: its persistent levels are off unless
# a test turns them on with its own directories (tests/test_cache.py).
os.environ.setdefault("TORCH_TPU_CACHE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import torch_tpu  # noqa: E402,F401

TPU = torch.device("tpu:0")

# Source defining an op with a CPU kernel only: it stays unlowered whatever the op families grow
# to cover, so the CPU-fallback tests (in-process and in subprocesses) always have one.
UNLOWERED_OP_SOURCE = (
    "import torch\n"
    "_lib = torch.library.Library('tpu_test', 'FRAGMENT')\n"
    "_lib.define('unlowered(Tensor x) -> Tensor')\n"
    "_lib.impl('unlowered', lambda x: x * 2 + 1, 'CPU')\n"
)


@pytest.fixture(autouse=True)
def _highest_precision():
    """Compare float32 against CPU at full precision unless a test says otherwise."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.fixture(scope="session")
def run_compile_cache(tmp_path_factory, worker_id):
    """A compile-cache directory (level 2) shared by every pytest-xdist worker of this test run: in the run's
    own temporary root, which pytest prunes with it (it keeps the last 3 runs)."""
    root = tmp_path_factory.getbasetemp()
    path = (root.parent if worker_id != "master" else root) / "compile-cache"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def to_tpu(tree, device=TPU):
    def move(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().to(device)
            return y.requires_grad_(x.requires_grad)
        return x

    return pytree.tree_map(move, tree)


def to_cpu(tree):
    return pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, tree)


def assert_close_tree(actual, expected, atol=1e-5, rtol=1e-5, equal_nan=True):
    a_leaves, a_spec = pytree.tree_flatten(to_cpu(actual))
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"structure differs: {a_spec} vs {e_spec}"
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor)
            assert a.dtype == e.dtype, f"dtype {a.dtype} != {e.dtype}"
            assert a.shape == e.shape, f"shape {tuple(a.shape)} != {tuple(e.shape)}"
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=equal_nan)
        elif isinstance(e, float):
            assert a == pytest.approx(e, rel=rtol, abs=atol, nan_ok=True)
        else:
            assert a == e


def assert_matches_cpu(fn, *args, grads: bool = False, atol=1e-5, rtol=1e-5, device=TPU):
    """fn(*args) on tpu equals fn(*args) on CPU (and so do input gradients if grads=True)."""
    cpu_args = pytree.tree_map(lambda x: x.detach().clone().requires_grad_(x.requires_grad)
                               if isinstance(x, torch.Tensor) else x, args)
    tpu_args = to_tpu(args, device)
    expected = fn(*cpu_args)
    actual = fn(*tpu_args)
    for leaf in pytree.tree_leaves(actual):
        if isinstance(leaf, torch.Tensor):
            assert leaf.device.type == "tpu", f"result on {leaf.device}, expected tpu"
    assert_close_tree(actual, expected, atol, rtol)
    if grads:
        def backward(out, inputs):
            leaves = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            total = sum((o.float() * (i + 1)).sum() for i, o in enumerate(leaves))
            total.backward()
            return [x.grad for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]

        assert_close_tree(backward(actual, tpu_args), backward(expected, cpu_args), atol, rtol)
    return actual


@contextlib.contextmanager
def no_fallback():
    """Run the block with TORCH_TPU_FALLBACK=error semantics: an op that would fall back to CPU raises."""
    from torch_tpu.config import config

    previous = config.fallback
    config.fallback = "error"
    try:
        yield
    finally:
        config.fallback = previous


# The OpInfo sweep's chunks (tests/test_opinfo.py::test_opinfo_sweep[MODE-KofN]) and the error corpus's are
# pytest-xdist work units of their own under --dist loadfile, so they spread over the workers; every other test
# keeps one process per file (tests in a file share module state). docs/ops.md: how the sweep is split.
_OWN_UNIT = ("tests/test_opinfo.py::test_opinfo_sweep[", "tests/test_error_corpus.py::test_error_corpus_raises_pytorchs_types[")

# Units that take minutes, handed out first (longest first, as measured in CI), so that no worker starts one
# while the other has finished: xdist's own order (most tests first) put the OpInfo quick sweep last in the
# DeferAndFuse pass, where it ran alone for minutes. The sweep's chunks keep their order (float32 before
# float32_backward, whose forward programs the shared compile cache then holds).
_LONG_UNITS = ("tests/test_opinfo.py::test_opinfo_sweep[", "tests/test_error_corpus.py::", "tests/test_huggingface_zoo.py",
               "tests/test_models.py", "tests/test_nn_ops.py", "tests/test_opinfo.py", "tests/test_huggingface_examples.py",
               "tests/test_compile.py", "tests/test_distributed.py", "tests/test_defer.py", "tests/test_cache.py",
               "tests/test_op_regressions.py", "tests/test_training.py")


def _long_rank(scope):
    return next((i for i, prefix in enumerate(_LONG_UNITS) if scope.startswith(prefix)), len(_LONG_UNITS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CIScheduling(LoadFileScheduling):
        _ordered = False

        def _split_scope(self, nodeid):
            return nodeid if nodeid.startswith(_OWN_UNIT) else super()._split_scope(nodeid)

        def _assign_work_unit(self, node):
            if not self._ordered:  # the work queue is complete before the first unit is handed out
                self._ordered = True
                for scope in sorted(self.workqueue, key=_long_rank):  # stable: xdist's order within a rank
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return CIScheduling(config, log)
