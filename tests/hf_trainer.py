"""transformers.Trainer fine-tunes a tiny Llama; run as a script by tests/test_huggingface_trainer.py.

The script names no device: the Trainer (through Accelerate) takes it from ACCELERATE_TORCH_DEVICE,
or the CPU with --cpu. It prints one JSON line: {"device", "losses", "resumed_losses"}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_zoo  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=80, length=16):
        g = torch.Generator().manual_seed(5)
        # A learnable pattern: each sequence counts up from a random start (mod the vocabulary).
        starts = torch.randint(0, hf_zoo.VOCAB, (n, 1), generator=g)
        self.ids = (starts + torch.arange(length)) % hf_zoo.VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    import transformers as tf

    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="train again from the checkpoint at half way")
    args = parser.parse_args()
    tf.logging.set_verbosity_error()
    torch.set_float32_matmul_precision("highest")

    def run(out_dir, resume=None):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(hf_zoo.shrink("llama"))
        targs = tf.TrainingArguments(
            output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=4,
            gradient_accumulation_steps=args.accum, learning_rate=3e-3, lr_scheduler_type="constant",
            logging_steps=1, save_steps=args.steps // 2, save_strategy="steps", report_to=[], use_cpu=args.cpu,
            bf16=args.bf16, dataloader_num_workers=0, seed=0, data_seed=0, disable_tqdm=True)
        trainer = tf.Trainer(model=model, args=targs, train_dataset=Tokens())
        trainer.train(resume_from_checkpoint=resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer, losses

    with tempfile.TemporaryDirectory() as out:
        trainer, losses = run(out)
        result = {"device": str(trainer.args.device), "param_device": str(next(trainer.model.parameters()).device),
                  "losses": losses}
        if args.resume:
            _, resumed = run(out, resume=os.path.join(out, f"checkpoint-{args.steps // 2}"))
            result["resumed_losses"] = resumed
    print(json.dumps(result))


if __name__ == "__main__":
    main()
