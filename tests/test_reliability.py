"""Bad input never crashes the process and never returns a silently wrong result (issue 13).

Crash cases run in subprocesses: a segfault there is a failed test, not a dead test run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch


def _run(source: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    full = dict(os.environ, **(env or {}))
    full.pop("PYTEST_CURRENT_TEST", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], env=full, capture_output=True, text=True,
                          timeout=timeout)


_CHOLESKY = """
    import torch
    good = torch.linalg.cholesky_ex(torch.eye(3, device="tpu") * 4)
    assert good[0].cpu().equal(torch.eye(3) * 2) and good[1].item() == 0
    factor, info = torch.linalg.cholesky_ex(-torch.eye(3, device="tpu"))
    assert info.item() == 1, info
    try:
        torch.linalg.cholesky(-torch.eye(3, device="tpu"))
    except torch.linalg.LinAlgError as err:
        assert "not positive-definite" in str(err) and "order 1" in str(err), err
    else:
        raise AssertionError("no LinAlgError")
    assert (torch.ones(2, device="tpu") * 3).tolist() == [3.0, 3.0]
    print("OK")
"""


@pytest.mark.one_mode  # sets its subprocesses' mode itself
@pytest.mark.parametrize("mode", ["strict", pytest.param("debug", marks=pytest.mark.heavy)])
def test_cholesky_from_compile_cache_does_not_crash(tmp_path, mode):
    """The segfault of issue 13: a LAPACK custom call loaded from the compile cache ran before
    jaxlib had filled its function pointers. The second process loads every program from the cache."""
    env = {"TORCH_TPU_CACHE": "1", "TORCH_TPU_CACHE_DIR": str(tmp_path / "cache"),
           "TORCH_TPU_LAUNCH_BLOCKING": "1" if mode == "debug" else "0", "TORCH_TPU_DEFER_AND_FUSE": "0"}
    for attempt in ("compiles", "loads"):
        result = _run(_CHOLESKY, env)
        assert result.returncode == 0 and "OK" in result.stdout, (attempt, result.returncode, result.stderr[-3000:])


# ------------------------------------------------------------------ value checks
import gc  # noqa: E402

import torch_tpu  # noqa: E402

F = torch.nn.functional
MODES = ("strict", "debug", "defer_and_fuse")
# These tests switch modes themselves (all three each): CI's second pass under DeferAndFuse adds nothing.
_all_modes = pytest.mark.one_mode


def _t(value, device):
    return torch.tensor(value, device=device)


# Each case gets fresh inputs on `device` (the same values on CPU and tpu) and returns the op's result.
CASES = {
    "gather": lambda d: torch.gather(torch.arange(16.0, device=d).reshape(4, 4), 1, _t([[9]], d)),
    "index_select": lambda d: torch.index_select(torch.arange(16.0, device=d).reshape(4, 4), 0, _t([7], d)),
    "cross_entropy": lambda d: F.cross_entropy(torch.linspace(-1, 1, 6, device=d).reshape(2, 3), _t([0, 5], d)),
    "multinomial": lambda d: torch.multinomial(_t([-1.0, 2.0], d), 1),
    "multinomial_zero_sum": lambda d: torch.multinomial(_t([0.0, 0.0], d), 1),
    "index": lambda d: torch.arange(16.0, device=d).reshape(4, 4)[_t([1, -7], d)],
    "index_put": lambda d: torch.zeros(4, device=d).index_put_((_t([4], d),), _t(1.0, d)),
    "embedding": lambda d: F.embedding(_t([[1, 5]], d), torch.ones(4, 3, device=d)),
    "take": lambda d: torch.take(torch.arange(4.0, device=d), _t([-5], d)),
    "scatter_add": lambda d: torch.zeros(2, 3, device=d).scatter_add_(1, _t([[3]], d), torch.ones(1, 1, device=d)),
    "nll_loss": lambda d: F.nll_loss(torch.zeros(2, 3, device=d), _t([1, -2], d)),
    "bernoulli": lambda d: torch.bernoulli(_t([0.5, 1.5], d)),
    "index_add": lambda d: torch.zeros(3, device=d).index_add_(0, _t([3], d), torch.ones(1, device=d)),
    "one_hot": lambda d: F.one_hot(_t([0, 5], d), 3),
    "one_hot_negative": lambda d: F.one_hot(_t([[0], [-1]], d), 3),
    "masked_scatter": lambda d: torch.zeros(4, device=d).masked_scatter_(_t([True, False, True, True], d),
                                                                         torch.ones(2, device=d)),
}


def _read(result):
    for leaf in (result if isinstance(result, (tuple, list)) else [result]):
        leaf.cpu()


def _cpu_error(case):
    try:
        CASES[case]("cpu")
    except Exception as err:
        return err
    raise AssertionError(f"{case} does not raise on CPU")


def _device_works():
    a = torch.arange(6.0, device="tpu")
    assert (a * 2 + 1).tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert torch.gather(a.reshape(2, 3), 1, _t([[2], [0]], "tpu")).tolist() == [[2.0], [3.0]]


@_all_modes
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_values_raise_like_cpu(case, mode):
    """PyTorch's exception type and message; Debug raises at the op, the others at the next read."""
    expected = _cpu_error(case)
    gc.collect()
    torch.tpu.synchronize()
    baseline = torch.tpu.memory_allocated()
    at_op = False
    with torch_tpu.execution_mode(mode):
        with pytest.raises(Exception) as info:
            at_op = True
            result = CASES[case]("tpu")
            at_op = False
            _read(result)
        assert type(info.value) is type(expected), (info.value, expected)
        assert str(info.value).splitlines()[0] == str(expected).splitlines()[0]
        # The error names the op and the line that launched it.
        assert "a value check of aten." in str(info.value) or "a value check of torch_tpu." in str(info.value) and "test_reliability.py" in str(info.value)
        assert at_op == (mode == "debug")  # Debug: at the op; Strict/DeferAndFuse: at the read
        _device_works()
    info = result = None
    gc.collect()
    torch.tpu.synchronize()
    assert torch.tpu.memory_allocated() == baseline


