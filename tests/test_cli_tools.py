"""`torch-tpu migrate`, `doctor` and `report` (torch_tpu/migrate.py, cli_migrate.py, cli_doctor.py, cli_report.py)."""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from torch_tpu import cli, metrics_file, migrate, recompiles
from torch_tpu.config import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "migrate_repo")
# CLI tools do not depend on the execution mode: the Strict pass runs them (make test-defer leaves them out).
pytestmark = pytest.mark.one_mode


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TORCH_TPU_DEFER_AND_FUSE", None)
    env.update(extra)
    return env


def _planted(root: str) -> collections.Counter:
    """(relative path, line, mechanical) -> count, from the `# planted: kind ...` comments."""
    out = collections.Counter()
    for path in migrate.python_files(root):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                match = re.search(r"# planted: ([a-z ]+)$", line.rstrip())
                if match:
                    for kind in match.group(1).split():
                        out[(os.path.relpath(path, root), number, kind == "mechanical")] += 1
    return out


def _found(findings, root: str) -> collections.Counter:
    return collections.Counter((os.path.relpath(f.path, root), f.line, f.mechanical) for f in findings)


@pytest.fixture
def repo(tmp_path):
    """A copy of the fixture repository, a file beside it (outside PATH) and a link to it from inside."""
    target = tmp_path / "repo"
    shutil.copytree(FIXTURE, target)
    outside = tmp_path / "outside.py"
    outside.write_text('import torch\nx = torch.ones(1).cuda()\n')
    os.symlink(outside, target / "linked.py")
    return target


def test_migrate_reports_every_planted_case_with_its_line(repo):
    findings, errors = migrate.scan(str(repo))
    assert not errors
    planted = _planted(str(repo))
    assert sum(planted.values()) == 29  # the fixture's planted cases, both kinds
    assert _found(findings, str(repo)) == planted
    categories = {f.category for f in findings}
    assert categories == {migrate.XLA, migrate.CUDA}
    by_what = {f.what: f for f in findings}
    assert by_what["xm.mark_step()"].replacement.startswith("nothing")
    assert by_what['"nccl"'].replacement == '"tpu_dist"'
    assert "torchrun" in by_what["xmp.spawn(fn, args=(), nprocs=8)"].replacement


