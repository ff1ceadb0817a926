"""Time to the first training step of the demo GPT: empty compile cache (cold) vs warm host cache.

Each run is a fresh process training examples/gpt.py's GPT (4 layers, d_model 256,
seq 128, batch 8, AdamW) for one step, then a few more. Cold runs start with an
empty level-2 directory; each warm run reuses the directory its cold run just
filled. Both are measured in this one invocation and reported as ratios.

Two clocks, both read inside the child: "first step" runs from just after
`import torch, torch_tpu`, the runtime start and the import of torch._dynamo
(which torch.optim performs on its first step in both runs) to the loss of step 1
on the host; "from process start" includes those imports too. Steady-state steps
are also given in process CPU time, which a busy shared machine disturbs less than
wall time.

    python bench/cold_warm.py [--pairs 2] [--steps 5]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import time
T0 = time.perf_counter()
import json, sys
import torch, torch_tpu
import torch._dynamo  # torch.optim imports it on the first step: same cost cold or warm, kept off the step clock
torch.tpu.device_count()
T1 = time.perf_counter()
sys.path.insert(0, ROOT)
from examples.gpt import GPT, GPTConfig
from torch_tpu import cache, metrics

torch.manual_seed(0)
config = GPTConfig()
model = GPT(config).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
data = torch.randint(0, config.vocab_size, (STEPS + 1, 8, config.block_size + 1))
inputs, targets = data[..., :-1].contiguous(), data[..., 1:].contiguous()

def step(i):
    _, loss = model(inputs[i].to("tpu"), targets[i].to("tpu"))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()

first_loss = step(0)
T2 = time.perf_counter()
C2 = time.process_time()
losses = [step(i + 1) for i in range(STEPS)]
T3 = time.perf_counter()
C3 = time.process_time()
print("RESULT " + json.dumps({
    "from_start": T2 - T0, "first_step": T2 - T1, "imports": T1 - T0,
    "steady": (T3 - T2) / STEPS, "steady_cpu": (C3 - C2) / STEPS,
    "loss": first_loss, "losses": losses, "compiled": metrics.counts.programs_compiled,
    "precision": torch.get_float32_matmul_precision(), "stats": cache.stats(),
}))
"""


def run_child(cache_dir: str, steps: int) -> dict:
    env = dict(os.environ, TORCH_TPU_CACHE="1", TORCH_TPU_CACHE_DIR=cache_dir)
    env.pop("TORCH_TPU_CACHE_URL", None)
    code = CHILD.replace("ROOT", repr(ROOT)).replace("STEPS", str(steps))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-4000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["wall"] = wall
    return result


def hit_rate(level: dict) -> str:
    total = level["hits"] + level["misses"]
    return f"{level['hits']}/{total} ({100 * level['hits'] / total:.0f}%)" if total else "0/0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="cold/warm pairs (each cold run gets a new directory)")
    parser.add_argument("--steps", type=int, default=5, help="steps after the first (steady-state time per step)")
    args = parser.parse_args()

    cold, warm = [], []
    with tempfile.TemporaryDirectory(prefix="torch_tpu-cold-warm-") as root:
        for i in range(args.pairs):
            directory = os.path.join(root, f"l2-{i}")
            cold.append(run_child(directory, args.steps))
            warm.append(run_child(directory, args.steps))

    for c, w in zip(cold, warm):
        if c["loss"] != w["loss"] or c["losses"] != w["losses"]:
            raise SystemExit(f"warm losses differ from cold: {c['losses']} vs {w['losses']}")

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    print(f"demo GPT (4 layers, d_model 256, seq 128, batch 8, AdamW), float32 matmul precision "
          f"{cold[0]['precision']!r}; {args.pairs} cold/warm pairs, medians")
    print(f"{'':38} {'cold':>9} {'warm':>9} {'warm/cold':>10}")
    rows = [
        ("first step (after imports), s", "first_step"),
        ("time to first step from start, s", "from_start"),
        ("process wall time, s", "wall"),
        ("steady-state step, s", "steady"),
        ("steady-state step, CPU s (all threads)", "steady_cpu"),
    ]
    for label, key in rows:
        c, w = med(cold, key), med(warm, key)
        print(f"{label:38} {c:9.3f} {w:9.3f} {w / c:9.1%}")
    last = warm[-1]["stats"]
    print(f"programs compiled: cold {cold[-1]['compiled']}, warm {warm[-1]['compiled']}")
    print(f"warm hit rates: level 2 {hit_rate(last['l2'])}, program index "
          f"{last['index_hits']}/{last['index_hits'] + last['index_misses']}, "
          f"load {last['l2']['load_seconds']:.2f} s, compile time saved {last['l2']['saved_seconds']:.2f} s")
    ratio = med(warm, "first_step") / med(cold, "first_step")
    print(f"target warm <= 25% of cold (first step): {'met' if ratio <= 0.25 else 'NOT met'} ({ratio:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
