"""DeferAndFuse: recording, materialization points, fusion, reuse, the repeats heuristic, errors, threads.

Every comparison is against PyTorch on CPU or against Strict mode on the same
inputs; counters (flushes, fused programs, compilations) are asserted, never time.
"""
import copy
import os
import subprocess
import sys
import threading
import warnings

import jax
import pytest
import torch

import torch_tpu
from torch_tpu import metrics, modes
from torch_tpu.eager import defer, executor
from torch_tpu.eager.opspec import spec
from torch_tpu.ops.registry import Lowering

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, GPTConfig  # noqa: E402

aten = torch.ops.aten


def _counts():
    c = metrics.counts
    return (c.flushes, c.fused_executions)


def _delta(before):
    after = _counts()
    return tuple(a - b for a, b in zip(after, before))


# ------------------------------------------------------------------ mode API
def test_mode_api_setter_getter_context():
    """set/get_execution_mode and the context managers; leaving defer_and_fuse flushes."""
    previous = modes.get_execution_mode()
    try:
        modes.set_execution_mode("strict")
        assert torch_tpu.get_execution_mode() == "strict"
        x = torch.ones(4, device="tpu")
        with torch_tpu.defer_and_fuse():
            assert torch_tpu.get_execution_mode() == "defer_and_fuse"
            y = x * 3
            assert defer.pending() == 1
            before = _counts()
        assert torch_tpu.get_execution_mode() == "strict"
        assert defer.pending() == 0 and _delta(before) == (1, 1)
        assert y.tolist() == [3.0] * 4
        with torch_tpu.execution_mode("debug"):
            assert torch_tpu.get_execution_mode() == "debug"
        with pytest.raises(ValueError, match="unknown execution mode"):
            torch_tpu.set_execution_mode("lazy")
    finally:
        modes.set_execution_mode(previous)


def _run(code, **env):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_env_var_and_debug_precedence():
    """TORCH_TPU_DEFER_AND_FUSE=1 selects the mode; with TORCH_TPU_LAUNCH_BLOCKING=1 debug wins, with a warning."""
    code = "import torch, torch_tpu; print('MODE', torch_tpu.get_execution_mode())"
    out = _run(code, TORCH_TPU_DEFER_AND_FUSE="1", TORCH_TPU_LAUNCH_BLOCKING="0")
    assert "MODE defer_and_fuse" in out.stdout, out.stderr
    out = _run(code, TORCH_TPU_DEFER_AND_FUSE="1", TORCH_TPU_LAUNCH_BLOCKING="1")
    assert "MODE debug" in out.stdout and "debug mode wins" in out.stderr
    out = _run(code, TORCH_TPU_DEFER_AND_FUSE="0", TORCH_TPU_LAUNCH_BLOCKING="0")
    assert "MODE strict" in out.stdout


