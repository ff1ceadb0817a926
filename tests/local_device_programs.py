"""Programs of tests/test_local_device.py, one process per rank (launched by tests/dist_launch.py).

`python tests/local_device_programs.py NAME` with torchrun's environment. Every value is
checked against PyTorch on CPU; a failed check raises, the launcher sees the exit status and
the printed "CHECKS ..." line.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import torch_tpu  # noqa: F401

checks: list[str] = []


def check(name: str, got, want) -> None:
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got.cpu(), want, msg=lambda m: f"{name}: {m}")
    elif got != want:
        raise AssertionError(f"{name}: got {got!r}, want {want!r}")
    checks.append(name)


def raises(name: str, fn, *fragments: str) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error is the check
        text = str(err)
        missing = [f for f in fragments if f not in text]
        if missing:
            raise AssertionError(f"{name}: error lacks {missing}: {type(err).__name__}: {text}") from err
        checks.append(name)
        return
    raise AssertionError(f"{name}: no error")


def mapping() -> None:
    """tpu:{LOCAL_RANK} is this process's device, as CUDA code and TorchTitan expect."""
    rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    other = (local + 1) % world
    mine = torch.device(f"tpu:{local}")
    torch.set_float32_matmul_precision("highest")  # compared with CPU float32
    # Before JAX starts (PyTorch and DeviceMesh ask these first).
    check("device_count is LOCAL_WORLD_SIZE", torch.tpu.device_count(), world)
    check("accelerator device_count", torch.accelerator.device_count(), world)
    check("starts on tpu:LOCAL_RANK", torch.tpu.current_device(), local)
    check("JAX not started", torch.tpu.is_initialized(), False)
    torch.tpu.set_device(local)  # TorchTitan's device_module.set_device(torch.device(f"tpu:{LOCAL_RANK}"))
    torch.tpu.set_device(mine)
    raises("set_device(another process's index)", lambda: torch.tpu.set_device(other),
           f"tpu:{other} is the device of local rank {other}'s process", f"owns tpu:{local} only")
    raises("memory_stats of another process's index", lambda: torch.tpu.memory_allocated(other),
           f"owns tpu:{local} only")
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=60))

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    t = x.to(mine)
    check("tensor on tpu:LOCAL_RANK", t.device, mine)
    check("compute on tpu:LOCAL_RANK", (t * 2 + 1).sum(0), (x * 2 + 1).sum(0))
    check("'tpu' is tpu:LOCAL_RANK", torch.ones(2, device="tpu").device, mine)
    w = torch.nn.Linear(3, 2)
    wt = torch.nn.Linear(3, 2).to(mine)
    wt.load_state_dict(w.state_dict())
    w(x).square().sum().backward()
    wt(t).square().sum().backward()  # autograd's device thread for tpu:LOCAL_RANK
    check("backward on tpu:LOCAL_RANK", wt.weight.grad, w.weight.grad)
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    dist.all_reduce(t)
    check("all_reduce on tpu:LOCAL_RANK", t, sum(xs[1:], xs[0]))
    y = torch.ones(4, device=mine) * (rank + 1)
    dist.all_reduce(y, op=dist.ReduceOp.PREMUL_SUM(0.5))  # FSDP2's gradient divide (TorchTitan sets one)
    check("all_reduce PREMUL_SUM", y, torch.full((4,), 0.5 * sum(range(1, world + 1))))
    out = torch.empty(2, device=mine)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * world, device=mine), op=dist.ReduceOp.PREMUL_SUM(1.0))
    check("reduce_scatter_tensor PREMUL_SUM", out, torch.arange(2.0 * world)[2 * rank: 2 * rank + 2] * world)
    raises("a tensor on another process's index", lambda: torch.ones(2, device=f"tpu:{other}").cpu(),
           f"tpu:{other} is the device of local rank {other}'s process")
    raises("a copy to another process's index", lambda: x.to(f"tpu:{other}").cpu(), f"owns tpu:{local} only")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("tpu", (world,))
    full = torch.arange(8.0 * world).reshape(2 * world, 4)
    dt = distribute_tensor(full.to(mine), mesh, [Shard(0)])
    check("DTensor local shard on tpu:LOCAL_RANK", dt.to_local().device, mine)
    check("DTensor full_tensor", (dt * 3).full_tensor(), full * 3)

    box = {}

    def in_thread():  # a new thread starts on tpu:0, as with CUDA
        box["start"] = torch.tpu.current_device()
        if local != 0:
            try:
                torch.ones(2, device="tpu").cpu()
            except Exception as err:  # noqa: BLE001
                box["error"] = str(err)
        torch.tpu.set_device(local)
        box["after"] = (torch.ones(2, device="tpu") * 2).cpu()

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(60)
    check("new thread starts on tpu:0", box.get("start"), 0)
    if local != 0:
        check("thread on tpu:0 is told to set_device", f"torch.tpu.set_device({local})" in box.get("error", ""), True)
    check("thread after set_device(LOCAL_RANK)", box["after"], torch.full((2,), 2.0))
    dist.barrier()


def claim() -> None:
    """Two processes of one job with the same LOCAL_RANK: the second to start its device fails, naming the first."""
    rank, tmp = int(os.environ["RANK"]), os.environ["CLAIM_DIR"]
    try:
        torch.tpu.init()
        result = "ok"
    except RuntimeError as err:
        result = str(err)
    with open(os.path.join(tmp, f"{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()}\n{result}")
    os.rename(os.path.join(tmp, f"{rank}.tmp"), os.path.join(tmp, str(rank)))
    deadline = time.monotonic() + 120  # the first keeps its claim until the other has tried
    while not all(os.path.exists(os.path.join(tmp, str(r))) for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    checks.append(f"rank {rank} tried")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    if dist.is_initialized():
        dist.destroy_process_group()
    print("CHECKS " + ",".join(checks), flush=True)
