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


@pytest.mark.parametrize("mode", ["strict", "debug"])
def test_cholesky_from_compile_cache_does_not_crash(tmp_path, mode):
    """The segfault of issue 13: a LAPACK custom call loaded from the compile cache ran before
    jaxlib had filled its function pointers. The second process loads every program from the cache."""
    env = {"TORCH_TPU_CACHE": "1", "TORCH_TPU_CACHE_DIR": str(tmp_path / "cache"),
           "TORCH_TPU_LAUNCH_BLOCKING": "1" if mode == "debug" else "0", "TORCH_TPU_DEFER_AND_FUSE": "0"}
    for attempt in ("compiles", "loads"):
        result = _run(_CHOLESKY, env)
        assert result.returncode == 0 and "OK" in result.stdout, (attempt, result.returncode, result.stderr[-3000:])
