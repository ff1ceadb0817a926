"""PEFT (LoRA) on tpu as its users run it: get_peft_model, a few AdamW steps on the adapters only,
merge_and_unload, and an adapter's save_pretrained/from_pretrained round trip, against CPU. A tiny
Llama built from a config; nothing is downloaded."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch_tpu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_zoo  # noqa: E402

tf.logging.set_verbosity_error()


def _lora(base, **overrides):
    torch.manual_seed(1)  # the adapters' gaussian init, the same on both devices (drawn on CPU)
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                  init_lora_weights="gaussian")
    return peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**{**config, **overrides}))


def _fine_tune(base, ids, device):
    model = _lora(base).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.device.type == device for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    merged = model.merge_and_unload()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        return losses, merged(input_ids=ids.to(device)).logits.cpu()


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(hf_zoo.shrink("llama")).eval()


@pytest.mark.heavy  # two fine-tunes (CPU and tpu) of a tiny Llama (~30 s); the same in both modes
def test_lora_fine_tune_and_merge_match_cpu(base):
    ids = torch.randint(4, hf_zoo.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch_tpu.precision.use("highest"):
        cpu_losses, cpu_logits = _fine_tune(base, ids, "cpu")
        tpu_losses, tpu_logits = _fine_tune(base, ids, "tpu")
    assert cpu_losses[-1] < cpu_losses[0]
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tpu_logits, cpu_logits, rtol=1e-3, atol=1e-3)


def test_lora_adapter_save_and_load_on_tpu(base, tmp_path):
    ids = torch.randint(4, hf_zoo.VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    model = _lora(base).to("tpu")
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base).to("tpu"), tmp_path)
    assert all(p.device.type == "tpu" for p in loaded.parameters())
    with torch.no_grad():
        expected = model(input_ids=ids.to("tpu")).logits.cpu()
        assert torch.equal(loaded(input_ids=ids.to("tpu")).logits.cpu(), expected)
