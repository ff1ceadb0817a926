"""The cost of value checks (docs/reliability.md) on the demo GPT's training step.

Value checks are fixed when a program is built (TORCH_TPU_VALUE_CHECKS), so the two settings
live in two worker processes, both started and warmed up (compilation) before any timing. The
parent then steps them in turns, in rounds ordered on-off-off-on / off-on-on-off (ABBA), a few
steps per turn, only one worker running at a time (the other waits on its pipe). A round's ratio
compares two turns taken seconds apart, so load from other work on a shared machine slows both
alike; a round compares each setting's fastest step in it (load only adds time), and the result
is the median over rounds of those paired ratios (wall time per step, and process CPU time per
step), with their spread (the rounds' 25th-75th percentiles). Only ratios
from one run mean something.
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


def worker(model: str, mode: str, warmup: int) -> None:
    """Warm up, say "ready", then for each "N" line on stdin run N steps and print their times."""
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
    checked = valuecheck.counts["checked ops"] / warmup if warmup else 0
    print(json.dumps({"ready": True, "checked_ops_per_step": checked}), flush=True)
    for line in sys.stdin:
        walls, cpus = [], []
        for _ in range(int(line)):
            start, cpu = time.perf_counter(), time.process_time()
            trainer.step()
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        print(json.dumps({"wall": walls, "cpu": cpus}), flush=True)


class _Worker:
    def __init__(self, setting: str, mode: str, args, cache: str):
        env = dict(os.environ, TORCH_TPU_VALUE_CHECKS="1" if setting == "on" else "0", TORCH_TPU_CACHE="1",
                   TORCH_TPU_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--model", args.model, "--warmup", str(args.warmup), "--worker", setting, mode],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=60)
            raise RuntimeError(f"worker failed (rc {self.process.returncode}): {self.process.stderr.read()[-3000:]}")
        return json.loads(line)

    def steps(self, n: int) -> dict:
        self.process.stdin.write(f"{n}\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _quartiles(values: list) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def measure(mode: str, args, cache: str) -> dict:
    workers = {setting: _Worker(setting, mode, args, cache) for setting in ("on", "off")}
    try:
        rounds = {"wall": [], "cpu": []}
        times = {"on": {"wall": [], "cpu": []}, "off": {"wall": [], "cpu": []}}
        for r in range(args.rounds):
            order = ("on", "off", "off", "on") if r % 2 == 0 else ("off", "on", "on", "off")
            turns = {"on": {"wall": [], "cpu": []}, "off": {"wall": [], "cpu": []}}
            for setting in order:
                got = workers[setting].steps(args.steps)
                for key in ("wall", "cpu"):
                    turns[setting][key] += got[key]
                    times[setting][key] += got[key]
            for key in ("wall", "cpu"):
                # Each round's fastest step per setting: load on a shared machine only adds time.
                rounds[key].append(min(turns["on"][key]) / min(turns["off"][key]))
        row = {setting: {key: statistics.median(v) for key, v in t.items()} for setting, t in times.items()}
        for key in ("wall", "cpu"):
            row[f"{key}_ratio"] = statistics.median(rounds[key])
            row[f"{key}_ratio_iqr"] = _quartiles(rounds[key])
        row["checked_ops_per_step"] = workers["on"].ready["checked_ops_per_step"]
        row["rounds"] = args.rounds
        return row
    finally:
        for w in workers.values():
            w.close()


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--modes", default="strict,defer_and_fuse")
    parser.add_argument("--rounds", type=int, default=8, help="ABBA rounds per mode (each: 4 turns)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per turn")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.worker[1], args.warmup)
        return {}
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for mode in args.modes.split(","):
            row = results[mode] = measure(mode, args, cache)
            (wl, wh), (cl, ch) = row["wall_ratio_iqr"], row["cpu_ratio_iqr"]
            print(f"{args.model} {mode}: step {row['on']['wall'] * 1e3:.1f} ms with value checks, "
                  f"{row['off']['wall'] * 1e3:.1f} ms without: x{row['wall_ratio']:.3f} wall "
                  f"(rounds' IQR {wl:.3f}-{wh:.3f}), x{row['cpu_ratio']:.3f} CPU ({cl:.3f}-{ch:.3f}); "
                  f"{row['checked_ops_per_step']:.0f} checked ops per step; median of {args.rounds} paired ABBA "
                  f"rounds of {args.steps} steps per turn (fastest step per setting and round)", flush=True)
    return results


if __name__ == "__main__":
    main()
