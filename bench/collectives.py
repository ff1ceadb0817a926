"""all_reduce bus bandwidth: tpu_dist (XLA collectives on tpu tensors) vs gloo (CPU tensors), 2 processes.

    python bench/collectives.py [--max-mib 64] [--iters N]

Launches 2 local processes (torchrun's environment). Each joins a "tpu_dist" default
group and a gloo sub-group over the same ranks, then times float32 all_reduce (SUM) from
1 KiB to 64 MiB: tpu_dist on tpu tensors (the collective program, its launch and the wait),
gloo on CPU tensors. Bus bandwidth = bytes * 2 (n - 1) / n / time (NCCL's convention).
Both run in the same processes, interleaved per size, so the ratio is measured under the
same machine load. On XLA:CPU tpu_dist's data path is XLA's own gloo collectives.
Then a DDP step under DeferAndFuse, skinny (the gradient all_reduce its own program) against
spmd_safe (the all_reduce fused into the step's program): time and programs per step.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _worker(max_mib: int, iters: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import torch_tpu  # noqa: F401

    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    sizes = []
    n = 1024
    while n <= max_mib * 2**20:
        sizes.append(n)
        n *= 4
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        t = torch.ones(numel, device="tpu")
        c = torch.ones(numel)
        reps = max(3, min(iters, int(iters * 2**20 / nbytes) or 3))
        times = {}
        for label, tensor, group in (("tpu_dist", t, None), ("gloo", c, gloo)):
            dist.all_reduce(tensor, group=group)  # compile / connect
            best = float("inf")
            for _ in range(3):
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(tensor, group=group)
                if tensor.device.type == "tpu":
                    torch.tpu.synchronize()
                best = min(best, (time.perf_counter() - start) / reps)
            times[label] = best
        factor = 2 * (world - 1) / world
        rows.append((nbytes, times["tpu_dist"], times["gloo"], nbytes * factor / times["tpu_dist"] / 1e9,
                     nbytes * factor / times["gloo"] / 1e9))
    if rank == 0:
        print(f"all_reduce float32 SUM, {world} processes (bus bandwidth GB/s; time per call)")
        print(f"{'size':>9} | {'tpu_dist':>19} | {'gloo (CPU)':>19} | tpu_dist/gloo")
        for nbytes, tt, tg, bt, bg in rows:
            size = f"{nbytes // 1024} KiB" if nbytes < 2**20 else f"{nbytes // 2**20} MiB"
            print(f"{size:>9} | {bt:7.3f} ({tt * 1e6:8.0f} us) | {bg:7.3f} ({tg * 1e6:8.0f} us) | {tg / tt:5.2f}x")
    _ddp_steps(rank, world)
    dist.destroy_process_group()


def _ddp_steps(rank: int, world: int, steps: int = 15) -> None:
    """DDP step time on tpu under DeferAndFuse: skinny (the all_reduce its own program) vs spmd_safe (fused)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_tpu
    from torch_tpu import metrics
    from torch_tpu.distributed import process_group as pg
    from torch_tpu.distributed import spmd_safe

    rows = []
    for label in ("skinny", "spmd_safe"):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                  torch.nn.Linear(256, 16)]
        model = DDP(torch.nn.Sequential(*layers).to("tpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(32, 256, device="tpu"), torch.randn(32, 16, device="tpu")

        def step():
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        body = spmd_safe(step, name="bench ddp step") if label == "spmd_safe" else step
        with torch_tpu.defer_and_fuse():
            for _ in range(8):  # compile (DeferAndFuse settles its segments over the first steps), handshake
                body()
                torch.tpu.synchronize()
            dist.barrier()
            programs = metrics.counts.fused_executions + pg.stats["collectives"]
            times = []
            for _ in range(steps):  # one step per graph, as with a per-step loss.item()
                start = time.perf_counter()
                body()
                torch.tpu.synchronize()
                times.append(time.perf_counter() - start)
            # The median step: a late recompile (DeferAndFuse re-cutting a graph) is not a step's cost.
            took = sorted(times)[len(times) // 2]
            programs = (metrics.counts.fused_executions + pg.stats["collectives"] - programs) / steps
        rows.append((label, took, programs))
    if rank == 0:
        print(f"\nDDP step (MLP 256-256-256-16, batch 32 per rank, DeferAndFuse), {world} processes")
        for label, took, programs in rows:
            print(f"{label:>10}: {took * 1e3:8.2f} ms/step (median of {steps}), {programs:.1f} programs/step")
        print(f"spmd_safe/skinny step time: {rows[1][1] / rows[0][1]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        _worker(args.max_mib, args.iters)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--max-mib", str(args.max_mib),
             "--iters", str(args.iters)], env=env,
        ))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit("bench/collectives.py: timed out after 900 s")
    if any(codes):
        raise SystemExit(f"bench/collectives.py: workers exited with {codes}")


if __name__ == "__main__":
    main()
