"""Migrating a CUDA Hugging Face script to "tpu": `torch-tpu migrate` rewrites the device strings
("cuda" -> "tpu", `device_map="cuda"` -> "tpu", backend "nccl" -> "tpu_dist"); this example shows the
rewrite of a typical script and then runs the rewritten inference part.

    python examples/hf_migrate_from_cuda.py          # or: torch-tpu migrate path/to/your_script.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.hf_common import tiny_llama_dir  # noqa: E402

from torch_tpu import migrate  # noqa: E402

CUDA_SCRIPT = '''
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

def setup_distributed():
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())

def generate(path):
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda")
    ids = torch.tensor([[1, 17, 42]]).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model.generate(ids, max_new_tokens=8, do_sample=False)
'''


def main():
    rewritten, findings = migrate.rewrite_source(CUDA_SCRIPT, "cuda_script.py")
    print("--- findings")
    for finding in findings:
        print(finding)
    print("--- rewritten script")
    print(rewritten)
    namespace: dict = {}
    exec(compile(rewritten, "rewritten.py", "exec"), namespace)  # the rewritten code, as the user would run it
    out = namespace["generate"](tiny_llama_dir())
    print("generated on", out.device, out.tolist())


if __name__ == "__main__":
    main()
