"""Launched-process device programs, one process per rank (tests/test_device_id.py).

`bound`: `init_process_group("tpu_dist", device_id=...)` and `split_group`. `doctor`: `torch-tpu doctor`'s
device checks in a launched process use its own device (tpu:LOCAL_RANK).

`python tests/device_id_programs.py NAME` with torchrun's environment. Each check compares with values
this rank computes on CPU from every rank's inputs; a failed check raises (nonzero exit).
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

import torch_tpu  # noqa: F401


def bound() -> None:
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("tpu", local)
    dist.init_process_group("tpu_dist", device_id=device, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    world_pg = dist.group.WORLD
    assert world_pg.bound_device_id == device, world_pg.bound_device_id
    assert torch.tpu.current_device() == local

    def values(r):
        return torch.arange(4, dtype=torch.float32) + 10 * r

    t = values(rank).to(device)
    dist.all_reduce(t)
    torch.testing.assert_close(t.cpu(), sum(values(r) for r in range(world)), rtol=0, atol=0)
    dist.barrier()  # c10d passes the bound device to the barrier
    got = [None] * world
    dist.all_gather_object(got, {"rank": rank})
    assert got == [{"rank": r} for r in range(world)], got

    # new_group with a bound default group: c10d's split path (non-members: perform_nocolor_split)
    pair = dist.new_group(list(range(world)))
    t = values(rank).to(device)
    dist.all_reduce(t, group=pair)
    torch.testing.assert_close(t.cpu(), sum(values(r) for r in range(world)), rtol=0, atol=0)
    solo = dist.new_group([0])
    assert (solo == dist.GroupMember.NON_GROUP_MEMBER) == (rank != 0)

    # split_group: one group per rank, then one over every rank
    mine = dist.split_group(split_ranks=[[r] for r in range(world)])
    assert mine.size() == 1 and mine.bound_device_id == device
    t = values(rank).to(device)
    dist.all_reduce(t, group=mine)
    torch.testing.assert_close(t.cpu(), values(rank), rtol=0, atol=0)
    every = dist.split_group(split_ranks=[list(range(world))])
    assert dist.get_process_group_ranks(every) == list(range(world))
    t = values(rank).to(device)
    dist.all_reduce(t, group=every)
    torch.testing.assert_close(t.cpu(), sum(values(r) for r in range(world)), rtol=0, atol=0)
    only0 = dist.split_group(split_ranks=[[0]])
    assert (only0 is None) == (rank != 0), only0

    # DeviceMesh over a bound default group builds each dimension's groups with split_group
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("tpu", (1, world), mesh_dim_names=("dp", "tp"))
    assert mesh["dp"].size() == 1 and mesh["tp"].size() == world
    t = values(rank).to(device)
    dist.all_reduce(t, group=mesh["tp"].get_group())
    torch.testing.assert_close(t.cpu(), sum(values(r) for r in range(world)), rtol=0, atol=0)
    t = values(rank).to(device)
    dist.all_reduce(t, group=mesh["dp"].get_group())
    torch.testing.assert_close(t.cpu(), values(rank), rtol=0, atol=0)

    # binding another process's device is refused, naming this process's own
    other = torch.device("tpu", (local + 1) % world)
    try:
        world_pg.eager_connect_single_device(other)
    except ValueError as e:
        assert f"this process's device is tpu:{local}" in str(e), e
    else:
        raise AssertionError("binding another process's device was accepted")
    dist.destroy_process_group()
    print("CHECKS bound", flush=True)


def doctor() -> None:
    from torch_tpu import cli_doctor

    local = int(os.environ["LOCAL_RANK"])
    results = [cli_doctor.check_platform(), cli_doctor.check_op(), cli_doctor.check_compile()]
    if local == 1:  # its one-process tpu_dist child must be a job of its own (not this job's rank 1 again)
        results.append(cli_doctor.check_dist())
    for result in results:
        assert result.status == cli_doctor.OK, str(result)
    if local:
        assert f"this process's is tpu:{local}" in results[0].detail, results[0].detail
    print("CHECKS doctor", flush=True)


if __name__ == "__main__":
    for part in sys.argv[1].split("+"):  # several programs in one launch share the start-up
        globals()[part]()
