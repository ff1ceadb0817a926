"""The recompilation explainer (torch_tpu/recompiles.py) and the long-compile notice."""
from __future__ import annotations

import inspect
import threading
import warnings

import pytest
import torch

import torch_tpu
from torch_tpu import compile_notice, metrics, recompiles
from torch_tpu.config import config


@pytest.fixture
def explain(monkeypatch):
    """Log every recompile; a fresh explainer."""
    recompiles.reset()
    monkeypatch.setattr(config, "explain_recompiles", True)
    yield
    recompiles.reset()


def _line_of(fn, text: str) -> int:
    """The line number of the line of `fn` containing `text`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _grow(steps):
    out = []
    for T in steps:
        x = torch.ones(3, T, device="tpu")
        y = (x * 3).sum()  # the loop's line
        out.append(y.item())
    return out


def test_changing_sequence_length_is_explained_at_the_loop_line(explain, capfd):
    steps = (37, 38, 39, 40)
    values = _grow(steps)
    assert values == [3.0 * 3 * T for T in steps]  # same as PyTorch CPU: (ones * 3).sum()
    line = _line_of(_grow, "the loop's line")
    err = capfd.readouterr().err
    logged = [ln for ln in err.splitlines() if ln.startswith("[torch_tpu recompile] aten.mul.Tensor")]
    assert len(logged) == len(steps) - 1, err
    for (old, new), text in zip(zip(steps, steps[1:]), logged):
        assert f"test_recompiles.py:{line} (_grow)" in text
        assert f"argument 'self' size[1]: {old} -> {new}" in text
    site = next(s for s in recompiles.summary(100)
                if s["name"] == "aten.mul.Tensor" and f"test_recompiles.py:{line} " in s["where"])
    assert site["recompiles"] == len(steps) - 1
    assert site["reasons"] == {"shape": len(steps) - 1}
    assert site["last"][0] == {"what": "argument 'self' size[1]", "kind": "shape", "old": 39, "new": 40}
    assert "pad or bucket" in site["fix"]


def _scaled(x, factors):
    out = []
    for f in factors:
        out.append((x * f).cpu())  # a Python float that changes every step
    return out


def test_python_float_scalar_changing_per_step_does_not_recompile(explain, capfd):
    x = torch.randn(5, 29)
    factors = [0.1, 0.2, 0.35, 1e-3, 7.5]
    xt = x.to("tpu")
    torch.tpu.synchronize()  # DeferAndFuse: the copy runs now, not in the first step's graph
    first = _scaled(xt, factors[:1])
    misses = metrics.counts.cache_misses
    compiled = metrics.counts.programs_compiled
    rest = _scaled(xt, factors[1:])
    assert metrics.counts.cache_misses == misses  # every later step reused the op's program
    assert metrics.counts.programs_compiled == compiled  # and compiled nothing (fused programs included)
    for got, f in zip(first + rest, factors):
        torch.testing.assert_close(got, x * f)
    line = _line_of(_scaled, "a Python float")
    assert not [s for s in recompiles.summary(100) if f"test_recompiles.py:{line} " in s["where"]]
    assert "[torch_tpu recompile]" not in capfd.readouterr().err


def _reduce(x, dims):
    return [x.sum(dim=d).cpu() for d in dims]  # a static argument that changes


def test_static_argument_change_recompiles_and_is_explained(explain, capfd):
    x = torch.randn(4, 31)
    got = _reduce(x.to("tpu"), (0, 1))
    torch.testing.assert_close(got[0], x.sum(dim=0))
    torch.testing.assert_close(got[1], x.sum(dim=1))
    line = _line_of(_reduce, "a static argument")
    err = capfd.readouterr().err
    assert f"test_recompiles.py:{line} (<listcomp>)" in err or f"test_recompiles.py:{line} (_reduce)" in err, err
    assert "static argument 'dim': (0,) -> (1,)" in err
    site = next(s for s in recompiles.summary(100)
                if s["name"] == "aten.sum.dim_IntList" and f"test_recompiles.py:{line} " in s["where"])
    assert site["reasons"] == {"static": 1}
    assert "as a tensor" in site["fix"]


def _dtypes(x):
    return [x.to(dtype).neg().cpu() for dtype in (torch.float32, torch.bfloat16)]  # dtype changes


def test_dtype_change_is_explained(explain, capfd):
    x = torch.randn(3, 23)
    got = _dtypes(x.to("tpu"))
    torch.testing.assert_close(got[1], x.to(torch.bfloat16).neg())
    assert "argument 'self' dtype: torch.float32 -> torch.bfloat16" in capfd.readouterr().err


def test_one_time_warning_after_the_limit(explain, monkeypatch):
    monkeypatch.setattr(config, "explain_recompiles", False)
    monkeypatch.setattr(config, "recompile_warn_limit", 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _grow((41, 42, 43, 44, 45))
    ours = [w for w in caught if issubclass(w.category, recompiles.RecompileWarning)]
    line = _line_of(_grow, "the loop's line")
    at_line = [w for w in ours if w.lineno == line and w.filename == __file__]  # attributed to the user's line
    assert len(at_line) == 1  # once per line (mul and sum recompile there), however often after
    text = str(at_line[0].message)
    assert text.startswith(("aten.mul.Tensor", "aten.sum.default")), text
    assert "pad or bucket" in text and "TORCH_TPU_EXPLAIN_RECOMPILES=1" in text


def test_metrics_report_lists_top_recompiling_sites(explain, monkeypatch):
    monkeypatch.setattr(config, "explain_recompiles", False)
    _grow((46, 47, 48))
    report = metrics.report()
    line = _line_of(_grow, "the loop's line")
    rows = [r for r in report.splitlines() if r.startswith("recompiles: aten.mul.Tensor")]
    assert rows and f"test_recompiles.py:{line}" in rows[0] and "2 recompiles" in rows[0], report
    assert recompiles.total() >= 2


def test_graph_hook_for_torch_compile(explain, capfd):
    recompiles.graph_compiled("forward", [torch.ones(2, 3), 4], where=("model.py", 10, "f"))
    recompiles.graph_compiled("forward", [torch.ones(2, 5), 4], where=("model.py", 10, "f"))
    recompiles.graph_compiled("forward", [torch.ones(2, 5), 5], where=("model.py", 10, "f"))
    recompiles.graph_compiled("forward", [torch.ones(2, 5).t(), 5], where=("model.py", 10, "f"))
    recompiles.graph_compiled("forward", [torch.ones(5, 2, dtype=torch.bfloat16), 5], where=("model.py", 10, "f"))
    err = capfd.readouterr().err
    assert "because input 0 dtype: torch.float32 -> torch.bfloat16" in err, err
    assert "forward at model.py:10 (f): compile #2 of this site because input 0 size[1]: 3 -> 5" in err
    assert "because static input 1: 4 -> 5" in err
    assert "input 0 shape (rank)" not in err and "input 0 size[0]: 2 -> 5" in err
    site = recompiles.summary()[0]
    assert site["kind"] == "graph" and site["recompiles"] == 4


def test_compiled_graph_recompile_is_explained(explain, capfd):
    """A torch.compile graph given a new concrete size (dynamic=True) compiles again, explained."""
    import torch_tpu.compile

    torch_tpu.compile.register()
    fn = torch.compile(lambda x: (x * 2).sum(-1), backend="tpu", dynamic=True)
    for T in (5, 6):
        x = torch.ones(2, T)
        assert torch.equal(fn(x.to("tpu")).cpu(), (x * 2).sum(-1))  # same as PyTorch CPU
    logged = [ln for ln in capfd.readouterr().err.splitlines()
              if ln.startswith("[torch_tpu recompile]") and " graph " in ln]
    assert len(logged) == 1, logged
    assert "test_recompiles.py:" in logged[0] and "size[1]: 5 -> 6" in logged[0], logged[0]
    site = next(s for s in recompiles.summary(100) if s["kind"] == "graph")
    assert site["recompiles"] == 1 and site["reasons"].get("shape") == 1


def test_first_compile_of_a_site_is_not_a_recompile(explain, capfd):
    torch.full((3, 53), 2.0, device="tpu").exp().cpu()
    assert "[torch_tpu recompile]" not in capfd.readouterr().err


def _scale_all(tensors):
    for t in tensors:
        t.mul_(2)  # one line, many shapes, one pass


def test_many_shapes_in_one_pass_are_not_recompiles(explain, capfd):
    # Like model.to(device) or an optimizer step over parameters of different shapes: distinct programs.
    tensors = [torch.ones(3, 59, device="tpu"), torch.ones(59, device="tpu"), torch.ones(2, 2, 59, device="tpu")]
    _scale_all(tensors)
    assert [t.cpu().sum().item() for t in tensors] == [2.0 * 3 * 59, 2.0 * 59, 2.0 * 4 * 59]
    _scale_all(tensors)  # the second pass: every program is reused
    assert [t.cpu().sum().item() for t in tensors] == [4.0 * 3 * 59, 4.0 * 59, 4.0 * 4 * 59]
    line = _line_of(_scale_all, "one line, many shapes")
    assert not [s for s in recompiles.summary(100) if f"test_recompiles.py:{line} " in s["where"]]
    assert f"test_recompiles.py:{line} " not in capfd.readouterr().err


@pytest.mark.skipif(not config.defer_and_fuse, reason="checks DeferAndFuse segments; the strict run has its own")
def test_defer_segment_recompile_names_the_changed_dimension(explain, capfd):
    _grow((57, 58))
    err = capfd.readouterr().err
    line = _line_of(_grow, "the loop's line")
    fused = [ln for ln in err.splitlines() if "fused segment" in ln]
    assert fused, err
    assert any(f"test_recompiles.py:{line}" in ln and "size[1]: 57 -> 58" in ln for ln in fused), fused


def test_defer_segment_recompile_in_a_defer_block(explain, capfd):
    with torch_tpu.defer_and_fuse():
        _grow((61, 62))
    err = capfd.readouterr().err
    line = _line_of(_grow, "the loop's line")
    fused = [ln for ln in err.splitlines() if "fused segment" in ln]
    assert any(f"test_recompiles.py:{line}" in ln and "size[1]: 61 -> 62" in ln for ln in fused), err
    assert any(s["kind"] == "segment" for s in recompiles.summary(100))


def test_long_compile_notice_names_what_compiles(monkeypatch, capfd):
    monkeypatch.setattr(config, "compile_notice_seconds", 1e-9)  # every compile is "long"
    before = compile_notice.notices
    torch.arange(67, device="tpu").float().sqrt().cpu()  # a new shape: new programs
    err = capfd.readouterr().err
    assert compile_notice.notices > before
    assert "[torch_tpu] " in err and ("aten.sqrt.default" in err or "a fused graph" in err), err
    assert "test_recompiles.py:" in err


def test_long_compile_notice_while_still_compiling(monkeypatch, capfd):
    monkeypatch.setattr(config, "compile_notice_seconds", 0.01)
    before = compile_notice.notices
    release = threading.Event()
    with compile_notice.watch("a slow graph"):
        for _ in range(3000):  # the notice thread speaks while this one is still "compiling"
            if compile_notice.notices > before:
                break
            release.wait(0.01)
    assert compile_notice.notices == before + 1  # exactly one line, even though it also ended late
    err = capfd.readouterr().err
    assert "[torch_tpu] a slow graph" in err and "so far" in err


def test_notice_off_at_zero(monkeypatch, capfd):
    monkeypatch.setattr(config, "compile_notice_seconds", 0.0)
    before = compile_notice.notices
    torch.arange(71, device="tpu").float().sqrt().cpu()
    assert compile_notice.notices == before


def test_env_vars_parse_and_reject_bad_values(monkeypatch):
    from torch_tpu.config import Config

    monkeypatch.setenv("TORCH_TPU_EXPLAIN_RECOMPILES", "1")
    monkeypatch.setenv("TORCH_TPU_RECOMPILE_WARN_LIMIT", "3")
    monkeypatch.setenv("TORCH_TPU_COMPILE_NOTICE_SECONDS", "2.5")
    monkeypatch.setenv("TORCH_TPU_METRICS_FILE", "/tmp/m-{pid}.json")
    fresh = Config()
    assert (fresh.explain_recompiles, fresh.recompile_warn_limit, fresh.compile_notice_seconds,
            fresh.metrics_file) == (True, 3, 2.5, "/tmp/m-{pid}.json")
    monkeypatch.setenv("TORCH_TPU_COMPILE_NOTICE_SECONDS", "-1")
    with pytest.raises(ValueError, match="TORCH_TPU_COMPILE_NOTICE_SECONDS"):
        Config()
    monkeypatch.setenv("TORCH_TPU_COMPILE_NOTICE_SECONDS", "soon")
    with pytest.raises(ValueError, match="TORCH_TPU_COMPILE_NOTICE_SECONDS"):
        Config()
    monkeypatch.delenv("TORCH_TPU_COMPILE_NOTICE_SECONDS")
    monkeypatch.setenv("TORCH_TPU_RECOMPILE_WARN_LIMIT", "0")
    with pytest.raises(ValueError, match="TORCH_TPU_RECOMPILE_WARN_LIMIT"):
        Config()
