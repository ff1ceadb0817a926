"""transformers.Trainer on tpu (tests/hf_trainer.py): the Trainer picks tpu from Accelerate's public
device hook ACCELERATE_TORCH_DEVICE (no tpu code in the script), fine-tunes a tiny Llama for 20 steps
with its default fused AdamW, and the losses match the same Trainer run on CPU; bf16 mixed precision
with gradient accumulation matches CPU's bf16 run; resuming from the step-10 checkpoint reproduces
steps 11-20. Also: the fused Adam/AdamW step (what the Trainer's default optimizer calls) against CPU's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(*args, tpu=True):
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_TPU_NUM_CPU_DEVICES="1", TORCH_TPU_CACHE="0",
               TORCH_TPU_FALLBACK="error", HF_HUB_OFFLINE="1")
    env.pop("ACCELERATE_TORCH_DEVICE", None)
    if tpu:
        env["ACCELERATE_TORCH_DEVICE"] = "tpu"
    script = os.path.join(ROOT, "tests", "hf_trainer.py")
    return subprocess.Popen([sys.executable, script, *args, *(() if tpu else ("--cpu",))], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc):
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.heavy  # four Trainer processes side by side (~1 min on a quiet machine)
def test_trainer_fine_tunes_llama_on_tpu_like_cpu():
    procs = {"tpu": _launch("--resume"), "cpu": _launch(tpu=False),
             "tpu_bf16": _launch("--bf16", "--accum", "2"), "cpu_bf16": _launch("--bf16", "--accum", "2", tpu=False)}
    res = {name: _result(p) for name, p in procs.items()}
    tpu, cpu = res["tpu"], res["cpu"]
    assert tpu["device"].startswith("tpu") and tpu["param_device"].startswith("tpu")
    assert cpu["device"] == "cpu"
    assert len(tpu["losses"]) == 20
    assert sum(tpu["losses"][-5:]) < sum(tpu["losses"][:5]) - 0.5  # it learns
    assert tpu["losses"] == pytest.approx(cpu["losses"], rel=1e-4, abs=1e-4)
    # Resumed from checkpoint-10: steps 11-20 again, the same losses.
    assert tpu["resumed_losses"][-10:] == pytest.approx(tpu["losses"][-10:], rel=1e-5, abs=1e-5)
    bf16, cpu_bf16 = res["tpu_bf16"], res["cpu_bf16"]
    assert len(bf16["losses"]) == 20 and sum(bf16["losses"][-5:]) < sum(bf16["losses"][:5]) - 0.5
    # bf16 autocast rounds differently op by op on the two devices: close, not equal.
    assert bf16["losses"] == pytest.approx(cpu_bf16["losses"], rel=2e-2, abs=2e-2)


@pytest.mark.parametrize("amsgrad,maximize,scaled", [(False, False, False), (True, True, False), (False, False, True)])
@pytest.mark.parametrize("op", ["_fused_adamw_", "_fused_adam_"])
def test_fused_adam_step_matches_cpu(op, amsgrad, maximize, scaled):
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5,)]
    # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (the last two >= 0)
    tensors = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]
    tensors[3:] = [[t.abs() for t in ts] for ts in tensors[3:]]
    if not amsgrad:
        tensors[4] = []  # PyTorch's contract: empty unless amsgrad
    steps = [torch.tensor(3.0), torch.tensor(3.0)]
    extra = {"grad_scale": torch.tensor(4.0), "found_inf": torch.tensor(0.0)} if scaled else {}
    kwargs = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.05, eps=1e-8, amsgrad=amsgrad, maximize=maximize)
    on_cpu = [[t.clone() for t in ts] for ts in tensors]
    on_tpu = [[t.to("tpu") for t in ts] for ts in tensors]
    getattr(torch, op)(*on_cpu, steps, **kwargs, **extra)
    getattr(torch, op)(*on_tpu, [s.to("tpu") for s in steps], **kwargs,
                       **{k: v.to("tpu") for k, v in extra.items()})
    for got_list, want_list in zip(on_tpu, on_cpu):
        for got, want in zip(got_list, want_list):
            torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-5)


def test_fused_adam_found_inf_skips_the_step():
    params = [torch.randn(3)]
    tpu = [params[0].to("tpu")]
    torch._fused_adamw_(tpu, [torch.ones(3, device="tpu")], [torch.zeros(3, device="tpu")],
                        [torch.zeros(3, device="tpu")], [], [torch.tensor(1.0, device="tpu")], lr=0.1, beta1=0.9,
                        beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                        grad_scale=torch.tensor(1.0, device="tpu"), found_inf=torch.tensor(1.0, device="tpu"))
    assert torch.equal(tpu[0].cpu(), params[0])
