"""torch.compile on tpu, training pieces: compiled autograd, foreach/fused optimizers, TORCH_LOGS, saved views.

Every result is compared with PyTorch on CPU (float32 matmuls at "highest" on both sides).
"""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_tpu
import torch_tpu.compile

torch_tpu.compile.register()
import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from tests.conftest import no_fallback  # noqa: E402

TPU = torch.device("tpu:0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_dynamo_highest():
    torch._dynamo.reset()
    counters.clear()
    torch_tpu.compile.stats.reset()  # the eager_graphs == 0 checks count this test's graphs only
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)
    torch._dynamo.reset()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _max_diff(a, b) -> float:
    return (a.detach().cpu() - b.detach()).abs().max().item()


def _train_step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().sum()
    loss.backward()
    opt.step()
    return loss


def test_compiled_autograd_matches_cpu():
    """compiled_autograd=True: the backward is captured by compiled autograd, runs on tpu, grads as on CPU."""
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(TPU)
    x = torch.randn(5, 8)

    def train(m, x):
        loss = m(x).square().sum()
        loss.backward()
        return loss

    graphs = torch_tpu.compile.stats.graphs
    with torch._dynamo.config.patch(compiled_autograd=True):
        loss = torch.compile(train, backend="tpu")(tpu_model, x.to(TPU))
    ref = train(model, x)
    assert abs(loss.item() - ref.item()) < 1e-4
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        assert q.grad.device.type == "tpu"
        assert _max_diff(q.grad, p.grad) < 1e-5
    assert counters["compiled_autograd"]["captures"] >= 1  # the backward really went through compiled autograd
    assert torch_tpu.compile.stats.graphs > graphs
    assert torch_tpu.compile.stats.eager_graphs == 0


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adam, {}),
                                        (torch.optim.SGD, {"momentum": 0.9})], ids=["AdamW", "Adam", "SGD"])
def test_compiled_foreach_optimizer_step_matches_cpu(cls, kwargs):
    """foreach=True inside a compiled step: the optimizer is a compiled graph updating parameters in place."""
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(TPU)
    opt = cls(model.parameters(), lr=0.01, foreach=False, **kwargs)
    tpu_opt = cls(tpu_model.parameters(), lr=0.01, foreach=True, **kwargs)
    addresses = [p.untyped_storage().data_ptr() for p in tpu_model.parameters()]
    step = torch.compile(_train_step, backend="tpu")
    donations = torch_tpu.compile.stats.donations
    x = torch.randn(5, 8)
    for _ in range(3):
        loss = step(tpu_model, tpu_opt, x.to(TPU))
        ref = _train_step(model, opt, x)
        assert abs(loss.item() - ref.item()) < 1e-4 * max(1.0, abs(ref.item()))
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        assert _max_diff(q, p) < 1e-5
    assert [p.untyped_storage().data_ptr() for p in tpu_model.parameters()] == addresses
    assert torch_tpu.compile.stats.donations > donations  # the optimizer graph wrote parameters where they lie
    assert torch_tpu.compile.stats.eager_graphs == 0