# Checks of Python scalars: ATen makes them on the host, so they raise at the call on every device.
SCALAR_CASES = {
    "uniform_ from > to": lambda d: torch.empty(3, device=d).uniform_(42, -42),
    "uniform_ to - from": lambda d: torch.empty(3, device=d).uniform_(-3e38, 3e38),
    "uniform_ from out of bounds": lambda d: torch.empty(3, dtype=torch.float16, device=d).uniform_(-7e4, 0),
    "uniform_ empty": lambda d: torch.empty(0, device=d).uniform_(3, 1),
    "uniform_ complex": lambda d: torch.empty(3, dtype=torch.complex64, device=d).uniform_(3, 1),
    "normal_ std": lambda d: torch.empty(3, device=d).normal_(0, -1),
    "normal float std": lambda d: torch.normal(torch.zeros(2, device=d), -1.0),
    "normal sized": lambda d: torch.normal(0.0, float("nan"), (3,), device=d),
    "bernoulli_ p": lambda d: torch.empty(3, device=d).bernoulli_(1.5),
    "bernoulli p": lambda d: torch.bernoulli(torch.empty(3, device=d), -0.5),
    "randperm half": lambda d: torch.randperm(2**11 + 2, out=torch.empty(0, dtype=torch.half, device=d)),
    "randperm uint8": lambda d: torch.randperm(257, dtype=torch.uint8, device=d),
}


@_all_modes
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(SCALAR_CASES))
def test_bad_python_scalars_raise_at_the_call(case, mode):
    with pytest.raises(RuntimeError) as cpu_error:
        SCALAR_CASES[case]("cpu")
    with torch_tpu.execution_mode(mode):
        with pytest.raises(RuntimeError) as tpu_error:
            SCALAR_CASES[case]("tpu")  # no read: raised before anything is launched or recorded
        assert str(tpu_error.value) == str(cpu_error.value)
        _device_works()


@_all_modes
@pytest.mark.parametrize("mode", MODES)
def test_failed_results_are_not_values(mode):
    """A failed op's results raise when read or used, again and again; its inputs stay valid."""
    x = torch.arange(16.0, device="tpu").reshape(4, 4)
    with torch_tpu.execution_mode(mode):
        with pytest.raises(RuntimeError, match="out of bounds"):
            out = torch.gather(x, 1, _t([[9]], "tpu"))
            out.cpu()
        if mode != "debug":  # in Debug the op raised: there is no result to read
            for _ in range(2):
                with pytest.raises(RuntimeError, match="failed a value check"):
                    out.cpu()
            with pytest.raises(RuntimeError, match="failed a value check"):
                (out + 1).cpu()
        assert x.cpu().equal(torch.arange(16.0).reshape(4, 4))
        _device_works()


# In-place ops whose check fails. The bad index comes first: PyTorch's CPU kernels raise before writing
# anything then (with a good index before it they write it, then raise); ours never write on failure.
INPLACE = {
    "index_put_": lambda x, d: x.index_put_((_t([9, 1], d),), _t(5.0, d)),
    "scatter_add_": lambda x, d: x.view(2, 4).scatter_add_(1, _t([[7, 0]], d), torch.ones(1, 2, device=d)),
    "scatter_": lambda x, d: x.view(2, 4).scatter_(1, _t([[7, 0]], d), torch.ones(1, 2, device=d)),
    "index_fill_": lambda x, d: x.index_fill_(0, _t([-11, 2], d), 3.0),
    "index_copy_": lambda x, d: x.index_copy_(0, _t([8, 0], d), torch.ones(2, device=d)),
    "index_add_": lambda x, d: x.index_add_(0, _t([8, 0], d), torch.ones(2, device=d)),
    "put_": lambda x, d: x.put_(_t([8, 0], d), torch.ones(2, device=d)),
}


