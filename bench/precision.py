"""Measured error (and speed) of each float32 matmul precision on tpu: the numbers in docs/precision.md.

    .venv/bin/python bench/precision.py            # all sections
    .venv/bin/python bench/precision.py --quick    # smaller sizes

Errors are against float64 on CPU: ||x - exact||_2 / ||exact||_2 (relative
Frobenius error) over standard-normal inputs. Times are wall time per call on
this machine's platform (printed), after warm-up; they show relative costs.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch_tpu  # noqa: E402
from torch_tpu import numerics, precision  # noqa: E402

LEVELS = ("medium", "high", "highest")
TPU = torch.device("tpu")


def rel(x: torch.Tensor, exact: torch.Tensor) -> float:
    return float((x.double() - exact).norm() / exact.norm())


def matmul_errors(ks, m: int) -> None:
    print(f"\n## float32 matmul ({m} x K) @ (K x {m}), relative error against float64\n")
    print("| K | " + " | ".join(f"tpu {level}" for level in LEVELS) + " | CPU float32 | CPU bf16 autocast |")
    print("|---|" + "---|" * (len(LEVELS) + 2))
    g = torch.Generator().manual_seed(0)
    for k in ks:
        a, b = torch.randn(m, k, generator=g), torch.randn(k, m, generator=g)
        exact = a.double() @ b.double()
        cells = []
        for level in LEVELS:
            with precision.use(level):
                cells.append(rel((a.to(TPU) @ b.to(TPU)).cpu(), exact))
        cells.append(rel(a @ b, exact))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cells.append(rel(a @ b, exact))
        print(f"| {k} | " + " | ".join(f"{c:.2e}" for c in cells) + " |")


def matmul_speed(n: int, repeats: int) -> None:
    props = torch.tpu.get_device_properties(0)
    print(f"\n## float32 matmul {n}^3 on tpu ({props.platform}: {props.name}), ms per call (median of {repeats})\n")
    print("| level | ms | GFLOP/s |")
    print("|---|---|---|")
    a, b = torch.randn(n, n, device=TPU), torch.randn(n, n, device=TPU)
    for level in LEVELS:
        with precision.use(level):
            (a @ b).cpu()  # compile
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                torch.tpu.synchronize()
                c = a @ b
                torch.tpu.synchronize()
                times.append(time.perf_counter() - start)
            del c
        ms = statistics.median(times) * 1e3
        print(f"| {level} | {ms:.1f} | {2 * n ** 3 / (ms * 1e-3) / 1e9:.0f} |")


def gpt_errors(layers: int, embd: int, seq: int, batch: int) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_embd=embd, n_head=4, block_size=seq))
    idx = torch.randint(0, 96, (batch, seq))
    runs = [numerics.compare(model, idx, precision=level) for level in LEVELS]
    runs.append(numerics.compare(model, idx, precision="medium", autocast=torch.bfloat16))
    print(f"\n## demo GPT ({layers} layers, d_model {embd}, seq {seq}, batch {batch}): logits, relative error "
          "against CPU float64\n")
    print("| run | logits rel err | worst layer (rel err) |")
    print("|---|---|---|")
    for run in runs:
        worst = max((r for r in run.layers if r.name), key=lambda r: r.rel_error)
        print(f"| {run.label()} | {run.output.rel_error:.2e} | {worst.name} ({worst.rel_error:.2e}) |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore", torch_tpu.TpuPerformanceWarning)
    print(f"torch {torch.__version__}, torch_tpu {torch_tpu.__version__}")
    if args.quick:
        matmul_errors((256, 1024), 128)
        matmul_speed(512, 5)
        gpt_errors(2, 64, 32, 2)
    else:
        matmul_errors((64, 256, 1024, 4096, 16384), 256)
        matmul_speed(2048, 10)
        gpt_errors(4, 256, 128, 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
