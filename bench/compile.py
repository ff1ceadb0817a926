"""torch.compile(backend="tpu") against the eager modes and PyTorch on CPU: a GPT training step and inference.

Rows (each at float32 matmul precision "highest" and "medium", stated per row):
  strict         eager tpu, one program per op (the default mode)
  defer          eager tpu, DeferAndFuse
  compiled       torch.compile(step, backend="tpu"): the whole step (forward, backward, AdamW) as compiled graphs
  cpu_eager      PyTorch on CPU
  cpu_inductor   torch.compile(step) on CPU (Inductor)
Tasks: `train` (forward + backward + AdamW step) and `infer` (forward under no_grad).

Every row runs in this process, in interleaved rounds after a warm-up (compilation is not
counted), so a noisy machine slows all alike; the median time per step and the ratios are
reported. Only ratios from one run mean anything. Beside the wall time, the process CPU time
per step (every thread: Python, XLA's and PyTorch's workers) is reported, also split by thread
group as bench/modes.py does (main Python thread / XLA compute threads / autograd engine /
other): on a shared machine it moves less with the load, and it is the work a step costs, which
a quiet machine overlaps in part (Strict's Python dispatch runs while the device computes). The model is the demo GPT
(examples/gpt.py) at the size given by the flags.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import torch_tpu  # noqa: E402
import torch_tpu.compile  # noqa: E402
from bench.modes import THREADS, _thread_cpu  # noqa: E402  (CPU time per thread group)
from examples.gpt import GPT, GPTConfig  # noqa: E402

torch_tpu.compile.register()  # an uninstalled checkout has no entry point

MODES = ("strict", "defer", "compiled", "cpu_eager", "cpu_inductor")
PRECISIONS = ("highest", "medium")


def _step(model, opt, idx, targets):
    opt.zero_grad(set_to_none=True)
    loss = model(idx, targets)[1]
    loss.backward()
    opt.step()
    return loss


def _infer(model, idx):
    with torch.no_grad():
        return model(idx)[0]


class Runner:
    def __init__(self, mode: str, task: str, base: GPT, idx, targets):
        self.mode, self.task = mode, task
        device = "cpu" if mode.startswith("cpu") else "tpu"
        self.model = copy.deepcopy(base).to(device)
        self.idx, self.targets = idx.to(device), targets.to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        fn = _step if task == "train" else _infer
        if mode == "compiled":
            fn = torch.compile(fn, backend="tpu")
        elif mode == "cpu_inductor":
            fn = torch.compile(fn)
        self.fn = fn

    def run(self, steps: int) -> tuple[float, float, dict]:
        """(wall seconds, process CPU seconds, {thread group: CPU seconds}) per step; CPU time is steadier on a
        shared machine."""
        start, cpu, threads = time.perf_counter(), time.process_time(), _thread_cpu()
        for _ in range(steps):
            if self.mode == "defer":
                with torch_tpu.execution_mode("defer_and_fuse"):
                    out = self._once()
            else:
                out = self._once()
        float(out.detach().reshape(-1)[0])  # waits for the device (tpu) or nothing (cpu)
        by_thread = {group: (seconds - threads[group]) / steps for group, seconds in _thread_cpu().items()}
        return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps, by_thread

    def _once(self):
        if self.task == "train":
            return self.fn(self.model, self.opt, self.idx, self.targets)
        return self.fn(self.model, self.idx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks", default="train,infer")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    base = GPT(config)
    idx = torch.randint(0, 96, (args.batch, args.seq))
    targets = torch.randint(0, 96, (args.batch, args.seq))
    results = {}
    for task in args.tasks.split(","):
        for level in PRECISIONS:
            torch.set_float32_matmul_precision(level)
            runners = [Runner(mode, task, base, idx, targets) for mode in args.modes.split(",")]
            for r in runners:  # warm-up: every compile happens here
                r.run(2)
            times = {r.mode: [] for r in runners}
            for _ in range(args.rounds):
                for r in runners:
                    times[r.mode].append(r.run(args.steps))
            for mode, ts in times.items():
                results[(task, mode, level)] = (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts),
                                                {g: statistics.median(t[2].get(g, 0.0) for t in ts) for g in THREADS})
    torch.set_float32_matmul_precision("highest")
    print(f"GPT {args.layers} layers, d_model {args.embd}, seq {args.seq}, batch {args.batch}; "
          f"median of {args.rounds} rounds x {args.steps} steps; {torch.get_num_threads()} CPU threads")
    print(f"{'task':6} {'mode':13} {'precision':9} {'ms/step':>9} {'vs cpu_eager@highest':>21} {'vs strict@same':>15}"
          f" {'cpu ms/step':>12} {'cpu vs strict':>14}  cpu ms by thread ({'/'.join(THREADS)})")
    for (task, mode, level), (seconds, cpu_seconds, by_thread) in results.items():
        cpu = results.get((task, "cpu_eager", "highest"))
        strict = results.get((task, "strict", level))
        vs_cpu = f"{cpu[0] / seconds:.2f}x" if cpu else "-"
        vs_strict = f"{strict[0] / seconds:.2f}x" if strict else "-"
        cpu_vs_strict = f"{strict[1] / cpu_seconds:.2f}x" if strict else "-"
        print(f"{task:6} {mode:13} {level:9} {seconds * 1e3:9.2f} {vs_cpu:>21} {vs_strict:>15}"
              f" {cpu_seconds * 1e3:12.2f} {cpu_vs_strict:>14}  {'/'.join(f'{by_thread[g] * 1e3:.1f}' for g in THREADS)}")
    if args.json:
        print(json.dumps({"|".join(k): {"wall": v[0], "cpu": v[1], "thread_cpu": v[2]} for k, v in results.items()}))


if __name__ == "__main__":
    main()