def test_migrate_cli_report_json_and_check(repo, capsys):
    assert cli.main(["migrate", str(repo), "--check"]) == 1
    text = capsys.readouterr().out
    assert f"{repo}{os.sep}train.py:15: [pytorch/xla, mechanical] xm.xla_device() -> torch.device(\"tpu\")" in text
    assert "29 findings: 19 mechanical" in text
    assert cli.main(["migrate", str(repo), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["findings"]) == 29 and data["left"] == 29 and data["applied"] == 0
    assert {"path", "line", "column", "category", "what", "replacement", "mechanical"} <= set(data["findings"][0])


def test_migrate_apply_rewrites_and_the_script_trains_on_tpu(repo, capsys, tmp_path):
    outside = (tmp_path / "outside.py").read_text()
    before = (repo / "train.py").read_text()
    assert cli.main(["migrate", str(repo), "--apply", "--check"]) == 1  # manual cases are left in dist/
    out = capsys.readouterr().out
    assert "-        xm.mark_step()  # planted: mechanical" in out  # the diff
    assert "rewrote 19 mechanical cases; 10 left to change by hand" in out
    after = (repo / "train.py").read_text()
    assert (tmp_path / "outside.py").read_text() == outside  # never touched outside PATH, links not followed
    assert "torch_xla" not in after and "cuda" not in after and "xm." not in after
    assert "# PyTorch/XLA needs a step boundary here; tpu runs eagerly." in after  # comments kept
    assert after.splitlines()[:6] == before.splitlines()[:6]  # formatting kept
    assert cli.main(["migrate", str(repo / "train.py"), "--check"]) == 0  # nothing left there
    left, _ = migrate.scan(str(repo))
    assert all(not f.mechanical for f in left) and len(left) == 10

    metrics_path = tmp_path / "metrics.json"
    run = subprocess.run([sys.executable, str(repo / "train.py")], capture_output=True, text=True, timeout=300,
                         env=_env(TORCH_TPU_METRICS_FILE=str(metrics_path)))
    assert run.returncode == 0, run.stderr
    match = re.search(r"device=(\w+) first=([\d.]+) last=([\d.]+)", run.stdout)
    assert match and match.group(1) == "tpu", run.stdout
    assert float(match.group(3)) < float(match.group(2))  # it trained
    assert "platform=tpu" in run.stdout

    # The runtime wrote its metrics at exit; `torch-tpu report` renders them.
    data = json.loads(metrics_path.read_text())
    assert data["counters"]["ops_executed"] > 0
    assert cli.main(["report", str(metrics_path)]) == 0
    table = capsys.readouterr().out
    assert "ops executed" in table and str(data["counters"]["ops_executed"]) in table
    assert "compile cache" in table


def test_migrate_leaves_clean_code_alone(tmp_path, capsys):
    clean = tmp_path / "clean.py"
    clean.write_text('import torch\nx = torch.ones(2, device="tpu")  # already tpu\nname = "cudagraph"\n')
    assert cli.main(["migrate", str(tmp_path), "--check"]) == 0
    assert "0 findings" in capsys.readouterr().out
    assert cli.main(["migrate", str(tmp_path / "missing")]) == 2


def test_migrate_rewrite_details():
    source = (
        "import torch\n"
        "import torch_xla.core.xla_model as xm\n"
        "def f(rank, t):\n"
        "    # only a sync here\n"
        "    xm.mark_step()\n"
        "    t = t.cuda(rank)\n"
        "    print(f\"on {torch.cuda.current_device()} {xm.xla_device()}\")\n"
        "    if rank: xm.mark_step()\n"
        "    return t\n"
    )
    new, findings = migrate.rewrite_source(source)
    assert new == (
        "import torch\n"
        "def f(rank, t):\n"
        "    # only a sync here\n"
        "    t = t.to(torch.device(\"tpu\", rank))\n"
        "    print(f\"on {torch.tpu.current_device()} {torch.device('tpu')}\")\n"
        "    if rank: pass\n"
        "    return t\n"
    )
    compile(new, "<rewritten>", "exec")
    assert all(f.mechanical for f in findings)


def test_doctor_reports_an_unwritable_cache_directory_with_its_fix(tmp_path, capsys):
    from torch_tpu import cache

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "cache"  # under a regular file: no user, root included, can create it
    with cache.configured(enabled=True, dir=str(bad)):
        code = cli.main(["doctor", "--no-dist"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"[PROBLEM] cache level 2 (host): {bad}: refused: cannot create it" in out
    assert "fix: make" in out and "TORCH_TPU_CACHE_DIR" in out
    assert "1 problem found" in out


def test_doctor_fix_for_a_directory_others_can_write(tmp_path):
    from torch_tpu import cli_doctor

    assert cli_doctor._host_fix("/x", "other users can write to it (mode 0777)").startswith("chmod 700 /x")


def test_report_renders_a_metrics_file(tmp_path, capsys, monkeypatch):
    recompiles.reset()
    monkeypatch.setattr(config, "explain_recompiles", False)
    for n in (83, 84, 85):
        torch.ones(n, device="tpu").neg().cpu()  # a recompiling site
    path = metrics_file.write(str(tmp_path / "run-{pid}.json"))
    assert path.endswith(f"run-{os.getpid()}.json")
    assert cli.main(["report", path]) == 0
    out = capsys.readouterr().out
    assert "top recompiling sites" in out and "aten.neg.default" in out and "test_cli_tools.py" in out
    assert cli.main(["report", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    site = next(s for s in data["recompiles"] if s["name"] == "aten.neg.default")
    assert "pad or bucket" in site["fix"]
    assert site["recompiles"] == 2 and site["last"][0]["old"] == 84 and site["last"][0]["new"] == 85
    (tmp_path / "bad.json").write_text("{}")
    assert cli.main(["report", str(tmp_path / "bad.json")]) == 2
    assert "not a torch_tpu metrics file" in capsys.readouterr().err
    recompiles.reset()


def test_every_env_var_is_documented():
    with open(os.path.join(ROOT, "torch_tpu", "config.py"), encoding="utf-8") as f:
        declared = set(re.findall(r'"(TORCH_TPU_[A-Z0-9_]+)"', f.read()))
    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        usage = f.read()
    assert {"TORCH_TPU_EXPLAIN_RECOMPILES", "TORCH_TPU_METRICS_FILE"} <= declared
    assert sorted(v for v in declared if v not in usage) == []


def test_troubleshooting_lists_every_recompile_reason():
    with open(os.path.join(ROOT, "docs", "troubleshooting.md"), encoding="utf-8") as f:
        text = f.read()
    assert [kind for kind in recompiles.FIXES if f"| {kind} |" not in text] == []


def test_docs_nav_hook_drops_missing_pages_and_lists_unnamed_ones(tmp_path):
    sys.path.insert(0, ROOT)
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(ROOT)
    (tmp_path / "index.md").write_text("# a")
    (tmp_path / "extra.md").write_text("# b")
    config = {"docs_dir": str(tmp_path), "nav": [{"Home": "index.md"}, {"Later": "not-yet.md"},
                                                  {"Group": [{"Gone": "gone.md"}]}]}
    assert mkdocs_hooks.on_config(config)["nav"] == [{"Home": "index.md"}, {"More": ["extra.md"]}]
