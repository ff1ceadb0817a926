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

On a loaded machine a step's spread (tens of percent) hides a cost of a few percent, so the same
workers also time the checked ops alone, where the cost is a large share of the time: a loop of
iterations of the step's checked ops (a token embedding and a cross-entropy over the GPT's vocabulary)
each followed by `torch.tpu.synchronize()` with their results alive, so both settings wait for them
(and one flag read per iteration when on: more reads than a step,
which reads its flags once, at `loss.item()`). The difference on - off per checked op, times the
checked ops of a step, over the step's time without checks, bounds the share of a step that value
checks cost, from measurements whose spread is small next to it.
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
    checked_op = _checked_ops(trainer)
    for _ in range(3):
        checked_op()
    before = valuecheck.counts["checked ops"]
    checked_op()
    per_iteration = valuecheck.counts["checked ops"] - before
    print(json.dumps({"ready": True, "checked_ops_per_step": checked, "checked_ops_per_iteration": per_iteration}),
          flush=True)
    for line in sys.stdin:
        kind, n = line.split()
        run = trainer.step if kind == "step" else checked_op
        walls, cpus = [], []
        for _ in range(int(n)):
            start, cpu = time.perf_counter(), time.process_time()
            run()
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        print(json.dumps({"wall": walls, "cpu": cpus}), flush=True)


def _checked_ops(trainer):
    """One iteration of the step's checked ops on their own (the model's embedding, its batch), then a flag read."""
    import torch
    import torch.nn.functional as F

    embedding = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Embedding))
    weight, ids = embedding.weight.detach(), trainer.batch[0]
    logits = torch.randn(ids.numel(), embedding.num_embeddings, device="tpu")

    def iteration():
        outputs = (F.embedding(ids, weight), F.cross_entropy(logits, ids.flatten()))
        # Waits for both (they are alive) in either setting, and reads the pending flags when on
        # (a step reads its flags once, at loss.item()).
        torch.tpu.synchronize()
        return outputs

    return iteration


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

    def steps(self, n: int, kind: str = "step") -> dict:
        self.process.stdin.write(f"{kind} {n}\n")
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
        row.update(_checked_op_cost(workers, args, row))
        return row
    finally:
        for w in workers.values():
            w.close()


def _checked_op_cost(workers, args, row) -> dict:
    """Extra time per checked op (on - off, ABBA turns of `--op-iterations`) and its share of a step."""
    per_iteration = workers["on"].ready["checked_ops_per_iteration"]
    if workers["off"].ready["checked_ops_per_iteration"] != 0 or per_iteration == 0:
        raise RuntimeError(f"checked ops per iteration: on {per_iteration}, "
                           f"off {workers['off'].ready['checked_ops_per_iteration']} (expected > 0 and 0)")
    extra = {"wall": [], "cpu": []}
    for r in range(args.rounds):
        order = ("on", "off", "off", "on") if r % 2 == 0 else ("off", "on", "on", "off")
        turns = {"on": {"wall": [], "cpu": []}, "off": {"wall": [], "cpu": []}}
        for setting in order:
            got = workers[setting].steps(args.op_iterations, "op")
            for key in ("wall", "cpu"):
                turns[setting][key] += got[key]
        for key in ("wall", "cpu"):
            # Medians of many short iterations per turn: the difference of two medians seconds apart.
            diff = statistics.median(turns["on"][key]) - statistics.median(turns["off"][key])
            extra[key].append(diff / per_iteration)
    out = {"checked_ops_per_iteration": per_iteration}
    for key in ("wall", "cpu"):
        out[f"op_extra_{key}"] = statistics.median(extra[key])
        out[f"op_extra_{key}_iqr"] = _quartiles(extra[key])
        out[f"op_share_{key}"] = out[f"op_extra_{key}"] * row["checked_ops_per_step"] / row["off"][key]
    return out


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--modes", default="strict,defer_and_fuse")
    parser.add_argument("--rounds", type=int, default=8, help="ABBA rounds per mode (each: 4 turns)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per turn")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--op-iterations", type=int, default=50, help="checked-op iterations per turn")
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
            (el, eh) = row["op_extra_wall_iqr"]
            print(f"{args.model} {mode}: a checked op costs {row['op_extra_wall'] * 1e6:+.1f} us wall "
                  f"(rounds' IQR {el * 1e6:+.1f} to {eh * 1e6:+.1f}), {row['op_extra_cpu'] * 1e6:+.1f} us CPU with checks "
                  f"on; x {row['checked_ops_per_step']:.0f} per step = {row['op_share_wall'] * 100:.3f}% of a step's wall "
                  f"time, {row['op_share_cpu'] * 100:.3f}% of its CPU time (target < 3%)", flush=True)
    return results


if __name__ == "__main__":
    main()
