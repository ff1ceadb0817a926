"""Launched processes use their own device: `dist.init_process_group("tpu_dist", device_id=tpu:LOCAL_RANK)`
(eager init), `dist.split_group`, and `torch-tpu doctor`'s device checks, on 2 processes (tests/device_id_programs.py)."""
from __future__ import annotations

import pytest

from dist_launch import launch


@pytest.mark.one_mode  # process and device binding: no execution mode changes it
def test_device_id_split_group_and_doctor_on_each_rank():
    results = launch("bound+doctor", 2, timeout=150, script="device_id_programs.py")
    for rank, (code, out) in enumerate(results):
        assert code == 0 and "CHECKS bound" in out and "CHECKS doctor" in out, f"rank {rank} exited {code}:\n{out[-6000:]}"
