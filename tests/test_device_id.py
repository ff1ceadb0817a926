"""`dist.init_process_group("tpu_dist", device_id=tpu:LOCAL_RANK)` (eager init) and `dist.split_group` on 2 processes."""
from __future__ import annotations

from dist_launch import launch


def test_device_id_bound_group_and_split_group():
    results = launch("bound", 2, timeout=120, script="device_id_programs.py")
    for rank, (code, out) in enumerate(results):
        assert code == 0 and "CHECKS bound" in out, f"rank {rank} exited {code}:\n{out[-6000:]}"
