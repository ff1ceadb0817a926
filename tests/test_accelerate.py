"""Hugging Face Accelerate trains on tpu through its public device hook (ACCELERATE_TORCH_DEVICE),
with no tpu code in the script; the losses match the same training in plain PyTorch on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Device-agnostic: nothing here names tpu (the device comes from the environment).
SCRIPT = r"""
import json, torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(80, 8, generator=g), torch.randn(80, 1, generator=g))
loader = DataLoader(data, batch_size=16)
model, opt, loader = accelerator.prepare(model, opt, loader)
losses = []
for x, y in loader:
    loss = F.mse_loss(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print(json.dumps({"device": str(accelerator.device), "x_device": str(x.device),
                  "param_device": str(next(model.parameters()).device), "losses": losses}))
"""


def _reference_losses():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(80, 8, generator=g), torch.randn(80, 1, generator=g)
    losses = []
    for i in range(0, 80, 16):
        loss = torch.nn.functional.mse_loss(model(xs[i:i + 16]), ys[i:i + 16])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.heavy  # a fresh process (~35 s); the same in both modes
def test_accelerator_trains_mlp_on_tpu():
    env = dict(os.environ, ACCELERATE_TORCH_DEVICE="tpu", PYTHONPATH=ROOT, TORCH_TPU_NUM_CPU_DEVICES="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "tpu" or result["device"].startswith("tpu")
    assert result["x_device"].startswith("tpu") and result["param_device"].startswith("tpu")
    assert len(result["losses"]) == 5
    # tpu's default float32 matmul precision is "medium" (bf16 multiply): close, not bitwise.
    assert result["losses"] == pytest.approx(_reference_losses(), rel=3e-2, abs=3e-3)
