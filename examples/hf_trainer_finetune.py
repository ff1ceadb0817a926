"""Fine-tune a small Llama-style LM with transformers.Trainer on "tpu".

The training code is the usual device-agnostic Trainer script: the Trainer gets its device from
Accelerate, and Accelerate's public device hook ACCELERATE_TORCH_DEVICE names tpu (set below as a
default; `ACCELERATE_TORCH_DEVICE=cpu python examples/hf_trainer_finetune.py` runs the same on CPU).
bf16 mixed precision, gradient accumulation and a checkpoint resume, as in docs/huggingface.md.

    python examples/hf_trainer_finetune.py [--steps 40] [--bf16]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "tpu")  # before Accelerate reads it

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.hf_common import tiny_llama_dir  # noqa: E402


class CountingData(torch.utils.data.Dataset):
    """Sequences that count up from a random start: a pattern a tiny LM learns in a few dozen steps."""

    def __init__(self, n=256, length=32, vocab=256):
        starts = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="hf-trainer-")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(out))
    targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
                              gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=min(5, max(1, args.steps // 2)),
                              save_steps=args.steps // 2, report_to=[], bf16=args.bf16, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=CountingData())
    print(f"training on {targs.device}")
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("losses:", ", ".join(f"{x:.3f}" for x in losses))
    # Resume from the half-way checkpoint: the second half again.
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_llama_dir(out)), args=targs,
                      train_dataset=CountingData())
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{args.steps // 2}"))
    print("resumed, final loss:", f"{trainer.state.log_history[-2]['loss']:.3f}")
    trainer.save_model(os.path.join(out, "final"))
    print("saved to", os.path.join(out, "final"))


if __name__ == "__main__":
    main()
