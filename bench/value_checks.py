"""The cost of value checks (docs/reliability.md) on the demo GPT's training step.

Value checks are fixed when a program is built (TORCH_TPU_VALUE_CHECKS), so the two
settings run in separate processes, alternated (on, off, on, off, ...) so that a shared,
noisy machine slows both alike. Each process: warm-up steps (compilation; the compile
cache is a fresh directory shared by the runs of this benchmark), then timed steps of
bench/modes.py's GPT trainer (AdamW, loss.item() per step), in Strict or DeferAndFuse.
Reported per setting: the median over runs of the median step time (wall) and of the
process CPU time per step; their ratios checks-on / checks-off. Only ratios from one
run mean something.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(model: str, mode: str, steps: int, warmup: int) -> dict:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    import torch_tpu
    from modes import Trainer
    from torch_tpu.eager import valuecheck

    trainer = Trainer(model)
    torch_tpu.set_execution_mode(mode)
    for _ in range(warmup):
        trainer.step()
    torch.tpu.synchronize()
    walls, cpus = [], []
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        trainer.step()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    torch.tpu.synchronize()
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus),
            "checked_ops_per_step": valuecheck.counts["checked ops"] / (warmup + steps)}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--modes", default="strict,defer_and_fuse")
    parser.add_argument("--runs", type=int, default=3, help="processes per setting and mode")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.worker[1], args.steps, args.warmup)))
        return {}
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for mode in args.modes.split(","):
            runs = {"on": [], "off": []}
            for _ in range(args.runs):
                for setting in ("on", "off"):
                    env = dict(os.environ, TORCH_TPU_VALUE_CHECKS="1" if setting == "on" else "0",
                               TORCH_TPU_CACHE="1", TORCH_TPU_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
                    out = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                                          "--warmup", str(args.warmup), "--worker", setting, mode],
                                         env=env, capture_output=True, text=True, timeout=900)
                    if out.returncode != 0:
                        raise RuntimeError(out.stderr[-3000:])
                    runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
            row = {}
            for setting, rs in runs.items():
                row[setting] = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            row["wall_ratio"] = row["on"]["wall"] / row["off"]["wall"]
            row["cpu_ratio"] = row["on"]["cpu"] / row["off"]["cpu"]
            results[mode] = row
            print(f"{args.model} {mode}: step {row['on']['wall'] * 1e3:.1f} ms with value checks, "
                  f"{row['off']['wall'] * 1e3:.1f} ms without: x{row['wall_ratio']:.3f} wall, "
                  f"x{row['cpu_ratio']:.3f} CPU ({row['on']['checked_ops_per_step']:.0f} checked ops per step; "
                  f"median of {args.runs} processes each)", flush=True)
    return results


if __name__ == "__main__":
    main()
