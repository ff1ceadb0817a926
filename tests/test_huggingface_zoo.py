"""The Hugging Face model zoo (tests/hf_zoo.py): tiny random models of 50 Transformers architectures
(dense and MoE decoders, encoders, encoder-decoders, vision, audio, multimodal), each saved to a
directory and loaded with device_map="tpu" and with .to("tpu"); every forward output matches the same
model on CPU. One fresh process with TORCH_TPU_FALLBACK=error: an op without a lowering fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.heavy  # one process, ~3 min on a quiet machine (each architecture compiles its ops once)
def test_model_zoo_matches_cpu():
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_TPU_FALLBACK="error", TORCH_TPU_NUM_CPU_DEVICES="1",
               TORCH_TPU_CACHE="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "hf_zoo.py")], capture_output=True,
                         text=True, timeout=900, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) >= 40, out.stdout[-2000:]
    failed = {r["arch"]: f"{r['stage']}: {r['error']}\n{r.get('traceback', '')}" for r in rows
              if r["status"] != "pass"}
    assert not failed, "\n\n".join(f"{arch} ({why})" for arch, why in failed.items())