# ------------------------------------------------------------------ materialization points
def _masked_select(t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masked_select runs on CPU (a visible, counted fallback)
        return torch.masked_select(t, t > 0)


POINTS = {
    "cpu": lambda t: t.cpu(),
    "to_cpu": lambda t: t.to("cpu"),
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "bool": lambda t: bool(t.sum() > 0),
    "if": lambda t: 1 if t[0] > -5 else 0,
    "synchronize": lambda t: torch.tpu.synchronize(),
    "to_other_device": lambda t: t.to("tpu:1"),
    "masked_select": _masked_select,
    "numpy": lambda t: t.cpu().numpy(),
}


@pytest.mark.parametrize("point", sorted(POINTS))
def test_each_materialization_point_runs_the_graph_once(point):
    """Every recorded op runs exactly once, in one fused program, at the materialization point."""
    x = torch.linspace(-1, 1, 12).to("tpu")
    with torch_tpu.defer_and_fuse():
        y = (x * 2 + 1).tanh()
        y.mul_(3)
        recorded = defer.pending()
        assert recorded >= 4
        before, executed, deferred = _counts(), metrics.counts.ops_executed, metrics.counts.ops_deferred
        POINTS[point](y)
        assert _delta(before)[0] == 1  # one flush
        assert _delta(before)[1] == 1  # one fused program
        # ... which ran every recorded op once (and those the point recorded first, e.g. sum before item);
        # ops the point records after reading (e.g. the copy into a tensor on another device) stay pending.
        ran = metrics.counts.ops_executed - executed
        assert ran >= recorded
        assert ran + defer.pending() == recorded + metrics.counts.ops_deferred - deferred
    expected = (torch.linspace(-1, 1, 12) * 2 + 1).tanh() * 3
    torch.testing.assert_close(y.cpu(), expected)


def test_print_runs_the_recorded_graph_once():
    """print flushes the recorded graph once; torch's formatter then reads values as on CUDA, never re-running it."""
    x = torch.linspace(-1, 1, 6).to("tpu")
    with torch_tpu.defer_and_fuse():
        y = (x * 2 + 1).tanh()
        recorded = defer.pending()
        executed, deferred, reads = metrics.counts.ops_executed, metrics.counts.ops_deferred, metrics.counts.d2h_transfers
        flushes = metrics.counts.flushes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = repr(y)
        # The formatter's own device ops are recorded and run too; nothing runs twice.
        assert metrics.counts.ops_executed - executed == recorded + (metrics.counts.ops_deferred - deferred)
        assert 1 <= metrics.counts.flushes - flushes <= metrics.counts.d2h_transfers - reads
    assert text.startswith("tensor([") and "device='tpu:0'" in text


def test_size_cap_flushes():
    """A graph reaching max_ops (TORCH_TPU_DEFER_MAX_OPS) ops is flushed by itself."""
    x = torch.zeros(8, device="tpu")
    torch.tpu.synchronize()  # under TORCH_TPU_DEFER_AND_FUSE=1 the setup is recorded too: run it first
    with torch_tpu.defer_and_fuse(max_ops=10):
        before = _counts()
        for _ in range(25):
            x = x + 1
        assert _delta(before)[0] == 2 and defer.pending() == 5
    assert x.tolist() == [25.0] * 8
    assert metrics.flush_reasons["size cap"] >= 2 and "flushes at size cap" in metrics.report()


def test_defer_options_api():
    """set_defer_options validates, returns previous values; the context manager restores them."""
    from torch_tpu.config import config

    previous = torch_tpu.set_defer_options(min_period=8, repeats=False)
    try:
        assert config.defer_min_period == 8 and config.defer_repeats is False
        with torch_tpu.defer_and_fuse(max_ops=7, max_period=64, loops=False):
            assert config.defer_max_ops == 7 and config.defer_max_period == 64 and config.defer_loops is False
        assert config.defer_loops is True
        with pytest.raises(TypeError, match="loops must be a bool"):
            torch_tpu.set_defer_options(loops=1)
        assert config.defer_max_ops == 10_000 or config.defer_max_ops != 7
        with pytest.raises(TypeError, match="unknown DeferAndFuse option"):
            torch_tpu.set_defer_options(period=3)
        with pytest.raises(ValueError, match="positive int"):
            torch_tpu.set_defer_options(max_ops=0)
    finally:
        torch_tpu.set_defer_options(**previous)
    assert config.defer_min_period == previous["min_period"] and config.defer_repeats == previous["repeats"]


def test_option_env_vars_are_read():
    """The DeferAndFuse knobs come from their environment variables."""
    code = ("import torch, torch_tpu; from torch_tpu.config import config; "
            "print('OPTS', config.defer_max_ops, config.defer_repeats, config.defer_min_period, config.defer_max_period, "
            "config.defer_loops)")
    out = _run(code, TORCH_TPU_DEFER_MAX_OPS="123", TORCH_TPU_DEFER_REPEATS="0", TORCH_TPU_DEFER_MIN_PERIOD="4",
               TORCH_TPU_DEFER_MAX_PERIOD="99", TORCH_TPU_DEFER_LOOPS="0")
    assert "OPTS 123 False 4 99 False" in out.stdout, out.stderr


# ------------------------------------------------------------------ liveness, fusion, reuse
def test_only_live_values_are_outputs():
    """Dead intermediates are not program outputs (no device buffer); live ones are."""
    x = torch.randn(64).to("tpu")
    torch.tpu.synchronize()
    with torch_tpu.defer_and_fuse():
        y = x
        for _ in range(10):
            y = torch.sin(y) * 1.5
        kept = y * 2
        y = None
        outputs, buffers = metrics.counts.fused_outputs, torch.tpu.memory_stats()["num_device_buffers"]
        torch.tpu.synchronize()
        assert metrics.counts.fused_outputs - outputs == 1
        assert torch.tpu.memory_stats()["num_device_buffers"] == buffers + 1
    expected = x.cpu()
    for _ in range(10):
        expected = torch.sin(expected) * 1.5
    torch.testing.assert_close(kept.cpu(), expected * 2)


def test_repeated_graph_reuses_its_program():
    """The same graph structure with new values reuses the plan and the compiled program."""
    def step(x, lr):
        with torch_tpu.defer_and_fuse():
            y = (x * lr).exp().sum()
            return y.item()

    x, other = torch.randn(33).to("tpu"), torch.randn(34).to("tpu")
    torch.tpu.synchronize()
    step(x, 0.1)
    compiled, hits = metrics.counts.programs_compiled, metrics.counts.fused_cache_hits
    values = [step(x, lr) for lr in (0.2, 0.3, 0.4)]
    assert metrics.counts.programs_compiled == compiled
    assert metrics.counts.fused_cache_hits == hits + 3
    for lr, v in zip((0.2, 0.3, 0.4), values):
        assert v == pytest.approx((x.cpu() * lr).exp().sum().item(), rel=1e-6)
    step(other, 0.1)  # a new shape is a new graph
    assert metrics.counts.programs_compiled == compiled + 1


def test_in_place_and_views_match_strict_bitwise():
    """In-place ops through views chain pending values exactly as eager does (strict == defer == CPU)."""
    def program(base):
        v = base.view(4, 6)
        v[:, ::2].mul_(2)
        t = v.t()
        t[1:3].add_(t[0])
        base.add_(1)
        w = v.diagonal()
        w.copy_(torch.arange(4.0, device=base.device))
        u = base.unsqueeze(0).expand(3, 24).sum(0)
        return base * 1, v.clone(), u

    start = torch.randn(24)
    expected = program(start.clone())
    results = {}
    for mode in ("strict", "defer_and_fuse"):
        with torch_tpu.execution_mode(mode):
            base = start.to("tpu")
            out = program(base)
            results[mode] = [t.cpu() for t in (*out, base)]
    for s, d in zip(results["strict"], results["defer_and_fuse"]):
        assert torch.equal(s, d)
    for actual, e in zip(results["defer_and_fuse"], (*expected, None)):
        if e is not None:
            torch.testing.assert_close(actual, e)


def test_aliasing_is_storage_level():
    """Views recorded in defer mode share their storage; data_ptr and strides are eager's."""
    with torch_tpu.defer_and_fuse():
        a = torch.zeros(3, 4, device="tpu")
        b = a[1]
        b.fill_(7)
        assert b.data_ptr() == a.data_ptr() + 16 and a.t().stride() == (1, 4)
        assert a.sum().item() == 28.0


def test_rng_stream_matches_strict():
    """The same seed draws the same numbers in both modes (seed/offset taken at record time)."""
    draws = {}
    for mode in ("strict", "defer_and_fuse"):
        with torch_tpu.execution_mode(mode):
            torch.manual_seed(123)
            a = torch.rand(100, device="tpu")
            b = torch.randn(7, 9, device="tpu")
            c = torch.nn.functional.dropout(torch.ones(50, device="tpu"), 0.5)
            draws[mode] = [t.cpu() for t in (a, b, c)]
    for s, d in zip(draws["strict"], draws["defer_and_fuse"]):
        assert torch.equal(s, d)
    assert not torch.equal(draws["strict"][0][:50], draws["strict"][0][50:])


def test_autograd_matches_strict():
    """Forward and backward (recorded from the autograd engine's thread) give Strict's gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))
    x, target = torch.randn(5, 8), torch.randint(0, 3, (5,))
    grads = {}
    for mode in ("strict", "defer_and_fuse"):
        m = copy.deepcopy(model).to("tpu")
        with torch_tpu.execution_mode(mode):
            loss = torch.nn.functional.cross_entropy(m(x.to("tpu")), target.to("tpu"))
            loss.backward()
            grads[mode] = [p.grad.cpu() for p in m.parameters()] + [loss.detach().cpu()]
    for s, d in zip(grads["strict"], grads["defer_and_fuse"]):
        torch.testing.assert_close(d, s, atol=1e-6, rtol=1e-6)
    cpu = copy.deepcopy(model)
    torch.nn.functional.cross_entropy(cpu(x), target).backward()
    for p, d in zip(cpu.parameters(), grads["defer_and_fuse"]):
        torch.testing.assert_close(d, p.grad, atol=1e-5, rtol=1e-5)


def test_gpt_training_matches_strict():
    """Five AdamW steps of the demo GPT: DeferAndFuse losses equal Strict's (1e-5 relative)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 40, (2, 16), generator=g), torch.randint(0, 40, (2, 16), generator=g))
               for _ in range(5)]
    losses = {}
    for mode in ("strict", "defer_and_fuse"):
        m = copy.deepcopy(model).to("tpu")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        with torch_tpu.execution_mode(mode):
            out = []
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                loss = m(x.to("tpu"), y.to("tpu"))[1]
                loss.backward()
                opt.step()
                out.append(loss.item())
        losses[mode] = out
    for s, d in zip(losses["strict"], losses["defer_and_fuse"]):
        assert d == pytest.approx(s, rel=1e-5)
    assert losses["defer_and_fuse"][-1] < losses["defer_and_fuse"][0]


