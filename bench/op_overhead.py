"""Per-op host cost of eager execution: a 2,000-op chain on a 256-element tensor.

Runs the same chain (a mix of tensor-tensor, tensor-scalar and unary ops) as
torch ops on device "tpu" in Strict mode and in DeferAndFuse (recording, then
the flush at `.cpu()`), as individually jitted JAX calls and as torch CPU
eager ops, interleaved in the same process, and reports per-op times and their
ratios (Strict / JAX: target <= 1.2; DeferAndFuse recording: target <= 2 us
per op, about torch CPU eager's own cost on a quiet machine, so its ratio to
torch CPU eager is reported too). Only ratios measured in one run are
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
    """Per round, seconds per op: DeferAndFuse recording, recording + flush, and torch CPU eager."""
    recording, total, cpu = [], [], []
    with torch_tpu.defer_and_fuse():
        torch_chain(x, y, args.ops).cpu()  # the graph's plan and fused programs (compiled once)
        for _ in range(args.rounds):
            start = time.perf_counter()
            out = torch_chain(x, y, args.ops)
            recorded = time.perf_counter()
            out.cpu()
            recording.append((recorded - start) / args.ops)
            total.append((time.perf_counter() - start) / args.ops)
            start = time.perf_counter()
            torch_chain(xc, yc, args.ops)
            cpu.append((time.perf_counter() - start) / args.ops)
    return recording, total, cpu


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
    recording, deferred, cpu = _defer_rounds(args, x, y, x.cpu(), y.cpu())
    recorded_in_python = torch_tpu.metrics.counts.ops_recorded_python
    ours, theirs, ratios = compiled
    result = {
        "benchmark": "op_overhead",
        "ops": args.ops,
        "size": args.size,
        "strict_us_per_op": statistics.median(ours) * 1e6,
        "jax_jit_us_per_op": statistics.median(theirs) * 1e6,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "loaded_strict_us_per_op": statistics.median(loaded[0]) * 1e6,
        "loaded_ratio_median": statistics.median(loaded[2]),
        "target": 1.2,
        "defer_record_us_per_op": statistics.median(recording) * 1e6,
        "defer_us_per_op": statistics.median(deferred) * 1e6,
        "torch_cpu_us_per_op": statistics.median(cpu) * 1e6,
        "defer_record_to_torch_cpu": statistics.median(r / c for r, c in zip(recording, cpu)),
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
    print(f"  DeferAndFuse: recording {result['defer_record_us_per_op']:.2f} us/op (target <= 2), with the flush "
          f"{result['defer_us_per_op']:.2f} us/op; torch CPU eager {result['torch_cpu_us_per_op']:.2f} us/op "
          f"(recording / CPU eager: {result['defer_record_to_torch_cpu']:.2f}); ops recorded by the Python recorder: "
          f"{recorded_in_python} (the rest natively)")
    print(f"  programs compiled: {torch_tpu.metrics.counts.programs_compiled}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "op_overhead.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
