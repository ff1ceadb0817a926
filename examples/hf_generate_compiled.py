"""Generate text on "tpu" with a static KV cache and a compiled decode step.

With `cache_implementation="static"` every decode step has the same shapes, and
`CompileConfig(backend="tpu")` makes the step one XLA program (torch.compile on tpu,
docs/compile.md): 30 new tokens, one compiled program, reused by the next generate call.

    python examples/hf_generate_compiled.py [--tokens 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.hf_common import tiny_llama_dir  # noqa: E402

import torch_tpu  # noqa: E402


def main():
    from transformers import AutoModelForCausalLM, CompileConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=30, help="new tokens per generate call")
    tokens = parser.parse_args().tokens
    torch_tpu.compile.register()  # a checkout that is not pip-installed has no entry point
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(), device_map="tpu")
    prompt = torch.tensor([[1, 17, 42, 99, 5]], device="tpu")
    settings = dict(max_new_tokens=tokens, do_sample=False, cache_implementation="static",
                    compile_config=CompileConfig(backend="tpu", fullgraph=True))
    for attempt in ("first (compiles)", "second (cached)"):
        start = time.perf_counter()
        out = model.generate(prompt, **settings)
        print(f"{attempt}: {time.perf_counter() - start:.1f} s, tokens {out[0, 5:].tolist()}")
    stats = torch_tpu.compile.stats
    print(f"torch.compile: {stats.graphs} graph, {stats.plans} program(s), {stats.calls} decode steps run")
    cpu = AutoModelForCausalLM.from_pretrained(tiny_llama_dir()).generate(prompt.cpu(), max_new_tokens=tokens,
                                                                         do_sample=False)
    print("same tokens as CPU:", cpu.tolist() == out.cpu().tolist())


if __name__ == "__main__":
    main()