def test_optimizer_step_donates_old_parameters():
    """Old values of storages updated in place are donated to the fused program (written in place)."""
    p_cpu, g_cpu = torch.randn(256), torch.randn(256)
    p, g = p_cpu.to("tpu"), g_cpu.to("tpu")
    torch.tpu.synchronize()
    with torch_tpu.defer_and_fuse():
        p.sub_(g, alpha=0.1)
        p.mul_(0.99)
        donated = metrics.counts.fused_donations
        torch.tpu.synchronize()
        assert metrics.counts.fused_donations == donated + 1  # p's old buffer; g is still live: kept
    torch.testing.assert_close(p.cpu(), (p_cpu - 0.1 * g_cpu) * 0.99)
    torch.testing.assert_close(g.cpu(), g_cpu)


def test_in_place_updates_keep_their_buffers():
    """Parameters updated in place are written where they lie: each new value takes its own donated
    buffer (not that of another donated input of the same size), 2-D parameters included."""
    from torch_tpu.runtime import storage

    def pointer(t):
        return storage.buffers[storage.storage_address(t)][0].unsafe_buffer_pointer()

    torch.manual_seed(0)
    ps_cpu = [torch.randn(64, 32) for _ in range(4)]
    gs_cpu = [torch.randn(64, 32) for _ in range(4)]
    ps, gs = [p.to("tpu") for p in ps_cpu], [g.to("tpu") for g in gs_cpu]
    torch.tpu.synchronize()
    before = [pointer(p) for p in ps]
    with torch_tpu.defer_and_fuse():
        for p, g in zip(ps, gs):
            p.add_(g * 2, alpha=-0.1)
            p.mul_(0.99)
        del g, gs  # the gradients' buffers are free to donate too, and have the parameters' size
        donated = metrics.counts.fused_donations
        torch.tpu.synchronize()
        assert metrics.counts.fused_donations - donated == 4  # one per output: the parameters' own
    assert [pointer(p) for p in ps] == before
    for p, p_cpu, g_cpu in zip(ps, ps_cpu, gs_cpu):
        torch.testing.assert_close(p.cpu(), (p_cpu - 0.2 * g_cpu) * 0.99)


