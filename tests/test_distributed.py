"""The "tpu_dist" process group (docs/distributed.md).

Multi-process tests launch tests/dist_programs.py on 2 or 4 local processes
(tests/dist_launch.py: torchrun's environment, every process killed past a hard
timeout). Each program checks every result against a reference computed on CPU
and prints the checks it passed. In-process tests cover registration and a
world of one.
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from dist_launch import launch

TPU = torch.device("tpu:0")


def _run(name: str, world: int, timeout: float = 300.0, ranks=None, env=None) -> list[str]:
    results = launch(name, world, timeout=timeout, env=env)
    for rank, (code, out) in enumerate(results):
        if ranks is not None and rank not in ranks:
            continue
        assert code == 0, f"rank {rank} of {name!r} exited with {code}:\n{out[-6000:]}"
    lines = [line for _, out in results for line in out.splitlines() if line.startswith("CHECKS ")]
    assert lines, f"no rank of {name!r} reported its checks:\n{results[0][1][-6000:]}"
    return sorted({c for line in lines for c in line[len("CHECKS "):].split(",") if c})  # any rank's


# --------------------------------------------------------------------------- in-process


def test_backend_registered_for_tpu():
    assert "tpu_dist" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu_dist"
    assert dist.get_default_backend_for_device("tpu") == "tpu_dist"
    assert dist.Backend.backend_capability["tpu_dist"] == ["tpu"]


@pytest.fixture
def world_of_one():
    dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_world_of_one(world_of_one):
    from torch_tpu.distributed import ProcessGroupTPU

    assert isinstance(dist.group.WORLD, ProcessGroupTPU)
    assert dist.get_backend() == "tpu_dist"
    x = torch.randn(4, 3)
    t = x.to(TPU)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert work.is_completed()
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)
    out = torch.empty(4, 3, device=TPU)
    dist.all_gather_into_tensor(out, t)
    torch.testing.assert_close(out.cpu(), x, rtol=0, atol=0)
    view = t.t()[1:]  # a strided view is written in place
    dist.all_reduce(view, op=dist.ReduceOp.MAX)
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)
    dist.barrier()


def test_bad_arguments_raise(world_of_one):
    with pytest.raises(ValueError, match="reduce op"):
        dist.all_reduce(torch.ones(2, device=TPU), op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="AVG needs a floating"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64, device=TPU), op=dist.ReduceOp.AVG)
    with pytest.raises(ValueError, match="world size"):
        dist.all_gather_into_tensor(torch.empty(3, device=TPU), torch.ones(2, device=TPU))
    with pytest.raises(ValueError, match="mixes CPU and tpu"):
        dist.all_gather([torch.empty(2)], torch.ones(2, device=TPU))


def test_collective_is_a_materialization_point(world_of_one):
    import torch_tpu

    with torch_tpu.defer_and_fuse():
        t = torch.ones(3, device=TPU) * 2 + 1  # pending until the collective
        dist.all_reduce(t)
        u = t * 2
    torch.testing.assert_close(u.cpu(), torch.full((3,), 6.0))


def test_compiled_functional_collectives_world_of_one(world_of_one):
    """torch.compile(backend="tpu") with funcol ops: one SPMD program, no process-group call, CPU values."""
    import torch.distributed._functional_collectives as funcol

    import torch_tpu.compile
    from torch_tpu.compile import graph
    from torch_tpu.distributed import compiled, process_group

    torch_tpu.compile.register()
    group = dist.group.WORLD

    def f(x):
        y = funcol.wait_tensor(funcol.all_reduce(torch.tanh(x), "avg", group))
        g = funcol.all_gather_tensor(y * 2, 0, group)
        return y.sum() + 1, funcol.wait_tensor(funcol.reduce_scatter_tensor(g, "max", 0, group))

    fn = torch.compile(f, backend="tpu")
    x = torch.randn(4, 3)
    graphs, launched = compiled.stats["graphs"], process_group.stats["collectives"]
    plans = graph.stats.plans
    for _ in range(2):
        total, scattered = fn(x.to(TPU))
    torch.testing.assert_close(total.cpu(), torch.tanh(x).sum() + 1)
    torch.testing.assert_close(scattered.cpu(), torch.tanh(x) * 2)
    assert compiled.stats["graphs"] == graphs + 1 and graph.stats.plans == plans + 1
    assert process_group.stats["collectives"] == launched  # inside the graph's program


# --------------------------------------------------------------------------- multi-process

COLLECTIVES = [
    "broadcast keeps -0.0", "all_gather_into_tensor", "reduce_scatter_tensor sum", "reduce_scatter_tensor max",
    "reduce_scatter list", "reduce_scatter list uneven",
    "reduce_scatter list uneven min", "reduce_scatter wrong output size raises", "all_to_all_single", "all_to_all_single uneven", "all_to_all [1]", "reduce",
    "scatter", "send/recv", "batch_isend_irecv ring", "work.is_completed", "work.get_future", "barrier",
    "new_group all_reduce", "new_group all_gather", "funcol.all_reduce", "funcol.all_gather_tensor",
    "funcol.reduce_scatter_tensor", "cpu tensor via gloo fallback", "all_reduce strided view",
    "ddp 0.weight", "ddp 2.bias", "all_reduce complex64", "new_subgroups all_reduce",
]


def test_collectives_ddp_spmd_two_processes():
    """Every collective on 2 processes against CPU references, DDP == one process (10 steps),
    spmd_safe's handshake (a mismatch raises naming the rank and the operations), functional
    collectives inside torch.compile graphs (one SPMD program) == gloo on CPU tensors, and an
    spmd_safe DDP step under DeferAndFuse (all_reduce fused) runs fewer programs than skinny, same result."""
    passed = _run("collectives+ddp+spmd+compiled+spmd_ddp", 2)
    for name in COLLECTIVES:
        assert name in passed, f"check {name!r} did not run"
    for dtype in ("float32", "bfloat16", "int64", "int32"):
        for op in ("SUM", "MAX", "MIN", "PRODUCT"):
            assert f"all_reduce RedOpType.{op} torch.{dtype}" in passed
    assert "all_reduce RedOpType.AVG torch.bfloat16" in passed
    for name in ("spmd_safe region result", "torch.tpu.spmd_safe", "spmd mismatch op names rank 1",
                 "spmd mismatch names the operations", "spmd mismatch names end of region",
                 "group usable after mismatch"):
        assert name in passed, f"check {name!r} did not run"
    for name in ("compiled all_reduce sum", "compiled all_gather + reduce_scatter avg", "compiled all_reduce max",
                 "compiled broadcast", "compiled graph ran no process-group collective (call 2)",
                 "compiled collectives: one graph program", "compiled data-parallel update",
                 "spmd_safe ddp step recorded its all_reduce", "spmd_safe ddp step runs fewer programs",
                 "spmd_safe ddp param 3 == skinny", "spmd_safe ddp param 3 == one process"):
        assert name in passed, f"check {name!r} did not run"


@pytest.mark.one_mode  # failure detection of the process group: no execution mode changes it
def test_killed_rank_gives_an_error_naming_it():
    """Rank 1 dies; rank 0's next collective raises (within the timeout) naming rank 1. The group was
    made by init_process_group(init_method="tcp://...") with no backend named: tpu_dist is picked."""
    passed = _run("killed", 2, timeout=120, ranks=[0])
    assert "error names rank 1" in passed and "error within the timeout (+ grace)" in passed
    for name in ("tcp:// init_method", "no backend named: the default group is tpu_dist's", "first all_reduce",
                 "first all_reduce ran on tpu_dist"):
        assert name in passed, f"check {name!r} did not run"


@pytest.mark.heavy
def test_straggler_times_out_naming_it():
    """Rank 1 never arrives; rank 0 gets CollectiveTimeoutError after the group's timeout, naming rank 1."""
    passed = _run("straggler", 2, timeout=120, ranks=[0])
    assert "timeout error" in passed and "error names rank 1" in passed


