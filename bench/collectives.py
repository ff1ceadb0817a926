"""all_reduce bus bandwidth: tpu_dist (XLA collectives on tpu tensors) vs gloo (CPU tensors), 2 processes.

    python bench/collectives.py [--max-mib 64] [--rounds 8] [--iters 20] [--ddp-steps 30] [--only all_reduce|ddp]

Launches 2 local processes (torchrun's environment). Each joins a "tpu_dist" default
group and a gloo sub-group over the same ranks, then times float32 all_reduce (SUM) from
1 KiB to 64 MiB: tpu_dist on tpu tensors (the collective program, its launch and the wait),
gloo on CPU tensors. Bus bandwidth = bytes * 2 (n - 1) / n / time (NCCL's convention).
Both run in the same processes, ABBA-interleaved: per size, `--rounds` rounds alternate
which backend goes first (tpu_dist, gloo / gloo, tpu_dist, ...), each round times a batch of
calls of each backend; the table gives the median round per backend, so the ratio is measured
under the same machine load. The load average is printed before and after.
On XLA:CPU tpu_dist's data path is XLA's own gloo collectives.
Then a DDP step under DeferAndFuse, skinny (the gradient all_reduce its own program) against
spmd_safe (the all_reduce fused into the step's program), also ABBA-interleaved step by step:
median step time and programs per step.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def _abba(cases: dict, rounds: int, before=None) -> dict:
    """{label: median seconds} of `rounds` ABBA-ordered rounds of each case (a case returns its seconds)."""
    labels = list(cases)
    times = {label: [] for label in labels}
    for i in range(rounds):
        for label in labels if i % 2 == 0 else labels[::-1]:
            if before is not None:
                before()
            times[label].append(cases[label]())
    return {label: statistics.median(v) for label, v in times.items()}


def _worker(max_mib: int, iters: int, rounds: int, ddp_steps: int, only: str | None) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import torch_tpu  # noqa: F401

    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    sizes = []
    n = 1024
    while only != "ddp" and n <= max_mib * 2**20:
        sizes.append(n)
        n *= 4
    load_before = _load()
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        t = torch.ones(numel, device="tpu")
        c = torch.ones(numel)
        reps = max(2, min(iters, int(iters * 2**20 / nbytes) or 2))

        def timed(tensor, group):
            def run():
                start = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(tensor, group=group)
                if tensor.device.type == "tpu":
                    torch.tpu.synchronize()
                return (time.perf_counter() - start) / reps
            return run

        dist.all_reduce(t)  # compile
        dist.all_reduce(c, group=gloo)  # connect
        medians = _abba({"tpu_dist": timed(t, None), "gloo": timed(c, gloo)}, rounds,
                        before=lambda: dist.barrier(group=gloo))
        factor = 2 * (world - 1) / world
        tt, tg = medians["tpu_dist"], medians["gloo"]
        rows.append((nbytes, tt, tg, nbytes * factor / tt / 1e9, nbytes * factor / tg / 1e9))
    load_after = _load()
    if rank == 0 and rows:
        print(f"all_reduce float32 SUM, {world} processes (bus bandwidth GB/s; time per call); "
              f"median of {rounds} ABBA rounds per size")
        print(f"before: {load_before}; after: {load_after}")
        print(f"{'size':>9} | {'tpu_dist':>19} | {'gloo (CPU)':>19} | tpu_dist/gloo")
        for nbytes, tt, tg, bt, bg in rows:
            size = f"{nbytes // 1024} KiB" if nbytes < 2**20 else f"{nbytes // 2**20} MiB"
            print(f"{size:>9} | {bt:7.3f} ({tt * 1e6:8.0f} us) | {bg:7.3f} ({tg * 1e6:8.0f} us) | {tg / tt:5.2f}x",
                  flush=True)
    if only != "all_reduce":
        _ddp_steps(rank, world, ddp_steps)
    dist.destroy_process_group()


def _ddp_steps(rank: int, world: int, steps: int = 30) -> None:
    """DDP step time on tpu under DeferAndFuse, skinny vs spmd_safe, ABBA-interleaved step by step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_tpu
    from torch_tpu import metrics
    from torch_tpu.distributed import process_group as pg
    from torch_tpu.distributed import spmd_safe

    def build(label):
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

        return spmd_safe(step, name="bench ddp step") if label == "spmd_safe" else step

    bodies = {label: build(label) for label in ("skinny", "spmd_safe")}
    programs = {label: [] for label in bodies}

    def timed(label):
        def run():
            before = metrics.counts.fused_executions + pg.stats["collectives"]
            start = time.perf_counter()
            bodies[label]()
            torch.tpu.synchronize()  # one step per graph, as with a per-step loss.item()
            took = time.perf_counter() - start
            programs[label].append(metrics.counts.fused_executions + pg.stats["collectives"] - before)
            return took
        return run

    with torch_tpu.defer_and_fuse():
        for _ in range(8):  # compile (DeferAndFuse settles its segments over the first steps), handshake
            for body in bodies.values():
                body()
                torch.tpu.synchronize()
        dist.barrier()
        for v in programs.values():
            v.clear()
        load_before = _load()
        # The median step: a late recompile (DeferAndFuse re-cutting a graph) is not a step's cost.
        medians = _abba({label: timed(label) for label in bodies}, steps)
    if rank == 0:
        print(f"\nDDP step (MLP 256-256-256-16, batch 32 per rank, DeferAndFuse), {world} processes, "
              f"ABBA-interleaved; before: {load_before}; after: {_load()}")
        for label, took in medians.items():
            per_step = sum(programs[label]) / len(programs[label])
            print(f"{label:>10}: {took * 1e3:8.2f} ms/step (median of {steps}), {per_step:.1f} programs/step")
        print(f"spmd_safe/skinny step time: {medians['spmd_safe'] / medians['skinny']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ddp-steps", type=int, default=30)
    parser.add_argument("--only", choices=("all_reduce", "ddp"))
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        _worker(args.max_mib, args.iters, args.rounds, args.ddp_steps, args.only)
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
             "--iters", str(args.iters), "--rounds", str(args.rounds),
             "--ddp-steps", str(args.ddp_steps)] + (["--only", args.only] if args.only else []), env=env,
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