def test_fused_optimizer_step_updates_weight_matrices_without_copies():
    """A fused AdamW step over weight matrices updates parameters and moments in their own donated
    buffers without XLA copying them first (it copied each 2-D one twice when the foreach ops worked
    in the matrices' shape over flat buffers), and matches torch's CPU AdamW."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32, 16), (16,)]
    cpu = [torch.randn(s, requires_grad=True) for s in shapes]
    tpu = [p.detach().to("tpu").requires_grad_() for p in cpu]
    opts = [torch.optim.AdamW(ps, lr=0.1, foreach=True) for ps in (cpu, tpu)]
    for step in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(cpu, grads):
            p.grad = g
        for p, g in zip(tpu, grads):
            p.grad = g.to("tpu")
        opts[0].step()
        torch.tpu.synchronize()  # under TORCH_TPU_DEFER_AND_FUSE=1 the gradients' copies are recorded too
        before = set(defer._executables)
        with torch_tpu.defer_and_fuse():
            opts[1].step()
            torch.tpu.synchronize()
        for key in set(defer._executables) - before:
            text = defer._executables[key].as_text()
            if "_foreach_addcdiv" in text:
                assert " copy(" not in text
    for p, q in zip(tpu, cpu):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-6, rtol=1e-5)


def test_view_offsets_are_constants_of_a_fused_program_until_they_change():
    """A column block of a fresh tensor (attention's q/k/v split) is read in place by a fused
    program that takes its storage offset as a constant (no padded copy of the buffer); a segment
    run with other offsets falls back to runtime offsets once, then serves every offset."""
    torch.manual_seed(0)
    x_cpu = torch.randn(8, 48)
    x = x_cpu.to("tpu")
    torch.tpu.synchronize()  # under TORCH_TPU_DEFER_AND_FUSE=1 the copy is recorded too: run it first

    def block(t, i):  # a non-contiguous view at storage offset 8*i, of a value made in the graph
        return ((t * 2)[:, 8 * i:8 * i + 8].t() + 1).sin()

    compiled = []
    for i in (1, 1, 2, 3, 4, 5):
        before = set(defer._executables), metrics.counts.programs_compiled
        with torch_tpu.defer_and_fuse():
            torch.testing.assert_close(block(x, i).cpu(), block(x_cpu, i))
        compiled.append(metrics.counts.programs_compiled - before[1])
        if i == 1 and compiled == [compiled[0]]:
            new = [defer._executables[k] for k in set(defer._executables) - before[0] if k[0] != "flatten"]
            texts = [e.as_text() for e in new if hasattr(e, "as_text")]
            assert texts and all(" pad(" not in t for t in texts)
    assert compiled[1] == 0  # the same offsets: the same program
    assert compiled[2] > 0  # other offsets: the runtime-offset program, compiled once
    assert compiled[3:] == [0, 0, 0]


# ------------------------------------------------------------------ the repeats heuristic
def _forward_compiles(n_layer: int, n_embd: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=n_layer, n_head=2, n_embd=n_embd))
    idx = torch.randint(0, 50, (2, 16))
    expected = model(idx)[0]
    tpu, tpu_idx = model.to("tpu"), idx.to("tpu")
    torch.tpu.synchronize()  # under TORCH_TPU_DEFER_AND_FUSE=1 the copies are recorded too: run them first
    counts = []
    with torch_tpu.defer_and_fuse(), torch.no_grad():
        for _ in range(2):
            compiled = metrics.counts.programs_compiled
            logits = tpu(tpu_idx)[0].cpu()
            counts.append(metrics.counts.programs_compiled - compiled)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    return counts


def test_deep_transformer_compiles_no_more_than_shallow():
    """A 12-block forward compiles no more fused programs than a 2-block one; after warm-up, none."""
    shallow = _forward_compiles(2, 24)
    deep = _forward_compiles(12, 40)
    assert deep[0] <= shallow[0], (shallow, deep)
    assert shallow[1] == 0 and deep[1] == 0


def test_repeats_can_be_turned_off():
    """TORCH_TPU_DEFER_REPEATS=0: a deep forward is one fused program."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, n_embd=16)).to("tpu")
    idx = torch.randint(0, 50, (2, 8)).to("tpu")
    torch.tpu.synchronize()
    for repeats, programs in ((False, 1), (True, 5)):  # on: prefix, 3 blocks, suffix
        with torch_tpu.defer_and_fuse(repeats=repeats), torch.no_grad():
            runs = metrics.counts.fused_executions
            model(idx)[0].sum().item()
            assert metrics.counts.fused_executions == runs + programs


def _chain(x, y, n, scale=lambda i: 1.0001):
    for i in range(n // 4):
        x = x * scale(i)
        x = x + y
        x = torch.tanh(x)
        x = x - 0.5
    return x


def test_long_repeated_chain_runs_as_one_loop():
    """A long chain of one repeated 4-op body (cut into 16-op units) runs as one looped program: one launch and
    one compile for any number of units, values as the unit-by-unit run's (bitwise) and CPU's."""
    xc, yc = torch.randn(256), torch.randn(256)
    x, y = xc.to("tpu"), yc.to("tpu")
    torch.tpu.synchronize()
    with torch_tpu.defer_and_fuse(loops=False):
        unrolled = _chain(x, y, 400).cpu()
        runs = metrics.counts.fused_executions
        _chain(x, y, 400).cpu()
        assert metrics.counts.fused_executions - runs == 25  # 400 ops / 16-op units, one launch each
    with torch_tpu.defer_and_fuse():
        looped = _chain(x, y, 400).cpu()  # compiles the loop
        for n in (400, 2000):
            runs, units = metrics.counts.fused_executions, metrics.counts.fused_loop_units
            compiled = metrics.counts.programs_compiled
            out = _chain(x, y, n).cpu()
            assert metrics.counts.fused_executions - runs == 1
            assert metrics.counts.fused_loop_units - units == n // 16
            assert metrics.counts.programs_compiled == compiled  # the iteration count is a runtime input
            torch.testing.assert_close(out, _chain(xc, yc, n), rtol=1e-5, atol=1e-5)
    assert torch.equal(looped, unrolled)
    torch.testing.assert_close(looped, _chain(xc, yc, 400), rtol=1e-5, atol=1e-5)


def test_units_with_other_scalars_or_values_read_later_are_not_looped():
    """Units that read other runtime scalars run one by one (one program, one launch each); a unit whose
    result a later unit reads too is no loop body; values as on CPU in both cases."""
    xc, yc = torch.randn(64), torch.randn(64)
    x, y = xc.to("tpu"), yc.to("tpu")
    torch.tpu.synchronize()

    def scale(i):
        return 1.0 + 1e-4 * (i // 4)  # another value in each 16-op unit

    with torch_tpu.defer_and_fuse():
        _chain(x, y, 160, scale).cpu()
        runs, units = metrics.counts.fused_executions, metrics.counts.fused_loop_units
        out = _chain(x, y, 160, scale).cpu()
        assert metrics.counts.fused_executions - runs == 10 and metrics.counts.fused_loop_units == units
    torch.testing.assert_close(out, _chain(xc, yc, 160, scale), rtol=1e-5, atol=1e-5)

    def skip(x, y):  # an 11-op body that also reads the result of the body two before it
        first = x
        previous = [x, x]
        for _ in range(8):
            for _ in range(3):
                x = torch.tanh(x * 1.0001 + y)
            x = x - 0.25 * previous[0]
            previous = [previous[1], x]
        return x + first

    # Units of one body: each reads its predecessor's and the one before's results, no loop. Units of two
    # bodies (min_period 16): each reads only its predecessor's two results, a loop body.
    for min_period, looped in ((11, False), (16, True)):
        with torch_tpu.defer_and_fuse(min_period=min_period):
            skip(x, y).cpu()
            units = metrics.counts.fused_loop_units
            out = skip(x, y).cpu()
            assert (metrics.counts.fused_loop_units > units) == looped
        torch.testing.assert_close(out, skip(xc, yc), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ errors
class _Probe:
    """A test-only lowering for an op no test uses, removed from the program cache afterwards."""

    op = aten.rad2deg.default

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for key in [k for k in executor.programs if k[0] == str(self.op)]:
            del executor.programs[key]

    def __call__(self, fn, x):
        return executor.execute(spec(self.op), Lowering(self.op, fn), False, x)


def test_lowering_error_surfaces_at_the_recording_line():
    """A lowering that fails while tracing raises when the op is recorded, at the user's line."""
    def broken(x):
        raise ValueError("lowering cannot handle this")

    x = torch.ones(3, device="tpu")
    torch.tpu.synchronize()
    with torch_tpu.defer_and_fuse(), _Probe() as probe:
        y = x + 1
        with pytest.raises(ValueError, match="cannot handle") as info:
            probe(broken, y)  # RECORDING_LINE
        assert any("RECORDING_LINE" in str(entry.statement) for entry in info.traceback)
        assert y.tolist() == [2.0, 2.0, 2.0]  # the graph recorded before the error is intact


def test_runtime_error_in_fused_graph_names_the_recording_line():
    """An error while the fused program runs is a RuntimeError whose note names the recording line."""
    def fails_at_run_time(x):
        def check(value):
            raise RuntimeError("device-side check failed")

        jax.debug.callback(check, x)
        return x * 2

    x = torch.ones(3, device="tpu")
    torch.tpu.synchronize()  # a failed graph loses every value it computes: keep x out of it
    with torch_tpu.defer_and_fuse(), _Probe() as probe:
        z = probe(fails_at_run_time, x + 1)  # RUNTIME_RECORDING_LINE
        with pytest.raises(RuntimeError) as info:
            z.cpu()
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "RUNTIME_RECORDING_LINE" in notes and "test_defer.py" in notes
        with pytest.raises(RuntimeError, match="value was lost"):
            z.cpu()
    assert (x * 5).tolist() == [5.0, 5.0, 5.0]  # the device keeps working


# ------------------------------------------------------------------ threads
def test_threads_record_into_one_graph_safely():
    """Several threads recording at once get their own correct results."""
    results, errors = {}, []

    def work(i):
        try:
            x = torch.full((16,), float(i), device="tpu")
            for _ in range(50):
                x = x * 1.01 + 0.5
            results[i] = x.cpu()
        except Exception as err:  # surfaced below
            errors.append(err)

    with torch_tpu.defer_and_fuse():
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for i in range(4):
        expected = torch.full((16,), float(i))
        for _ in range(50):
            expected = expected * 1.01 + 0.5
        torch.testing.assert_close(results[i], expected)


def test_two_devices_in_one_graph():
    """Ops on tpu:0 and tpu:1 recorded together run as one program per device, with correct values."""
    a_cpu, b_cpu = torch.randn(16), torch.randn(16)
    a, b = a_cpu.to("tpu:0"), b_cpu.to("tpu:1")
    torch.tpu.synchronize()
    with torch_tpu.defer_and_fuse():
        x = (a * 2).sin()
        y = (b + 1).cos()
        runs = metrics.counts.fused_executions
        moved = x.to("tpu:1")  # a materialization point: both devices' work runs
        assert metrics.counts.fused_executions == runs + 2
        z = moved + y
    assert z.device == torch.device("tpu:1")
    torch.testing.assert_close(z.cpu(), (a_cpu * 2).sin() + (b_cpu + 1).cos())


def test_cheap_values_crossing_a_cut_are_recomputed(monkeypatch):
    """A GELU output saved for backward is recomputed in the backward block, not kept: fewer outputs, same loss."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=2, n_embd=32)).to("tpu")
    x, y = torch.randint(0, 40, (2, 16)).to("tpu"), torch.randint(0, 40, (2, 16)).to("tpu")
    torch.tpu.synchronize()

    def step():
        loss = model(x, y)[1]
        loss.backward()
        outputs = metrics.counts.fused_outputs
        value = loss.item()
        model.zero_grad(set_to_none=True)
        return value, metrics.counts.fused_outputs - outputs

    with torch_tpu.defer_and_fuse():
        recomputed = step()
        monkeypatch.setattr(defer, "_cheap", lambda prog: False)
        monkeypatch.setattr(defer, "_plans", {})  # plan the same graph again, recomputing nothing
        kept = step()
    assert recomputed[0] == kept[0]
    assert recomputed[1] < kept[1]