@pytest.mark.heavy
def test_fsdp2_matches_one_process_and_dcp_reshards(tmp_path):
    """FSDP2 on 2 processes == one process; its DCP checkpoint loads bit-exactly in one process."""
    import torch.distributed.checkpoint as dcp

    from dist_programs import _Transformer

    passed = _run("fsdp", 2, env={"TPU_DIST_DIR": str(tmp_path)})
    assert "fsdp fp32 params are DTensors" in passed
    assert "fsdp fp32 head.weight" in passed and "fsdp bf16 head.weight" in passed
    assert "fsdp bf16 blocks.1.fc2.weight" in passed and "dcp save" in passed
    # world size 2 -> 1: this process, no process group, tpu tensors
    model = _Transformer().to(TPU)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    model.load_state_dict(state["model"])
    full = torch.load(tmp_path / "full.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), full[name], rtol=0, atol=0)


@pytest.mark.heavy
def test_device_mesh_dtensor_tensor_parallel_four_processes():
    passed = _run("mesh4", 4, timeout=400)
    for name in ("mesh device type", "dtensor matmul", "redistribute to replicate", "redistribute to shards",
                 "tensor parallel forward", "tensor parallel grad", "mesh tp group all_reduce",
                 "mesh dp group all_reduce"):
        assert name in passed


def test_storage_resize_keeps_values_and_frees():
    """untyped_storage().resize_() (FSDP2 frees/re-allocates unsharded parameters): values move, new bytes are zeros."""
    x = torch.arange(6.0)
    t = x.to(TPU)
    s = t.untyped_storage()
    address = s.data_ptr()
    s.resize_(32)
    assert s.nbytes() == 32 and s.data_ptr() != address
    grown = torch.empty(0, device=TPU).set_(s, 0, (8,), (1,))
    torch.testing.assert_close(grown.cpu(), torch.cat([x, torch.zeros(2)]), rtol=0, atol=0)
    s.resize_(8)
    torch.testing.assert_close(torch.empty(0, device=TPU).set_(s, 0, (2,), (1,)).cpu(), x[:2], rtol=0, atol=0)
    s.resize_(0)
    assert s.nbytes() == 0
    s.resize_(24)
    torch.testing.assert_close(torch.empty(0, device=TPU).set_(s, 0, (6,), (1,)).cpu(), torch.zeros(6), rtol=0, atol=0)