@pytest.mark.parametrize("backend", ["tpu", None], ids=["tpu", "default"])
def test_compiled_optimizer_keeps_step_counts_on_tpu(backend):
    """As Dynamo does for CUDA: a tpu optimizer compiled before its state exists becomes capturable, so
    its step counts live on tpu and no CPU op runs between the graph launches (no host steps)."""
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(TPU)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    tpu_opt = torch.optim.AdamW(tpu_model.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    step = torch.compile(_train_step, backend=backend) if backend else torch.compile(_train_step)
    x = torch.randn(5, 8)
    for _ in range(3):
        step(tpu_model, tpu_opt, x.to(TPU))
        _train_step(model, opt, x)
    assert tpu_opt.param_groups[0]["capturable"] is True
    assert all(s["step"].device.type == "tpu" and s["step"].item() == 3 for s in tpu_opt.state.values())
    assert torch_tpu.compile.stats.host_steps == 0
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        assert _max_diff(q, p) < 1e-5
    assert torch_tpu.compile.stats.eager_graphs == 0


def test_compiled_optimizer_with_existing_state():
    """State made by an eager step first: the group stays non-capturable (as on CUDA); Dynamo moves the
    CPU step counts to the parameters' device while tracing (for every device), and the numbers match CPU."""
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(TPU)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    tpu_opt = torch.optim.Adam(tpu_model.parameters(), lr=0.01, foreach=True)
    x = torch.randn(5, 8)
    _train_step(tpu_model, tpu_opt, x.to(TPU))
    _train_step(model, opt, x)
    step = torch.compile(_train_step, backend="tpu")
    for _ in range(3):
        step(tpu_model, tpu_opt, x.to(TPU))
        _train_step(model, opt, x)
    assert tpu_opt.param_groups[0]["capturable"] is False
    assert all(s["step"].item() == 4 for s in tpu_opt.state.values())
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        assert _max_diff(q, p) < 1e-5
    assert torch_tpu.compile.stats.eager_graphs == 0


def test_cpu_scalar_tensors_run_as_host_steps():
    """0-dim CPU tensors in a tpu graph (what a non-capturable optimizer's step counts were) are computed by
    PyTorch on the host before each launch, their updates land in the CPU tensors, and the values they feed
    are runtime scalars of one program (no recompile as they change)."""
    def bias_corrected(x, count):
        count.add_(1)
        return x / (1 - 0.9 ** count)

    x = torch.randn(6)
    count, tpu_count = torch.tensor(0.0), torch.tensor(0.0)
    fn = torch.compile(bias_corrected, backend="tpu")
    compiles = torch_tpu.cache.stats()["compiles"]
    for _ in range(4):
        out = fn(x.to(TPU), tpu_count)
        torch.testing.assert_close(out.cpu(), bias_corrected(x, count))
    assert tpu_count.device.type == "cpu" and tpu_count.item() == 4
    assert torch_tpu.compile.stats.host_steps >= 4
    assert torch_tpu.compile.stats.plans == 1
    assert torch_tpu.cache.stats()["compiles"] - compiles <= 3  # the graph's program and its helpers, once


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD], ids=["AdamW", "SGD"])
def test_compiled_step_with_fused_optimizer_matches_cpu(cls):
    """fused=True: PyTorch never traces a fused optimizer (torch.compiler.disable); its kernel runs eagerly,
    lowered (ops/optim.py), never on CPU."""
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(TPU)
    opt = cls(model.parameters(), lr=0.01)
    tpu_opt = cls(tpu_model.parameters(), lr=0.01, fused=True)
    step = torch.compile(_train_step, backend="tpu")
    x = torch.randn(5, 8)
    with no_fallback():
        for _ in range(3):
            step(tpu_model, tpu_opt, x.to(TPU))
            _train_step(model, opt, x)
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        assert q.device.type == "tpu"
        assert _max_diff(q, p) < 1e-5
    assert torch_tpu.compile.stats.eager_graphs == 0


def test_saved_parameter_views_are_views_and_track_versions():
    """Forward outputs viewing an unwritten input (saved weights, their transposes) are real views of it:
    an in-place update of the weight before backward is caught by autograd, as in eager."""
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(TPU)
    x = torch.randn(5, 8)
    out = torch.compile(tpu_model, backend="tpu")(x.to(TPU))
    out.square().sum().backward()
    model(x).square().sum().backward()
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        assert _max_diff(q.grad, p.grad) < 1e-5
    out = torch.compile(tpu_model, backend="tpu")(x.to(TPU))
    with torch.no_grad():
        tpu_model[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()


@pytest.mark.one_mode  # Dynamo's logging, not an execution mode (and a subprocess)
def test_torch_logs_graph_breaks_and_recompiles_on_tpu(tmp_path):
    """TORCH_LOGS=recompiles,graph_breaks on a tpu model: both logs name our code, the tpu backend compiled it."""
    script = tmp_path / "logs.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {ROOT!r})
        import torch, torch_tpu, torch_tpu.compile
        torch_tpu.compile.register()
        model = torch.nn.Linear(8, 4).to("tpu")

        def f(x):
            y = model(x)
            torch._dynamo.graph_break()
            return y.relu().sum()

        fn = torch.compile(f, backend="tpu")
        a = fn(torch.randn(5, 8, device="tpu")).item()
        b = fn(torch.randn(7, 8, device="tpu")).item()
        print(json.dumps(torch_tpu.compile.stats.as_dict()))
    """))
    env = {**os.environ, "TORCH_LOGS": "recompiles,graph_breaks", "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stderr
    assert "Graph break in user code" in log and "logs.py" in log
    assert "Recompiling function f" in log and "size mismatch" in log
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert stats["graphs"] >= 3 and stats["eager_graphs"] == 0
