"""torch.compile(backend="tpu") and the default backend on tpu tensors, compared with PyTorch on CPU."""
import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import torch_tpu
import torch_tpu.compile
from torch_tpu import cache
from torch_tpu.compile import routing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, GPTConfig  # noqa: E402

torch_tpu.compile.register()
import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

TPU = torch.device("tpu:0")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _xla_compiles() -> int:
    return cache.stats()["compiles"]


def _max_diff(a, b) -> float:
    return (a.detach().cpu() - b.detach()).abs().max().item()


def _small_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=2, n_embd=32))


def _tokens(seed=0, batch=2, length=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (batch, length), generator=g), torch.randint(0, 40, (batch, length), generator=g)


# ------------------------------------------------------------------ models against CPU
def test_mlp_forward_backward_matches_cpu():
    """Compiled forward and backward of an MLP: outputs and every gradient as on CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    tpu_model = copy.deepcopy(model).to(TPU)
    x = torch.randn(6, 8)
    compiled = torch.compile(tpu_model, backend="tpu")
    out = compiled(x.to(TPU))
    ref = model(x)
    assert _max_diff(out, ref) < 1e-5
    out.square().sum().backward()
    ref.square().sum().backward()
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        assert q.grad.device.type == "tpu"
        assert _max_diff(q.grad, p.grad) < 1e-4
    assert torch_tpu.compile.stats.eager_graphs == 0


def test_det_and_slogdet_gradients_match_cpu():
    """det/slogdet return the LU of A^T for a contiguous real A (PyTorch's contract, which their
    backward reads): compiled forward and backward, contiguous and transposed inputs, as on CPU,
    with no op left to eager (the backward's prims.where is lowered)."""
    torch.manual_seed(0)
    a = torch.randn(3, 4, 4)

    def f(x, transposed):
        x = x.mT if transposed else x
        return torch.linalg.det(x).sum() + torch.linalg.slogdet(x)[1].sum()

    for transposed in (False, True):
        x, xc = a.to(TPU).requires_grad_(), a.clone().requires_grad_()
        out, ref = torch.compile(f, backend="tpu")(x, transposed), f(xc, transposed)
        out.backward()
        ref.backward()
        assert _max_diff(out, ref) < 1e-4
        assert _max_diff(x.grad, xc.grad) < 1e-4
    assert torch_tpu.compile.stats.eager_graphs == 0


def test_cnn_batch_norm_running_stats_match_cpu():
    """A CNN with batch norm: training updates running stats in the real storages, eval reads them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))
    tpu_model = copy.deepcopy(model).to(TPU)
    bn, tpu_bn = model[1], tpu_model[1]
    address = tpu_bn.running_mean.untyped_storage().data_ptr()
    compiled = torch.compile(tpu_model, backend="tpu")
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        out, ref = compiled(x.to(TPU)), model(x)
        out.sum().backward()
        ref.sum().backward()
        assert _max_diff(out, ref) < 1e-4
    assert tpu_bn.running_mean.untyped_storage().data_ptr() == address  # updated in place, not replaced
    assert _max_diff(tpu_bn.running_mean, bn.running_mean) < 1e-5
    assert _max_diff(tpu_bn.running_var, bn.running_var) < 1e-5
    assert tpu_bn.num_batches_tracked.item() == bn.num_batches_tracked.item() == 3
    assert _max_diff(tpu_model[0].weight.grad, model[0].weight.grad) < 1e-3
    tpu_model.eval()
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    assert _max_diff(compiled(x.to(TPU)), model(x)) < 1e-4


def test_gpt_forward_backward_matches_cpu():
    """The small GPT of examples/gpt.py: loss, logits and gradients (tied weights too) as on CPU."""
    model = _small_gpt()
    tpu_model = copy.deepcopy(model).to(TPU)
    idx, targets = _tokens()
    logits, loss = torch.compile(tpu_model, backend="tpu")(idx.to(TPU), targets.to(TPU))
    ref_logits, ref_loss = model(idx, targets)
    assert _max_diff(logits, ref_logits) < 1e-4
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), tpu_model.parameters()):
        assert _max_diff(q.grad, p.grad) < 1e-4, name
    assert torch_tpu.compile.stats.eager_graphs == 0


@pytest.mark.heavy
def test_compiled_adamw_training_matches_eager_and_cpu():
    """20 compiled steps (forward, backward, AdamW in one compiled function): the loss curve of eager tpu and CPU."""

    def step(model, opt, idx, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(idx, targets)[1]
        loss.backward()
        opt.step()
        return loss

    curves = {}
    # Compiled first: the eager ops between its graphs (inside backward) meet no cached program,
    # so they take the Python path, whose frames Dynamo must not trace.
    for kind in ("compiled", "eager", "cpu"):
        model = _small_gpt()
        device = torch.device("cpu") if kind == "cpu" else TPU
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        run = torch.compile(step, backend="tpu") if kind == "compiled" else step
        losses = []
        idx, targets = _tokens()
        for i in range(20):
            if i == 3 and kind == "compiled":
                compiles = _xla_compiles()
            losses.append(run(model, opt, idx.to(device), targets.to(device)).item())
        curves[kind] = losses
        if kind == "compiled":
            assert _xla_compiles() == compiles  # steps 4..20 reuse every program
            params = list(model.parameters())
    assert curves["cpu"][-1] < curves["cpu"][0] - 0.3
    for kind in ("eager", "compiled"):
        for a, b in zip(curves[kind], curves["cpu"]):
            assert abs(a - b) < 2e-3, (kind, curves[kind], curves["cpu"])
    assert all(p.device.type == "tpu" for p in params)
    assert torch_tpu.compile.stats.eager_graphs == 0
    assert torch_tpu.compile.stats.donations > 0  # parameters and optimizer state updated where they lie


def test_graph_break_model_matches_cpu():
    """A model with a graph break: two compiled graphs, the eager part between them, results as on CPU."""

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 3)

        def forward(self, x):
            h = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h * 2)

    torch.manual_seed(0)
    model = Broken()
    tpu_model = copy.deepcopy(model).to(TPU)
    x = torch.randn(4, 8)
    out = torch.compile(tpu_model, backend="tpu")(x.to(TPU))
    ref = model(x)
    assert _max_diff(out, ref) < 1e-5
    out.sum().backward()
    ref.sum().backward()
    assert _max_diff(tpu_model.a.weight.grad, model.a.weight.grad) < 1e-5
    assert counters["stats"]["unique_graphs"] == 2


def test_graph_break_under_defer_and_fuse():
    """The eager part between graphs runs in the current eager mode (DeferAndFuse here)."""

    def fn(x):
        y = x.sin() + 1
        torch._dynamo.graph_break()
        return (y * x).cos()

    x = torch.randn(16)
    with torch_tpu.execution_mode("defer_and_fuse"):
        out = torch.compile(fn, backend="tpu")(x.to(TPU)).cpu()
    assert torch.allclose(out, fn(x), atol=1e-6)


# ------------------------------------------------------------------ random ops and precision
def test_random_ops_reproduce_under_seed_and_match_eager():
    """Dropout, rand_like and randn in a compiled graph: reproducible, and the same numbers as eager tpu."""

    def fn(x):
        return torch.nn.functional.dropout(x, 0.5) + torch.rand_like(x) + torch.randn(x.shape, device=x.device)

    x = torch.ones(64, device=TPU)
    compiled = torch.compile(fn, backend="tpu")
    torch.manual_seed(7)
    first = compiled(x).cpu()
    second = compiled(x).cpu()  # the generator moved on: other numbers
    torch.manual_seed(7)
    again = compiled(x).cpu()
    torch.manual_seed(7)
    eager = fn(x).cpu()
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    assert torch.allclose(first, eager, rtol=0, atol=1e-6)  # the same draws (the sums may round differently)


def test_float32_matmul_follows_precision_policy():
    """float32 products run at "medium" by default, as eager; "highest" gives another program."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    fn = torch.compile(torch.mm, backend="tpu")
    ta, tb = a.to(TPU), b.to(TPU)
    torch.set_float32_matmul_precision("medium")
    medium = fn(ta, tb).cpu()
    eager_medium = torch.mm(ta, tb).cpu()
    bf16 = (a.bfloat16().double() @ b.bfloat16().double()).float()
    torch.set_float32_matmul_precision("highest")
    highest = fn(ta, tb).cpu()
    assert torch.equal(medium, eager_medium)
    assert (medium - bf16).abs().max() < 1e-4
    assert (highest - a @ b).abs().max() < 1e-4
    assert (medium - a @ b).abs().max() > 1e-3  # bfloat16 operands: visibly not float32


# ------------------------------------------------------------------ the default backend
def test_default_backend_trains_tpu_model_like_cpu():
    """torch.compile(model) with no backend on a tpu model: routed to "tpu", trains and matches CPU."""
    assert routing.installed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    tpu_model = copy.deepcopy(model).to(TPU)
    compiled = torch.compile(tpu_model)
    opt = torch.optim.SGD(tpu_model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graphs = torch_tpu.compile.stats.graphs
    for i in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
        loss = compiled(x.to(TPU)).square().mean()
        ref = model(x).square().mean()
        assert abs(loss.item() - ref.item()) < 1e-5
        loss.backward()
        ref.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert torch_tpu.compile.stats.graphs > graphs  # the tpu backend made them, not Inductor


def test_routing_leaves_other_devices_to_inductor(monkeypatch):
    """The routing wrapper sends a CPU graph to the wrapped (Inductor) call unchanged."""
    seen = []
    routing.uninstall()
    monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__",
                        lambda self, gm, inputs, **kw: seen.append(inputs) or "inductor")
    try:
        assert routing.install()
        wrapper = torch._TorchCompileInductorWrapper(None, None, None)
        assert wrapper("gm", [torch.ones(2)]) == "inductor"
        assert len(seen) == 1
        assert routing.on_tpu([torch.ones(2, device=TPU)]) and not routing.on_tpu([torch.ones(2), 3])
    finally:
        routing.uninstall()
        monkeypatch.undo()
        routing.install()
    assert routing.installed()


# ------------------------------------------------------------------ dynamic shapes
def test_dynamic_shapes_one_trace_one_compile_per_size():
    """dynamic=True over 16 sequence lengths: Dynamo traces once, each new size costs one XLA compile, none on repeat."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)).to(TPU)
    compiled = torch.compile(model, backend="tpu", dynamic=True)
    inputs = [torch.randn(2, n, 16) for n in range(3, 19)]
    plans = torch_tpu.compile.stats.plans
    on_tpu = [x.to(TPU) for x in inputs]
    torch.tpu.synchronize()  # DeferAndFuse: the uploads run (and compile) now, not inside the sweep
    compiles = []
    with torch.no_grad():
        for x in on_tpu:
            before = _xla_compiles()
            compiled(x)
            compiles.append(_xla_compiles() - before)
        before = _xla_compiles()
        outs = [compiled(x) for x in on_tpu]  # every size again: nothing compiles
        assert _xla_compiles() == before
        for x, out in zip(inputs, outs):
            assert torch.allclose(out.cpu(), model.cpu()(x), atol=1e-5)
            model.to(TPU)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["frames"]["ok"] == 1
    assert all(n <= 1 for n in compiles), compiles
    assert torch_tpu.compile.stats.plans - plans == 16  # one program per concrete size


def test_mark_dynamic_sweep():
    """mark_dynamic on the sequence dim: one Dynamo graph for every length."""

    def fn(x):
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1)

    compiled = torch.compile(fn, backend="tpu")
    for n in (4, 7, 9):
        x = torch.randn(2, n, 8)
        t = x.to(TPU)
        torch._dynamo.mark_dynamic(t, 1)
        torch.set_float32_matmul_precision("highest")
        assert torch.allclose(compiled(t).cpu(), fn(x), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------------ cache, options, fallbacks
_SECOND_PROCESS = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, {root!r})
    import torch_tpu, torch_tpu.compile
    from torch_tpu import cache
    from examples.gpt import GPT, GPTConfig
    torch_tpu.compile.register()  # an uninstalled checkout has no entry point
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=2, n_embd=32)).to("tpu")
    idx = torch.randint(0, 40, (2, 16)).to("tpu")
    loss = torch.compile(model, backend="tpu")(idx, idx)[1]
    loss.backward()
    print(json.dumps({{"loss": loss.item(), "compiles": cache.stats()["compiles"],
                      "graphs": torch_tpu.compile.stats.graphs}}))
""")


