"""Launch one of tests/dist_programs.py's programs on N local processes, bounded in time."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(name: str, world: int, timeout: float = 240.0, env: dict | None = None,
           script: str = "dist_programs.py") -> list[tuple[int, str]]:
    """Run program `name` of tests/`script` on `world` processes; [(exit status, output)] per rank.
    Kills them all past `timeout`. `env` may hold per-rank values: {name: [value of rank 0, ...]}."""
    port = free_port()
    procs = []
    for rank in range(world):
        child = dict(os.environ)
        mine = {k: v[rank] if isinstance(v, (list, tuple)) else v for k, v in (env or {}).items()}
        child.update(mine)
        child.update(
            RANK=str(rank), LOCAL_RANK=mine.get("LOCAL_RANK", str(rank)), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=ROOT + os.pathsep + child.get("PYTHONPATH", ""),
            TORCH_TPU_CACHE=child.get("TORCH_TPU_CACHE", "0"), OMP_NUM_THREADS="1",
        )
        child.pop("TORCH_TPU_NUM_CPU_DEVICES", None)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), name],
            env=child, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        ))
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out += f"\n[launcher: killed after {timeout:.0f} s]"
            results.append((-9, out))
            continue
        results.append((proc.returncode, out))
    return results


if __name__ == "__main__":
    for rank, (code, out) in enumerate(launch(sys.argv[1], int(sys.argv[2]))):
        print(f"===== rank {rank}: exit {code}\n{out}")