@_all_modes
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(INPLACE))
def test_failed_inplace_op_leaves_its_tensor_unchanged(case, mode):
    """As on CPU: the error is raised and the written tensor still holds its old values (readable, usable)."""
    cpu = torch.arange(8.0)
    with pytest.raises(Exception) as expected:
        INPLACE[case](cpu, "cpu")
    assert cpu.equal(torch.arange(8.0))
    with torch_tpu.execution_mode(mode):
        x = torch.arange(8.0, device="tpu")
        with pytest.raises(type(expected.value)) as info:
            INPLACE[case](x, "tpu")
            x.cpu()
        assert str(info.value).splitlines()[0] == str(expected.value).splitlines()[0]
        assert x.cpu().equal(torch.arange(8.0))
        assert (x * 2).cpu().equal(torch.arange(8.0) * 2)
        _device_works()


@_all_modes
def test_valid_values_pass_in_every_mode():
    """Checked ops with good values give CPU's results (negative indices where PyTorch takes them)."""
    for mode in MODES:
        with torch_tpu.execution_mode(mode):
            x = torch.arange(16.0).reshape(4, 4)
            i = torch.tensor([[3, 0], [1, -4]])
            assert x.to("tpu")[i.to("tpu")].cpu().equal(x[i])
            assert torch.take(x.to("tpu"), i.to("tpu")).cpu().equal(torch.take(x, i))
            j = i.remainder(4)
            assert torch.gather(x.to("tpu"), 1, j.to("tpu")).cpu().equal(torch.gather(x, 1, j))
            target = torch.tensor([2, -100])
            logits = torch.randn(2, 3)
            torch.testing.assert_close(F.cross_entropy(logits.to("tpu"), target.to("tpu")).cpu(),
                                       F.cross_entropy(logits, target))


def test_value_checks_switch_off():
    """TORCH_TPU_VALUE_CHECKS=0: no flags (XLA's clamped gather returns a value, documented)."""
    result = _run("""
        import torch
        from torch_tpu.eager import valuecheck
        x = torch.arange(16.0, device="tpu").reshape(4, 4)
        print(torch.gather(x, 1, torch.tensor([[9]], device="tpu")).tolist(), valuecheck.counts["checked ops"])
    """, {"TORCH_TPU_VALUE_CHECKS": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["[[3.0]]", "0"]


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.out = torch.nn.Linear(8, 10)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))  # the embedding line: named by the error


@_all_modes
@pytest.mark.parametrize("mode", MODES)
def test_training_loop_fault_at_step_5(mode):
    """Steps 1-4 match CPU; step 5's bad token raises at its first materialization point (loss.item()),
    naming the embedding and the model's line; in Debug at the embedding itself."""
    torch.manual_seed(0)
    cpu_model = _Model()
    tpu_model = _Model().to("tpu")
    tpu_model.load_state_dict(cpu_model.state_dict())
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    tpu_opt = torch.optim.SGD(tpu_model.parameters(), lr=0.1)
    batches = [torch.randint(0, 10, (4, 6)) for _ in range(5)]
    batches[4][2, 3] = 12  # out of range
    targets = [torch.randint(0, 10, (4, 6)) for _ in range(5)]
    reached = []
    with torch_tpu.execution_mode(mode):
        for step, (tokens, target) in enumerate(zip(batches, targets), start=1):
            if step == 5:
                with pytest.raises(IndexError, match="index out of range in self") as info:
                    reached.append("forward")
                    loss = F.cross_entropy(tpu_model(tokens.to("tpu")).flatten(0, 1), target.to("tpu").flatten())
                    loss.backward()
                    reached.append("item")
                    loss.item()
                message = str(info.value)
                assert "aten.embedding" in message and "in forward" in message and "self.emb(tokens)" in message
                assert reached[-1] == ("forward" if mode == "debug" else "item")
                break
            cpu_opt.zero_grad()
            tpu_opt.zero_grad()
            expected = F.cross_entropy(cpu_model(tokens).flatten(0, 1), target.flatten())
            expected.backward()
            cpu_opt.step()
            loss = F.cross_entropy(tpu_model(tokens.to("tpu")).flatten(0, 1), target.to("tpu").flatten())
            loss.backward()
            tpu_opt.step()
            assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-5), step
        _device_works()


@pytest.mark.one_mode  # a torch.compile graph runs the same way in both eager modes (it materializes first)
def test_compiled_graph_value_checks():
    """A torch.compile graph carries its checked ops' flags: a bad index raises PyTorch's error at the next
    read (naming the op), the graph's results are lost, and later calls with good values match CPU."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    tpu_emb = torch.nn.Embedding(10, 4).to("tpu")
    tpu_emb.load_state_dict(emb.state_dict())
    step = torch.compile(lambda tokens: tpu_emb(tokens).sum(-1) * 2)
    good = torch.tensor([1, 2, 3])
    torch.testing.assert_close(step(good.to("tpu")).cpu(), emb(good).sum(-1) * 2)
    with pytest.raises(IndexError, match="index out of range in self") as info:
        out = step(torch.tensor([1, 12, 3], device="tpu"))
        out.cpu()
    assert "aten.embedding.default (in a torch.compile graph)" in str(info.value)
    with pytest.raises(RuntimeError, match="failed a value check"):
        out.cpu()
    torch.testing.assert_close(step(good.to("tpu")).cpu(), emb(good).sum(-1) * 2)
    _device_works()
