"""A launched process's device is tpu:{LOCAL_RANK} (torch_tpu/runtime/local_device.py, docs/distributed.md).

The multi-process checks run tests/local_device_programs.py on 2 local processes with torchrun's
environment (tests/dist_launch.py: every process killed past a hard timeout).
"""
from __future__ import annotations

import pytest

from dist_launch import launch


def _passed(results, name: str) -> list[str]:
    lines = [line for _, out in results for line in out.splitlines() if line.startswith("CHECKS ")]
    assert lines, f"no rank of {name!r} reported its checks:\n{results[0][1][-6000:]}"
    return sorted({c for line in lines for c in line[len("CHECKS "):].split(",") if c})


def test_local_rank_index_is_the_process_device():
    """set_device(LOCAL_RANK), tensors/compute/backward/collectives/DTensor on tpu:{LOCAL_RANK}; another
    process's index raises naming its owner (set_device, tensors, copies, a new thread's tpu:0)."""
    results = launch("mapping", 2, timeout=240, script="local_device_programs.py")
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-6000:]}"
    passed = _passed(results, "mapping")
    for name in ("device_count is LOCAL_WORLD_SIZE", "accelerator device_count", "starts on tpu:LOCAL_RANK",
                 "JAX not started", "set_device(another process's index)", "memory_stats of another process's index",
                 "tensor on tpu:LOCAL_RANK", "compute on tpu:LOCAL_RANK", "'tpu' is tpu:LOCAL_RANK",
                 "backward on tpu:LOCAL_RANK", "all_reduce on tpu:LOCAL_RANK",
                 "all_reduce PREMUL_SUM", "reduce_scatter_tensor PREMUL_SUM", "a tensor on another process's index",
                 "a copy to another process's index", "DTensor local shard on tpu:LOCAL_RANK", "DTensor full_tensor",
                 "new thread starts on tpu:0", "thread on tpu:0 is told to set_device",
                 "thread after set_device(LOCAL_RANK)"):
        assert name in passed, f"check {name!r} did not run"


@pytest.mark.one_mode  # device claims: no execution mode changes them
def test_two_processes_claiming_one_device(tmp_path):
    """Both processes say LOCAL_RANK=0: exactly one gets the device, the other a clear error naming it."""
    results = launch("claim", 2, timeout=180, script="local_device_programs.py",
                     env={"LOCAL_RANK": "0", "CLAIM_DIR": str(tmp_path)})
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-6000:]}"
    outcomes = [(tmp_path / str(rank)).read_text().split("\n", 1) for rank in range(2)]
    winners = [rank for rank, (_, result) in enumerate(outcomes) if result == "ok"]
    assert len(winners) == 1, outcomes
    winner_pid, (_, error) = outcomes[winners[0]][0], outcomes[1 - winners[0]]
    assert "tpu:0 on host" in error and f"already claimed by pid {winner_pid}" in error, error
    assert "every process of a job needs its own LOCAL_RANK" in error


def test_assignment_from_launcher_variables(monkeypatch):
    """The layout read from torchrun's variables; bad values are clear errors."""
    from torch_tpu.runtime import local_device

    def read(**env):
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return local_device._read()

    assert read() is None
    assert read(RANK="0", WORLD_SIZE="1") is None  # a world of one is not a per-device launch
    assert read(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2") == local_device.Assignment(1, 2, 3)
    assert read(RANK="1", WORLD_SIZE="2") == local_device.Assignment(0, 1, 1)  # no LOCAL_RANK: tpu:0
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 is not in \[0, LOCAL_WORLD_SIZE=2\)"):
        read(RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", LOCAL_WORLD_SIZE="2")
    with pytest.raises(RuntimeError, match="LOCAL_RANK='x' is not an integer"):
        read(RANK="0", WORLD_SIZE="2", LOCAL_RANK="x")
    slots = local_device.OwnedSlots("dev", local_device.Assignment(1, 3, 1))
    assert len(slots) == 3 and list(slots) == ["dev"] * 3 and slots[1] == "dev" and slots.own == "dev"
    with pytest.raises(RuntimeError, match=r"tpu:2 is the device of local rank 2's process: .* owns tpu:1 only"):
        slots[-1]