@pytest.mark.heavy
def test_second_process_compiles_nothing(tmp_path):
    """A second process compiling the same model finds every executable in the host-shared cache."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "run.py"
    script.write_text(_SECOND_PROCESS.format(root=root))
    env = dict(os.environ, TORCH_TPU_CACHE="1", TORCH_TPU_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiles"] > 0 and first["graphs"] == 2
    assert second["compiles"] == 0
    assert second["loss"] == first["loss"]


def test_options_dump_dir_and_xla_flags(tmp_path):
    """options: the FX graphs and their StableHLO land in dump_dir; xla_flags reach the XLA compiler."""
    fn = torch.compile(lambda x: (x * 2).exp(), backend="tpu",
                       options={"dump_dir": str(tmp_path), "xla_flags": {"xla_cpu_enable_fast_math": False}})
    x = torch.randn(8)
    assert torch.allclose(fn(x.to(TPU)).cpu(), (x * 2).exp())
    names = sorted(os.listdir(tmp_path))
    assert any(n.endswith(".py") for n in names) and any(n.endswith(".mlir") for n in names), names
    mlir = next(n for n in names if n.endswith(".mlir"))
    assert "stablehlo.exponential" in (tmp_path / mlir).read_text()
    bad = torch.compile(lambda x: x + 1, backend="tpu", options={"xla_flags": {"no_such_xla_option": 1}})
    with pytest.raises(Exception, match="no_such_xla_option"):
        bad(torch.ones(3, device=TPU))


def test_unknown_option_is_an_error():
    """An option the backend does not know is a clear error naming the known ones."""
    fn = torch.compile(lambda x: x + 1, backend="tpu", options={"triton.cudagraphs": True})
    with pytest.raises(Exception, match="known options"):
        fn(torch.ones(3, device=TPU))


def test_graph_with_unlowered_op_runs_eagerly():
    """An op with no lowering and no decomposition: the graph runs op by op in eager, with a warning."""
    lib = torch.library.Library("tpu_compile_test", "FRAGMENT")
    lib.define("twice_plus_one(Tensor x) -> Tensor")
    lib.impl("twice_plus_one", lambda x: x * 2 + 1, "CPU")
    lib.impl("twice_plus_one", lambda x: torch.empty_like(x), "Meta")

    def fn(x):
        return torch.ops.tpu_compile_test.twice_plus_one(x.sin()) + 1

    x = torch.randn(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's warning
        with pytest.warns(UserWarning, match="runs op by op in eager"):
            out = torch.compile(fn, backend="tpu")(x.to(TPU))
    assert torch.allclose(out.cpu(), fn(x), atol=1e-6)


def test_explain_on_tpu_model():
    """torch._dynamo.explain works on a tpu function and counts its graph break."""

    def fn(x):
        x = x.relu()
        torch._dynamo.graph_break()
        return x + 1

    explanation = torch._dynamo.explain(fn)(torch.randn(4, device=TPU))
    assert explanation.graph_count == 2 and explanation.graph_break_count == 1


def test_eager_foreach_with_cpu_scalar_tensor_list():
    """Eager: a foreach op with a list of 0-dim CPU tensors (non-capturable Adam's bias corrections)."""
    a = [torch.ones(3), torch.full((2,), 4.0)]
    b = [torch.tensor(2.0), torch.tensor(4.0)]
    out = torch._foreach_div([t.to(TPU) for t in a], b)
    for o, r in zip(out, torch._foreach_div(a, b)):
        assert torch.equal(o.cpu(), r)


def test_graph_call_leaves_value_check_flags_pending():
    """A graph call is not a materialization point: the flags of an earlier graph's checked ops (an
    embedding's index range) stay pending through the next graph's call, whose launch would otherwise
    wait for the earlier program; the next read checks them, and a bad index still raises there."""
    from torch_tpu.eager import valuecheck

    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    tpu_emb = copy.deepcopy(emb).to(TPU)
    lookup = torch.compile(lambda tokens: tpu_emb(tokens) * 2, backend="tpu")
    shift = torch.compile(lambda x: x.sum(-1) + 1, backend="tpu")
    tokens = torch.tensor([[1, 2, 3], [4, 5, 9]])
    expected = (emb(tokens) * 2).sum(-1) + 1
    torch.testing.assert_close(shift(lookup(tokens.to(TPU))).cpu(), expected)  # compiles both
    looked_up = lookup(tokens.to(TPU))
    assert valuecheck.pending() >= 1
    out = shift(looked_up)
    assert valuecheck.pending() >= 1  # the second graph's call read no flag
    torch.testing.assert_close(out.cpu(), expected)
    assert valuecheck.pending() == 0
    with pytest.raises(IndexError, match="index out of range in self"):
        shift(lookup(torch.tensor([[1, 12, 3], [0, 0, 0]], device=TPU))).cpu()


def test_native_graph_key_matches_the_python_key():
    """`_native.graph_key` (the per-call key of a compiled graph) gives the Python key's entries, slots and
    buffers for tpu tensors, parameters, shared storages, views, CPU tensors and numbers, and defers to
    Python (None) for anything else."""
    from torch_tpu import _native
    from torch_tpu.compile.graph import GraphFunction, _TENSOR, _buffers

    w = torch.nn.Parameter(torch.randn(4, 3).to(TPU))
    x = torch.randn(6, 4, device=TPU)
    never_written = torch.empty(5, device=TPU)
    cases = [
        [w, x, x[1:].t(), x.view(4, 6), torch.randn(3).to(torch.bfloat16).to(TPU), never_written,
         torch.ones(2, 2), 3, 2.5, True, None, torch.tensor(7, dtype=torch.int64)],
        [],
        [1, None],  # no tpu tensor: device -1
    ]
    for args in cases:
        native = _native.graph_key(list(args), _buffers, _TENSOR)
        assert native is not None
        assert native == GraphFunction._python_key(list(args))
        entries, addresses, arrays, device = native
        assert len(entries) == len(args)
    entries = _native.graph_key([w, x, x.t()], _buffers, _TENSOR)[0]
    assert [e[5] for e in entries] == [0, 1, 1]  # one slot per storage
    # Other tensor types and values: the Python key decides.
    class Marked(torch.Tensor):
        pass

    for args in ([x, "text"], [x, torch.randn(2, device="meta")], [x.as_subclass(Marked)], (x,)):
        assert _native.graph_key(args, _buffers, _TENSOR) is None


def test_boolean_tensors_indexed_and_masked_writes_plan_whole():
    """Indexing a boolean tensor with integer indices and `x[mask] = scalar` have static shapes: they plan
    into the graph's program (only a mask among the indices of a read or of a tensor write runs eager)."""
    torch_tpu.compile.register()
    stats = torch_tpu.compile.stats

    def masked_fill(x, mask):
        y = x.clone()
        y[mask] = 0.5
        return y * 2

    def gather_bools(b, rows, cols):
        return b[rows[:, None], cols[None, :]].float() + 1

    def masked_tensor_write(x, mask):  # the values' count depends on the mask: eager, still right
        y = x.clone()
        y[mask] = y[mask] * 3
        return y

    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.5
    b, rows, cols = torch.rand(3, 6) > 0.5, torch.tensor([0, 2]), torch.tensor([1, 5, 3])
    for fn, args, whole in ((masked_fill, (x, mask), True), (gather_bools, (b, rows, cols), True),
                            (masked_tensor_write, (x, mask), False)):
        torch._dynamo.reset()
        stats.reset()
        got = torch.compile(fn, backend="tpu")(*(a.to("tpu") for a in args))
        torch.testing.assert_close(got.cpu(), fn(*args))
        assert (stats.eager_graphs == 0 and stats.plans == 1) if whole else stats.eager_graphs == 1, stats.as_dict()
    torch._dynamo.reset()


def test_graph_tensor_constants_are_program_literals():
    """`torch.tensor([...])` inside compiled code (a graph constant) and CPU factories moved to the device
    (`torch.eye(n).to(x.device)`) become literals of the program."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()

    def fn(x):
        scale = torch.tensor([1.0, -2.0, 0.5]).to(x.device)
        picks = torch.tensor([2, 0]).to(x.device)
        # CPU factories moved to the device: computed once when planned, literals as well
        shift = (torch.eye(3) * 2 + torch.arange(3)).to(x.device)
        spread = torch.zeros(4, 3).to(x.device).scatter_add(1, torch.argsort(x, 1), x)
        return (x * scale)[:, picks] + torch.tensor(3, dtype=torch.bfloat16).to(x.device) + (x @ shift)[:, :2] + spread[:, 1:]

    x = torch.randn(4, 3)
    got = torch.compile(fn, backend="tpu")(x.to("tpu"))
    torch.testing.assert_close(got.cpu(), fn(x))
    assert stats.eager_graphs == 0 and stats.plans == 1, stats.as_dict()
    torch._dynamo.reset()


def test_saved_non_dense_views_keep_their_traced_strides():
    """GPT-2's attention saves q, k and v for backward as non-dense views of one projection; the
    backward graph's views were traced on those strides, so the plan keeps them (it failed before)."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 48)
    x = torch.randn(2, 8, 16)

    def loss_of(proj, x):
        q, k, v = (t.view(2, 8, 2, 8).transpose(1, 2) for t in proj(x).split(16, dim=2))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(2, 8, 16).square().sum()

    def step(proj, x):
        loss = loss_of(proj, x)
        loss.backward()
        return loss

    tpu_proj = copy.deepcopy(proj).to("tpu")
    expected = step(proj, x)
    got = torch.compile(step, backend="tpu")(tpu_proj, x.to("tpu"))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    for p, q in zip(proj.parameters(), tpu_proj.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


def test_composite_ops_eager_decomposes_plan_whole():
    """Ops eager runs through a composite kernel but graphs keep whole (logcumsumexp, one_hot) plan
    into the program."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()

    def fn(x):
        return torch.logcumsumexp(x, 1) + torch.nn.functional.one_hot(x.argmax(1), 8)[:, :, None].float().sum(-1)

    x = torch.randn(4, 8)
    got = torch.compile(fn, backend="tpu")(x.to("tpu"))
    torch.testing.assert_close(got.cpu(), fn(x))
    assert stats.eager_graphs == 0 and stats.plans == 1, stats.as_dict()
    torch._dynamo.reset()


def test_linalg_error_checks_plan_whole_and_raise_pytorchs_error():
    """linalg ops that check their info put an effect (`with_effects(_linalg_check_errors)`) into the
    graph: it plans into the program as a value check, and a failure raises PyTorch's own error (type and
    message, batch element included) at the next materialization point."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()

    def fn(a, b):
        return torch.linalg.solve(a, b) * 2, torch.linalg.inv(a)

    a = torch.randn(2, 4, 4) + 4 * torch.eye(4)
    b = torch.randn(2, 4, 3)
    compiled = torch.compile(fn, backend="tpu")
    got = compiled(a.to("tpu"), b.to("tpu"))
    for g, want in zip(got, fn(a, b)):
        torch.testing.assert_close(g.cpu(), want)
    assert stats.eager_graphs == 0 and stats.plans == 1, stats.as_dict()

    singular = a.clone()
    singular[1] = 0
    with pytest.raises(torch.linalg.LinAlgError) as cpu_error:
        fn(singular, b)
    got = compiled(singular.to("tpu"), b.to("tpu"))  # no error yet: checked when a value is read
    with pytest.raises(torch.linalg.LinAlgError) as tpu_error:
        got[0].cpu()
    assert str(cpu_error.value) in str(tpu_error.value)
    assert "(Batch element 1)" in str(tpu_error.value)
    assert stats.eager_graphs == 0, stats.as_dict()
    torch._dynamo.reset()


class _CondModel(torch.nn.Module):
    """torch.cond on a tpu predicate, nested in one branch, with a parameter read in the other."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)

    def forward(self, x):
        def positive(x):
            return self.lin(x).relu(), x.clone()

        def other(x):
            inner = torch.cond(x.mean() > 0, lambda a: (a * 3, a[:, :2].sum(1, keepdim=True).expand(-1, 5).contiguous()),
                               lambda a: (a.t().t() - 1, a.clone()), (x,))
            return inner[0] + 1, inner[1]

        return torch.cond(x.sum() > 0, positive, other, (x,))


def test_cond_plans_whole_forward_and_backward():
    """torch.cond runs as one lax.cond step of the program (only the taken branch runs); its backward
    graph (a cond too) as well: results and gradients match CPU for each branch taken."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()
    torch.manual_seed(0)
    cpu = _CondModel()
    tpu = _CondModel()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to(TPU)
    compiled = torch.compile(tpu, backend="tpu")
    for x in (torch.randn(4, 5).abs(), -torch.randn(4, 5).abs(), torch.randn(4, 5) - 0.1):  # each branch
        want_x, got_x = x.clone().requires_grad_(), x.to(TPU).requires_grad_()
        want, got = cpu(want_x), compiled(got_x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w)
        (want[0].sum() + want[1].pow(2).sum()).backward()
        (got[0].sum() + got[1].pow(2).sum()).backward()
        torch.testing.assert_close(got_x.grad.cpu(), want_x.grad)
        for p, q in zip(tpu.parameters(), cpu.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad)
        cpu.zero_grad()
        tpu.zero_grad()
    assert stats.eager_graphs == 0 and stats.plans >= 2, stats.as_dict()
    torch._dynamo.reset()


def test_while_loop_plans_whole():
    """torch.while_loop runs as one lax.while_loop step: the carried values (an int64 counter, a view
    at a storage offset) and an additional input (a transposed weight) read inside the body."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()

    def fn(x, w):
        wt = w.t()

        def cond(i, y):
            return (i < 5) & (y.abs().sum() > 0)

        def body(i, y):
            return i + 1, (y @ wt).tanh()

        i, y = torch.while_loop(cond, body, (torch.zeros((), dtype=torch.int64, device=x.device), x[1:]))
        return y * 2, i

    x, w = torch.randn(5, 4), torch.randn(4, 4) * 0.5
    got = torch.compile(fn, backend="tpu")(x.to(TPU), w.to(TPU))
    for g, want in zip(got, fn(x, w)):
        torch.testing.assert_close(g.cpu(), want)
    assert stats.eager_graphs == 0 and stats.plans == 1, stats.as_dict()
    torch._dynamo.reset()


def test_other_higher_order_ops_run_op_by_op():
    """A higher-order op the plan does not take (a nested compile region's invoke_subgraph) runs the
    graph op by op in eager, with the same results as CPU."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()

    @torch.compiler.nested_compile_region
    def region(x):
        return x.sin() * 2

    def fn(x):
        return region(x) + region(x + 1)

    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="higher-order op"):
        got = torch.compile(fn, backend="tpu")(x.to(TPU))
    torch.testing.assert_close(got.cpu(), fn(x))
    assert stats.eager_graphs == 1, stats.as_dict()
    torch._dynamo.reset()


def test_compiled_embedding_bag_backward_is_one_program():
    """EmbeddingBag's backward (`_embedding_bag_backward`, routed to the lowered dense backward) stays in
    the compiled graph: no op-by-op fallback, and the gradient matches CPU."""

    def step(bag, indices, offsets):
        bag(indices, offsets).pow(2).sum().backward()
        return bag.weight.grad

    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2, 4])
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 3, mode="mean")
    expected = step(copy.deepcopy(bag), indices, offsets)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = torch.compile(step, backend="tpu")(copy.deepcopy(bag).to(TPU), indices.to(TPU), offsets.to(TPU))
    torch.testing.assert_close(got.cpu(), expected)
