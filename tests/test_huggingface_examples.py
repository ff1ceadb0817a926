"""Every examples/hf_*.py runs, with its smallest settings, in a fresh process with a hard timeout,
and what it prints about tpu against CPU holds (same tokens, small differences, device tpu:0)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _number(pattern, text):
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in output:\n{text[-2000:]}"
    return float(found.group(1))


def _trainer(out):
    assert "training on tpu:0" in out
    losses = [float(x) for x in re.search(r"losses: (.*)", out).group(1).split(", ")]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses
    assert 0 < _number(r"resumed, final loss: ([\d.]+)", out) < 20


def _generate(out):
    assert "same tokens as CPU: True" in out
    assert "torch.compile: 1 graph, 1 program(s)" in out  # the decode step, reused by the second call
    first, second = re.findall(r"\(\w+\): [\d.]+ s, tokens (\[.*\])", out)
    assert first == second


def _vit(out):
    assert len(re.findall(r"image \d: (cat|dog|bird)", out)) == 4
    assert _number(r"logit difference: ([\d.e+-]+)", out) < 1e-2  # float32 matmuls in bf16 (precision "medium")


def _diffusers(out):
    assert "pipeline on tpu:0: images (2, 16, 16, 3)" in out
    assert _number(r"pixel difference: ([\d.e+-]+)", out) < 5e-2


def _migrate(out):
    assert 'dist.init_process_group("tpu_dist")' in out and 'device_map="tpu"' in out
    tokens = re.search(r"generated on tpu:0 (\[\[.*\]\])", out)
    assert tokens and len(ast.literal_eval(tokens.group(1))[0]) == 3 + 8, out[-2000:]


# (script, smallest arguments, check of its output); seconds seen on the loaded 2-core machine.
CASES = [
    ("hf_vit_classify.py", [], _vit),                     # ~12 s
    ("hf_migrate_from_cuda.py", [], _migrate),            # ~22 s
    ("hf_diffusers_pipeline.py", ["--steps", "2"], _diffusers),
    ("hf_generate_compiled.py", ["--tokens", "4"], _generate),
    ("hf_trainer_finetune.py", ["--steps", "4"], _trainer),
]


@pytest.mark.heavy
@pytest.mark.parametrize("script,args,check", CASES, ids=[c[0] for c in CASES])
def test_example_runs(script, args, check):
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_TPU_NUM_CPU_DEVICES="1", TORCH_TPU_CACHE="0",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_TORCH_DEVICE", None)  # the trainer example sets its own default
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True,
                         text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    check(out.stdout)
