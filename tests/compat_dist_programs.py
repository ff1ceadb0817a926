"""torch.tpu.ops' collectives on several processes (tests/test_compat.py launches this with tests/dist_launch.py).

`python tests/compat_dist_programs.py NAME` with torchrun's environment. Every result is
compared with the same collective run by gloo on CPU tensors (a gloo group beside the
"tpu_dist" world). A failed check raises; the launcher sees the exit status.
"""
from __future__ import annotations

import datetime
import sys
import warnings

import torch
import torch.distributed as dist

import torch_tpu  # noqa: F401
import torch_tpu.compile

TPU = torch.device("tpu")
checks: list[str] = []


def check(name: str, got, want, **tol) -> None:
    torch.testing.assert_close(got.cpu(), want, msg=lambda m: f"{name}: {m}", **tol)
    checks.append(name)


def _value(rank: int, shape, salt: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * salt + rank))


def collectives_dim() -> None:
    torch.set_float32_matmul_precision("highest")
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    ops = torch.tpu.ops

    def gloo_gather(x, dim):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=gloo)
        return torch.cat(parts, dim)

    def gloo_scatter(x, dim, op=dist.ReduceOp.SUM):
        whole = x.clone()
        dist.all_reduce(whole, op=op, group=gloo)
        return whole.chunk(world, dim)[rank]

    for mode in ("strict", "defer_and_fuse"):
        with torch_tpu.execution_mode(mode):
            for dim in (0, -1):
                x = _value(rank, (3, 4, 2), salt=dim + 5)
                check(f"all_gather_dim {dim} {mode}", ops.all_gather_dim(x.to(TPU) * 1, dim), gloo_gather(x, dim))
                y = _value(rank, (2 * world, 2 * world, 2 * world), salt=dim + 9)
                check(f"reduce_scatter_dim {dim} {mode}", ops.reduce_scatter_dim(y.to(TPU) + 0, dim),
                      gloo_scatter(y, dim))
            y = _value(rank, (world, 3), salt=3)
            check(f"reduce_scatter_dim max {mode}", ops.reduce_scatter_dim(y.to(TPU), 0, reduce_op="max"),
                  gloo_scatter(y, 0, dist.ReduceOp.MAX))

            # Gradients: each rank's loss is its own; the gradient of the sum of all ranks' losses.
            x = _value(rank, (2, 3), salt=21)
            w = _value(rank, (2, 3 * world), salt=22)
            xt = x.to(TPU).requires_grad_()
            (ops.all_gather_dim(xt, 1) * w.to(TPU)).sum().backward()
            check(f"all_gather_dim grad {mode}", xt.grad, gloo_scatter(w, 1))
            y = _value(rank, (2 * world, 3), salt=23)
            v = _value(rank, (2, 3), salt=24)
            yt = y.to(TPU).requires_grad_()
            (ops.reduce_scatter_dim(yt, 0) * v.to(TPU)).sum().backward()
            check(f"reduce_scatter_dim grad {mode}", yt.grad, gloo_gather(v, 0))

    # torch.compile(backend="tpu"): the collective runs through the process group (the graph eagerly).
    torch_tpu.compile.register()
    x = _value(rank, (2, 5), salt=31)

    def f(t):
        return ops.reduce_scatter_dim(ops.all_gather_dim(t * 2, 1), 1) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.compile(f, backend="tpu")(x.to(TPU))
    check("compiled all_gather_dim + reduce_scatter_dim", got, gloo_scatter(gloo_gather(x * 2, 1), 1) + 1)

    # ragged_all_to_all: rank i sends 2 rows to rank i+1, 1 to the others; 2 unsent rows; the output is
    # 3 rows longer than what arrives (those rows keep the output's values); rows land in rank order.
    matrix = [[2 if j == (i + 1) % world else 1 for j in range(world)] for i in range(world)]

    def operand_of(r):
        return _value(r, (sum(matrix[r]) + 2, 3), salt=41)

    def output_at(r):  # the offset rank r gives rank j: after what lower ranks send to j, plus 1 spare row
        return [1 + sum(matrix[s][j] for s in range(r)) for j in range(world)]

    starts = [sum(matrix[rank][:j]) for j in range(world)]
    recv = [matrix[s][rank] for s in range(world)]
    total = sum(recv) + 3
    base = _value(rank, (total, 3), salt=42)
    expected = base.clone()
    for s in range(world):
        start_s = sum(matrix[s][:rank])
        place = output_at(s)[rank]
        expected[place:place + matrix[s][rank]] = operand_of(s)[start_s:start_s + matrix[s][rank]]
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=TPU)  # noqa: E731
    args = (ints(starts), ints(matrix[rank]), ints(output_at(rank)), ints(recv))
    for mode in ("strict", "defer_and_fuse"):
        with torch_tpu.execution_mode(mode):
            op_t = operand_of(rank).to(TPU).requires_grad_()
            out_t = base.to(TPU).requires_grad_()
            got = ops.ragged_all_to_all(op_t, out_t, *args)
            check(f"ragged_all_to_all {mode}", got, expected, rtol=0, atol=0)
            weights = [_value(r, (total, 3), salt=43) for r in range(world)]
            (got * weights[rank].to(TPU)).sum().backward()
            want = torch.zeros_like(operand_of(rank))
            for j in range(world):
                place = output_at(rank)[j]
                want[starts[j]:starts[j] + matrix[rank][j]] = weights[j][place:place + matrix[rank][j]]
            check(f"ragged_all_to_all operand grad {mode}", op_t.grad, want)
            arrived = (expected != base).any(1, keepdim=True)
            check(f"ragged_all_to_all output grad {mode}", out_t.grad, torch.where(arrived, 0.0, weights[rank]))

    try:
        ops.reduce_scatter_dim(torch.ones(world + 1, device=TPU), 0)
    except ValueError as err:
        assert "divisible" in str(err), err
        checks.append("indivisible dimension is a ValueError")
    dist.barrier()


def main() -> None:
    for part in sys.argv[1].split("+"):
        globals()[part]()
    if dist.is_initialized():
        dist.destroy_process_group()
    print("CHECKS " + ",".join(checks), flush=True)


if __name__ == "__main__":
    main()
