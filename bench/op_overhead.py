"""Per-op host cost of eager execution: a 2,000-op chain on a 256-element tensor.

Runs the same chain (a mix of tensor-tensor, tensor-scalar and unary ops) as
torch ops on device "tpu" in Strict mode and in DeferAndFuse (recording, then
the flush at `.cpu()`), as individually jitted JAX calls and as torch CPU
eager ops, interleaved in the same process, and reports per-op times and their
ratios (Strict / JAX: target <= 1.2; DeferAndFuse recording: target <= 2 us
per op, about torch CPU eager's own cost on a quiet machine, so its ratio to
torch CPU eager is reported too). DeferAndFuse is reported as recording (the
ops, until the read) and flush (the read: running the fused programs) per op,
with looped units (the default: the chain's 125 equal 16-op units run as one
looped program) and without (one launch per unit), ABBA-interleaved. Only ratios measured in one run are
meaningful on a shared machine; the median of several rounds is reported.

Two kinds of executables serve a cache hit, and both are measured:
  compiled   programs compiled by this process (the first run on a host):
             the main ratio.
  loaded     the same programs loaded from the compile cache's host level
             (every later process): PJRT executables called without JAX's C++
             dispatch path (docs/cache.md, "Cost of the difference").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import torch

import torch_tpu
from torch_tpu import cache
from torch_tpu.eager import executor


def torch_chain(x, y, n):
    for _ in range(n // 4):
        x = x * 1.0001
        x = x + y
        x = torch.tanh(x)
        x = x - 0.5
    return x


def jax_chain(fns, x, y, n):
    mul, add, tanh, sub = fns
    for _ in range(n // 4):
        x = mul(x, 1.0001)
        x = add(x, y)
        x = tanh(x)
        x = sub(x, 0.5)
    return x


def _rounds(args, x, y, fns, jx, jy):
    """(ours, JAX's, ratios) per round: the two chains interleaved, seconds per op."""
    ours, theirs = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        torch_chain(x, y, args.ops).cpu()
        ours.append((time.perf_counter() - start) / args.ops)
        start = time.perf_counter()
        jax_chain(fns, jx, jy, args.ops).block_until_ready()
        theirs.append((time.perf_counter() - start) / args.ops)
    return ours, theirs, [o / t for o, t in zip(ours, theirs)]


def _defer_rounds(args, x, y, xc, yc):
    """Per round, seconds per op: DeferAndFuse recording and flush with looped units (the default) and
    without (TORCH_TPU_DEFER_LOOPS=0: one launch per 16-op unit), ABBA-interleaved, torch CPU eager, and
    torch CPU eager on 1-element tensors: PyTorch's own per-op floor (Python binding, dispatcher, output
    tensor, a kernel with next to no arithmetic), which every backend's op pays before its kernel runs."""
    recording = {True: [], False: []}
    flush = {True: [], False: []}
    cpu, floor = [], []
    x1, y1 = xc[:1].clone(), yc[:1].clone()
    for loops in (True, False):  # each mode's plan and fused programs (compiled once)
        with torch_tpu.defer_and_fuse(loops=loops):
            torch_chain(x, y, args.ops).cpu()
    for r in range(args.rounds):
        for loops in ((True, False) if r % 2 == 0 else (False, True)):
            with torch_tpu.defer_and_fuse(loops=loops):
                start = time.perf_counter()
                out = torch_chain(x, y, args.ops)
                recorded = time.perf_counter()
                out.cpu()
                flush[loops].append((time.perf_counter() - recorded) / args.ops)
                recording[loops].append((recorded - start) / args.ops)
        start = time.perf_counter()
        torch_chain(xc, yc, args.ops)
        cpu.append((time.perf_counter() - start) / args.ops)
        start = time.perf_counter()
        torch_chain(x1, y1, args.ops)
        floor.append((time.perf_counter() - start) / args.ops)
    return recording, flush, cpu, floor


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    x = torch.randn(args.size).to("tpu")
    y = torch.randn(args.size).to("tpu")
    fns = (jax.jit(jnp.multiply), jax.jit(jnp.add), jax.jit(jnp.tanh), jax.jit(jnp.subtract))
    jx = jnp.asarray(x.cpu().numpy())
    jy = jnp.asarray(y.cpu().numpy())
    jax_chain(fns, jx, jy, 8).block_until_ready()

    with tempfile.TemporaryDirectory() as directory, cache.configured(enabled=True, dir=directory, url=None):
        torch_chain(x, y, 8).cpu()  # compiles here (and stores in the private host level)
        compiled = _rounds(args, x, y, fns, jx, jy)
        executor.programs.clear()  # forget them: the next run finds them by program key, loaded
        cache.clear(host=False)
        torch_chain(x, y, 8).cpu()
        loaded = _rounds(args, x, y, fns, jx, jy)
    recording, flush, cpu, floor = _defer_rounds(args, x, y, x.cpu(), y.cpu())
    recorded_in_python = torch_tpu.metrics.counts.ops_recorded_python
    ours, theirs, ratios = compiled
    median = statistics.median
    result = {
        "benchmark": "op_overhead",
        "ops": args.ops,
        "size": args.size,
        "load_average": os.getloadavg()[0],
        "strict_us_per_op": median(ours) * 1e6,
        "jax_jit_us_per_op": median(theirs) * 1e6,
        "ratio_median": median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "loaded_strict_us_per_op": median(loaded[0]) * 1e6,
        "loaded_jax_jit_us_per_op": median(loaded[1]) * 1e6,
        "loaded_ratio_median": median(loaded[2]),
        "target": 1.2,
        "defer_record_us_per_op": median(recording[True]) * 1e6,
        "defer_flush_us_per_op": median(flush[True]) * 1e6,
        "defer_us_per_op": median(r + f for r, f in zip(recording[True], flush[True])) * 1e6,
        "defer_no_loops_record_us_per_op": median(recording[False]) * 1e6,
        "defer_no_loops_flush_us_per_op": median(flush[False]) * 1e6,
        "flush_loops_to_no_loops": median(a / b for a, b in zip(flush[True], flush[False])),
        "torch_cpu_us_per_op": median(cpu) * 1e6,
        "defer_record_to_torch_cpu": median(r / c for r, c in zip(recording[True], cpu)),
        "torch_cpu_1_element_us_per_op": median(floor) * 1e6,
        "defer_record_above_floor_us": median(r - f for r, f in zip(recording[True], floor)) * 1e6,
        "defer_record_target_us": 2.0,
        "ops_recorded_python": recorded_in_python,
    }
    print(f"op_overhead: {args.ops}-op chain on {args.size} elements, {args.rounds} interleaved rounds")
    print(f"  strict eager (torch on 'tpu'): {result['strict_us_per_op']:.1f} us/op (median)")
    print(f"  individually jitted JAX calls: {result['jax_jit_us_per_op']:.1f} us/op (median)")
    print(f"  ratio ours/JAX: median {result['ratio_median']:.2f} (min {result['ratio_min']:.2f}, "
          f"max {result['ratio_max']:.2f}); target <= 1.2")
    print(f"  with executables loaded from the compile cache: {result['loaded_strict_us_per_op']:.1f} us/op, "
          f"ratio median {result['loaded_ratio_median']:.2f}")
    print(f"  DeferAndFuse: recording {result['defer_record_us_per_op']:.2f} us/op (target <= 2), flush "
          f"{result['defer_flush_us_per_op']:.2f} us/op (recording + flush {result['defer_us_per_op']:.2f}); "
          f"torch CPU eager {result['torch_cpu_us_per_op']:.2f} us/op (recording / CPU eager: "
          f"{result['defer_record_to_torch_cpu']:.2f}); ops recorded by the Python recorder: {recorded_in_python} "
          f"(the rest natively)")
    print(f"  PyTorch's own per-op floor (torch CPU eager on 1 element): {result['torch_cpu_1_element_us_per_op']:.2f}"
          f" us/op; DeferAndFuse recording above it: {result['defer_record_above_floor_us']:.2f} us/op")
    print(f"  DeferAndFuse without looped units (loops=False): recording {result['defer_no_loops_record_us_per_op']:.2f}"
          f" us/op, flush {result['defer_no_loops_flush_us_per_op']:.2f} us/op; flush looped / not looped: median "
          f"{result['flush_loops_to_no_loops']:.2f} (ABBA)")
    print(f"  load average (1 min) at the end: {result['load_average']:.1f}")
    print(f"  programs compiled: {torch_tpu.metrics.counts.programs_compiled}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "op_overhead.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
