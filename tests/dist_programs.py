"""Programs the multi-process tests run, one process per rank (tests/test_distributed.py).

`python tests/dist_programs.py NAME` with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Every check compares against a reference this rank
computes on CPU from every rank's (deterministic) inputs. A failed check raises;
the launcher sees the exit status and the printed "CHECK ..." lines.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import torch_tpu  # noqa: F401

TPU = torch.device("tpu")
checks: list[str] = []


def check(name: str, got, want, exact: bool = True, **tol) -> None:
    got = got.cpu() if isinstance(got, torch.Tensor) else got
    if isinstance(want, torch.Tensor):
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
        else:
            torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}", **tol)
    elif got != want:
        raise AssertionError(f"{name}: got {got!r}, want {want!r}")
    checks.append(name)
    if os.environ.get("TPU_DIST_TRACE"):
        print("ok", name, flush=True)


def init(timeout: float = 60.0) -> tuple[int, int]:
    torch.set_float32_matmul_precision("highest")  # compared with CPU float32
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def value(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s deterministic input (CPU)."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------


def collectives() -> None:
    rank, world = init()
    ranks = range(world)
    check("backend", dist.get_backend(), "tpu_dist")
    check("device_count", torch.tpu.device_count(), int(os.environ["LOCAL_WORLD_SIZE"]))  # tpu:{LOCAL_RANK} is ours
    check("current_device", torch.tpu.current_device(), int(os.environ["LOCAL_RANK"]))

    # all_reduce: every op on float32, bf16, int64, int32
    reducers = {
        dist.ReduceOp.SUM: lambda xs: sum(xs[1:], xs[0]),
        dist.ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0),
        dist.ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0),
        dist.ReduceOp.PRODUCT: lambda xs: torch.stack(xs).prod(0).to(xs[0].dtype),
        dist.ReduceOp.AVG: lambda xs: sum(xs[1:], xs[0]) / len(xs),
    }
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int32):
        for op, ref in reducers.items():
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            xs = [value(r, (5, 3), dtype, salt=1) for r in ranks]
            t = xs[rank].to(TPU)
            dist.all_reduce(t, op=op)
            if dtype == torch.bfloat16:  # reduced in float32, rounded once
                want = ref([x.float() for x in xs]).to(dtype)
            else:
                want = ref(xs)
            check(f"all_reduce {op} {dtype}", t, want, exact=dtype != torch.float32)

    # complex sums (reduced as their real pairs)
    xs = [torch.complex(value(r, (3,), salt=12), value(r, (3,), salt=13)) for r in ranks]
    t = xs[rank].to(TPU)
    dist.all_reduce(t)
    check("all_reduce complex64", t, sum(xs), exact=False)

    # a non-contiguous view is reduced in place, the rest of its storage untouched
    base = [value(r, (4, 6), salt=2) for r in ranks]
    t = base[rank].to(TPU)
    view = t[:, 1::2]
    dist.all_reduce(view)
    want = base[rank].clone()
    want[:, 1::2] = sum(b[:, 1::2] for b in base)
    check("all_reduce strided view", t, want, exact=False)

    # broadcast from every source, bit-exact (bf16 and -0.0 too)
    for src in ranks:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            xs = [value(r, (7,), dtype if dtype != torch.bool else torch.int64, salt=3) for r in ranks]
            xs = [x > 0 if dtype == torch.bool else x for x in xs]
            t = xs[rank].to(TPU)
            dist.broadcast(t, src)
            check(f"broadcast src={src} {dtype}", t, xs[src])
    z = torch.tensor([-0.0, 1.0], device=TPU) if rank == 0 else torch.tensor([5.0, 6.0], device=TPU)
    dist.broadcast(z, 0)
    check("broadcast keeps -0.0", torch.signbit(z.cpu()), torch.tensor([True, False]))

    # all_gather (list) and all_gather_into_tensor
    xs = [value(r, (2, 3), salt=4) for r in ranks]
    outs = [torch.empty(2, 3, device=TPU) for _ in ranks]
    dist.all_gather(outs, xs[rank].to(TPU))
    for r in ranks:
        check(f"all_gather [{r}]", outs[r], xs[r])
    out = torch.empty(world * 2, 3, device=TPU)
    dist.all_gather_into_tensor(out, xs[rank].to(TPU))
    check("all_gather_into_tensor", out, torch.cat(xs))

    # reduce_scatter (list) and reduce_scatter_tensor, sum and avg and max
    xs = [value(r, (world * 4,), salt=5) for r in ranks]
    out = torch.empty(4, device=TPU)
    dist.reduce_scatter_tensor(out, xs[rank].to(TPU))
    check("reduce_scatter_tensor sum", out, sum(xs)[rank * 4:(rank + 1) * 4], exact=False)
    dist.reduce_scatter_tensor(out, xs[rank].to(TPU), op=dist.ReduceOp.MAX)
    check("reduce_scatter_tensor max", out, torch.stack(xs).amax(0)[rank * 4:(rank + 1) * 4])
    dist.reduce_scatter_tensor(out, xs[rank].to(TPU), op=dist.ReduceOp.AVG)
    check("reduce_scatter_tensor avg", out, (sum(xs) / world)[rank * 4:(rank + 1) * 4], exact=False)
    ins = [x.to(TPU) for x in xs[rank].chunk(world)]
    out = torch.empty(4, device=TPU)
    dist.reduce_scatter(out, ins)
    check("reduce_scatter list", out, sum(xs)[rank * 4:(rank + 1) * 4], exact=False)
    # uneven chunks: rank r's output has r + 2 elements (min: padding must not leak into the result)
    sizes = [r + 2 for r in ranks]
    xs = [[value(r, (n,), salt=20 + j) for j, n in enumerate(sizes)] for r in ranks]
    out = torch.empty(sizes[rank], device=TPU)
    dist.reduce_scatter(out, [x.to(TPU) for x in xs[rank]])
    check("reduce_scatter list uneven", out, sum(xs[r][rank] for r in ranks), exact=False)
    dist.reduce_scatter(out, [x.to(TPU) for x in xs[rank]], op=dist.ReduceOp.MIN)
    check("reduce_scatter list uneven min", out, torch.stack([xs[r][rank] for r in ranks]).amin(0))
    try:
        dist.reduce_scatter(torch.empty(sizes[rank] + 1, device=TPU), [x.to(TPU) for x in xs[rank]])
    except ValueError as err:
        check("reduce_scatter wrong output size raises", "this rank's chunk" in str(err), True)
    else:
        raise AssertionError("reduce_scatter with a wrong output size returned")

    # all_to_all_single: even, then uneven splits; all_to_all (lists)
    xs = [value(r, (world * 2, 3), salt=6) for r in ranks]
    out = torch.empty(world * 2, 3, device=TPU)
    dist.all_to_all_single(out, xs[rank].to(TPU))
    check("all_to_all_single", out, torch.cat([xs[r][rank * 2:(rank + 1) * 2] for r in ranks]))
    # rank r sends (r + j + 1) rows to rank j
    splits = {r: [r + j + 1 for j in ranks] for r in ranks}
    xs = [value(r, (sum(splits[r]), 2), salt=7) for r in ranks]
    got = [list(torch.split(xs[r], splits[r])) for r in ranks]
    want = torch.cat([got[r][rank] for r in ranks])
    out = torch.empty(want.shape, device=TPU)
    dist.all_to_all_single(out, xs[rank].to(TPU), [splits[r][rank] for r in ranks], splits[rank])
    check("all_to_all_single uneven", out, want)
    xs = [[value(r, (3,), salt=8 + j) for j in ranks] for r in ranks]
    outs = [torch.empty(3, device=TPU) for _ in ranks]
    dist.all_to_all(outs, [x.to(TPU) for x in xs[rank]])
    for r in ranks:
        check(f"all_to_all [{r}]", outs[r], xs[r][rank])

    # reduce, gather, scatter to/from rank 1
    xs = [value(r, (4,), salt=9) for r in ranks]
    t = xs[rank].to(TPU)
    dist.reduce(t, dst=1)
    check("reduce", t, sum(xs) if rank == 1 else xs[rank], exact=False)
    outs = [torch.empty(4, device=TPU) for _ in ranks] if rank == 1 else None
    dist.gather(xs[rank].to(TPU), outs, dst=1)
    if rank == 1:
        for r in ranks:
            check(f"gather [{r}]", outs[r], xs[r])
    pieces = [value(0, (3,), salt=10 + j) for j in ranks]
    out = torch.empty(3, device=TPU)
    dist.scatter(out, [p.to(TPU) for p in pieces] if rank == 0 else None, src=0)
    check("scatter", out, pieces[rank])

    # send / recv and batch_isend_irecv around a ring
    if world >= 2:
        if rank == 0:
            dist.send(torch.arange(5.0, device=TPU) * 3, dst=1)
        elif rank == 1:
            t = torch.zeros(5, device=TPU)
            dist.recv(t, src=0)
            check("send/recv", t, torch.arange(5.0) * 3)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        send = torch.full((4,), float(rank), device=TPU)
        recv = torch.zeros(4, device=TPU)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)])
        for req in reqs:
            req.wait()
        check("batch_isend_irecv ring", recv, torch.full((4,), float(prv)))

    # async work handles
    t = torch.ones(3, device=TPU) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    check("work.is_completed", work.is_completed(), True)
    fut = dist.all_reduce(t, async_op=True).get_future()
    check("work.get_future", fut.wait()[0], torch.full((3,), float(sum(r + 1 for r in ranks) * world)))

    # barrier
    dist.barrier()
    checks.append("barrier")

    # sub-groups: every rank creates every group; only members run its collectives
    evens = dist.new_group([r for r in ranks if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.tensor([float(rank)], device=TPU)
        dist.all_reduce(t, group=evens)
        check("new_group all_reduce", t, torch.tensor([float(sum(r for r in ranks if r % 2 == 0))]))
    pair = dist.new_group([world - 1, 0]) if world > 1 else None
    if pair is not None and rank in (0, world - 1):
        out = torch.empty(2, device=TPU)
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)], device=TPU), group=pair)
        # group rank order follows the ranks list as given? PyTorch sorts a new group's ranks.
        check("new_group all_gather", out, torch.tensor([0.0, float(world - 1)]))

    own, _ = dist.new_subgroups(group_size=1)  # a group of one per rank
    t = torch.tensor([float(rank)], device=TPU)
    dist.all_reduce(t, group=own)
    check("new_subgroups all_reduce", t, torch.tensor([float(rank)]))

    # functional collectives (what DTensor and compiled graphs call)
    import torch.distributed._functional_collectives as funcol

    xs = [value(r, (2, 2), salt=11) for r in ranks]
    got = funcol.all_reduce(xs[rank].to(TPU), "sum", dist.group.WORLD)
    check("funcol.all_reduce", funcol.wait_tensor(got), sum(xs), exact=False)
    got = funcol.all_gather_tensor(xs[rank].to(TPU), 0, dist.group.WORLD)
    check("funcol.all_gather_tensor", funcol.wait_tensor(got), torch.cat(xs))
    got = funcol.reduce_scatter_tensor(torch.cat(xs).to(TPU), "sum", 0, dist.group.WORLD)
    # rank r's chunk of cat(xs), summed over the world's identical inputs
    check("funcol.reduce_scatter_tensor", funcol.wait_tensor(got), world * xs[rank], exact=False)

    # CPU tensors go to the counted gloo fallback
    from torch_tpu.distributed import fallback_stats

    c = torch.tensor([float(rank + 1)])
    dist.all_reduce(c)
    check("cpu tensor via gloo fallback", c, torch.tensor([float(sum(r + 1 for r in ranks))]))
    check("gloo fallback counted", fallback_stats["gloo_cpu_collectives"] >= 1, True)

    # a bad argument gives a PyTorch-style error, not a hang
    try:
        dist.all_gather_into_tensor(torch.empty(3, device=TPU), torch.ones(2, device=TPU))
    except ValueError as err:
        check("bad all_gather_into_tensor size", "world size" in str(err), True)
    else:
        raise AssertionError("mismatched all_gather_into_tensor sizes were accepted")


# ---------------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(world: int, steps: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(world * 4, 8, generator=g), torch.randn(world * 4, 4, generator=g)) for _ in range(steps)]


def ddp() -> None:
    """DDP on tpu for 10 steps == one process on the concatenated batch (also on tpu)."""
    rank, world = init()
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 10
    batches = _batches(world, steps)
    model = DDP(_mlp().to(TPU))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        xs, ys = x[rank * 4:(rank + 1) * 4].to(TPU), y[rank * 4:(rank + 1) * 4].to(TPU)
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:  # asymmetric work between collectives: extra tpu ops and a materialization
            extra = (loss.detach() * 2).item()
            print(f"rank 0 step loss {extra / 2:.4f}", flush=True)
    # single process, whole batch, on CPU at float32 "highest"
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        check(f"ddp {name}", p.detach(), q.detach(), exact=False, rtol=2e-4, atol=2e-5)


def killed() -> None:
    """Rank 1 dies before the second collective; the others get an error naming rank 1.
    Initialised with no backend named: a tpu process picks tpu_dist, as a cuda one picks NCCL."""
    _failure(lambda: os._exit(3), "died", backend=None)


def straggler() -> None:
    """Rank 1 never arrives (busy past the timeout); the others time out naming rank 1."""
    _failure(lambda: (time.sleep(TIMEOUT + 8), os._exit(0)), "timed out after")


TIMEOUT = 5.0


def _failure(rank1_does, expect: str, backend: str | None = "tpu_dist") -> None:
    # Also the init_method path: tcp:// with explicit rank and world size, no torchrun variables.
    from torch_tpu.distributed import ProcessGroupTPU, process_group

    rank, world = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    check("tcp:// init_method", (dist.get_rank(), torch.tpu.current_device()), (rank, int(os.environ["LOCAL_RANK"])))
    if backend is None:
        check("no backend named: the default group is tpu_dist's", type(dist.group.WORLD), ProcessGroupTPU)
    launched = process_group.stats["collectives"]
    t = torch.ones(2, device=TPU)
    dist.all_reduce(t)
    check("first all_reduce", t, torch.full((2,), float(world)))
    check("first all_reduce ran on tpu_dist", process_group.stats["collectives"], launched + 1)
    if rank == 1:
        rank1_does()
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as err:  # noqa: BLE001 - the error is the check
        took = time.monotonic() - start
        print(f"SURVIVOR ERROR {type(err).__name__} after {took:.1f}s: {err}", flush=True)
        check("error names rank 1", "ranks [1] never reached it" in str(err), True)
        check("error names the collective", "all_reduce" in str(err), True)
        if expect == "timed out after":
            check("timeout error", "timed out after" in str(err), True)
        check("error within the timeout (+ grace)", took < TIMEOUT + 5.0, True)
    else:
        raise AssertionError("all_reduce with a missing peer returned")
    print("CHECKS " + ",".join(checks), flush=True)
    os._exit(0)  # the process group is unusable now; skip JAX's shutdown barrier


class _Block(torch.nn.Module):
    """A small pre-norm transformer block (attention + MLP)."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class _Transformer(torch.nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([_Block(dim) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(model, data, steps: int, device, shard=None):
    # SGD: Adam would amplify the rounding noise of gradients that are zero in exact arithmetic
    # (attention is invariant to the key bias).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens in data[:steps]:
        tokens = tokens.to(device) if shard is None else tokens[shard].to(device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def fsdp() -> None:
    """FSDP2 fully_shard (fp32, then bf16 params / fp32 reduce) == one process on the whole batch."""
    rank, world = init()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 32, (world * 2, 9), generator=g) for _ in range(4)]
    shard = slice(rank * 2, (rank + 1) * 2)

    torch.manual_seed(0)
    ref = _Transformer()
    init_state = {k: v.clone() for k, v in ref.state_dict().items()}
    _train(ref, data, 4, "cpu")

    for label, mp in (("fp32", None), ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        model = _Transformer()
        model.load_state_dict(init_state)
        model = model.to(TPU)
        kwargs = {} if mp is None else {"mp_policy": mp}
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        check(f"fsdp {label} params are DTensors", all(isinstance(p, DTensor) for p in model.parameters()), True)
        _train(model, data, 4, TPU, shard)
        tol = dict(rtol=2e-3, atol=2e-4) if mp is None else dict(rtol=0.1, atol=2e-2)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            check(f"fsdp {label} {name}", p.full_tensor().detach(), q.detach(), exact=False, **tol)
        if mp is None and os.environ.get("TPU_DIST_DIR"):
            _dcp_save(model, os.environ["TPU_DIST_DIR"], rank)


def _dcp_save(model, path: str, rank: int) -> None:
    """Save the FSDP2-sharded state dict with DCP (each rank writes its shards) and the full values."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(path, "dcp"))
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(path, "full.pt"))
    check("dcp save", True, True)


def mesh4() -> None:
    """4 processes: init_device_mesh("tpu", (2, 2)), DTensor and tensor parallelism against CPU."""
    rank, world = init()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
    check("mesh device type", mesh.device_type, "tpu")
    check("mesh shape", tuple(mesh.shape), (2, 2))
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
    da = distribute_tensor(a, mesh, [Shard(0), Replicate()])
    db = distribute_tensor(b, mesh, [Replicate(), Shard(1)])
    check("distribute_tensor local shard", da.to_local(), a.chunk(2)[mesh.get_coordinate()[0]])
    dc = da @ db
    check("dtensor matmul", dc.full_tensor(), a @ b, exact=False, rtol=1e-5, atol=1e-5)
    moved = dc.redistribute(mesh, [Replicate(), Replicate()])
    check("redistribute to replicate", moved.to_local(), a @ b, exact=False, rtol=1e-5, atol=1e-5)
    resharded = moved.redistribute(mesh, [Shard(1), Shard(0)])
    check("redistribute to shards", resharded.full_tensor(), a @ b, exact=False, rtol=1e-5, atol=1e-5)
    summed = distribute_tensor(a, mesh, [Shard(0), Shard(1)]).sum()
    check("dtensor sum (partial -> all_reduce)", summed.full_tensor(), a.sum(), exact=False, rtol=1e-5, atol=1e-5)

    # tensor parallelism on the "tp" dimension of the mesh
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    tp = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    tp.load_state_dict(ref.state_dict())
    tp = parallelize_module(tp.to(TPU), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 6, generator=g)
    out = tp(x.to(TPU))
    check("tensor parallel forward", out, ref(x), exact=False, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    ref(x).sum().backward()
    check("tensor parallel grad", tp[0].weight.grad.full_tensor(), ref[0].weight.grad, exact=False, rtol=1e-5, atol=1e-5)

    # collectives on the mesh's sub-groups
    t = torch.tensor([float(rank)], device=TPU)
    dist.all_reduce(t, group=mesh.get_group("tp"))
    row = [r for r in range(world) if r // 2 == rank // 2]
    check("mesh tp group all_reduce", t, torch.tensor([float(sum(row))]))
    t = torch.tensor([float(rank)], device=TPU)
    dist.all_reduce(t, group=mesh.get_group("dp"))
    col = [r for r in range(world) if r % 2 == rank % 2]
    check("mesh dp group all_reduce", t, torch.tensor([float(sum(col))]))


def spmd() -> None:
    """spmd_safe: identical regions pass the handshake; differing ones raise naming the rank and op."""
    rank, world = init()
    from torch_tpu.distributed import SpmdMismatchError, spmd_safe

    @spmd_safe
    def step(t):
        dist.all_reduce(t)
        return t * 2

    for _ in range(2):  # the second run skips the handshake
        out = step(torch.ones(3, device=TPU))
    check("spmd_safe region result", out, torch.full((3,), 2.0 * world))
    check("torch.tpu.spmd_safe", torch.tpu.spmd_safe is spmd_safe, True)

    def mismatch(body, label):
        try:
            with spmd_safe(name=label):
                body()
        except SpmdMismatchError as err:
            print(f"MISMATCH {label}: {err}", flush=True)
            check(f"spmd mismatch {label} names rank 1", "ranks [1] differ from rank 0" in str(err), True)
            return str(err)
        raise AssertionError(f"spmd_safe accepted {label}")

    t = torch.ones(4, device=TPU)
    msg = mismatch(lambda: dist.all_reduce(t) if rank == 0 else dist.all_reduce(t, op=dist.ReduceOp.MAX), "op")
    check("spmd mismatch names the operations", "all_reduce(float32[4], sum)" in msg and "max" in msg, True)
    msg = mismatch(lambda: dist.all_reduce(t) if rank == 0 else None, "missing collective")
    check("spmd mismatch names end of region", "end of region" in msg, True)
    dist.barrier()  # the group still works: nothing mismatched was launched
    checks.append("group usable after mismatch")


def compiled() -> None:
    """torch.compile(backend="tpu") graphs with functional collectives: one SPMD program, == gloo on CPU."""
    rank, world = init()
    import torch.distributed._functional_collectives as funcol

    import torch_tpu.compile
    from torch_tpu.compile import graph
    from torch_tpu.distributed import compiled as spmd_graphs
    from torch_tpu.distributed import process_group as pg

    torch_tpu.compile.register()
    gloo = dist.new_group(backend="gloo")
    group = dist.group.WORLD

    def step(x, w, b):
        h = torch.tanh(x @ w)
        s = funcol.wait_tensor(funcol.all_reduce(h, "sum", group))
        g = funcol.wait_tensor(funcol.all_gather_tensor(h * 2 + b, 0, group))
        r = funcol.wait_tensor(funcol.reduce_scatter_tensor(g, "avg", 0, group))
        m = funcol.wait_tensor(funcol.all_reduce(h.amax(0), "max", group))
        c = funcol.wait_tensor(funcol.broadcast(b * (rank + 1), 1, group))
        return s.sum() + 1, r, m, c

    fn = torch.compile(step, backend="tpu")
    before = (graph.stats.plans, graph.stats.eager_graphs, spmd_graphs.stats["graphs"], spmd_graphs.stats["calls"])
    for call in range(3):  # compiled once, then the cached program
        xs = [value(r, (4, 3), salt=20 + call) for r in range(world)]
        w, b = value(0, (3, 5), salt=30), value(0, (4, 5), salt=31)
        launched = pg.stats["collectives"]
        got = fn(xs[rank].to(TPU), w.to(TPU), b.to(TPU))
        got = [t.cpu() for t in got]
        check(f"compiled graph ran no process-group collective (call {call})", pg.stats["collectives"], launched)
        # reference: the same step on CPU tensors, collectives through torch's gloo
        h = torch.tanh(xs[rank] @ w)
        s = h.clone()
        dist.all_reduce(s, group=gloo)
        parts = [torch.empty_like(h) for _ in range(world)]
        dist.all_gather(parts, h * 2 + b, group=gloo)
        g = torch.cat(parts)
        r = torch.empty_like(h)
        dist.reduce_scatter(r, list(g.chunk(world)), group=gloo)
        r = r / world
        m = h.amax(0)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=gloo)
        c = b * (rank + 1)
        dist.broadcast(c, 1, group=gloo)
        tol = dict(rtol=1e-5, atol=1e-5)
        check("compiled all_reduce sum", got[0], s.sum() + 1, exact=False, **tol)
        check("compiled all_gather + reduce_scatter avg", got[1], r, exact=False, **tol)
        check("compiled all_reduce max", got[2], m, exact=False, **tol)
        check("compiled broadcast", got[3], c)
    after = (graph.stats.plans, graph.stats.eager_graphs, spmd_graphs.stats["graphs"], spmd_graphs.stats["calls"])
    check("compiled collectives: one graph program", tuple(a - b for a, b in zip(after, before)), (1, 0, 1, 3))

    # data-parallel SGD: the gradient all_reduce inside the compiled update == gloo on CPU
    def update(p, grad, lr):
        avg = funcol.wait_tensor(funcol.all_reduce(grad, "avg", group))
        return p - lr * avg

    upd = torch.compile(update, backend="tpu")
    p_tpu, p_cpu = value(0, (6,), salt=40).to(TPU), value(0, (6,), salt=40)
    for i in range(3):
        grad = value(rank, (6,), salt=41 + i)
        p_tpu = upd(p_tpu, grad.to(TPU), 0.5)
        avg = grad.clone()
        dist.all_reduce(avg, group=gloo)
        p_cpu = p_cpu - 0.5 * (avg / world)
    check("compiled data-parallel update", p_tpu, p_cpu, exact=False, rtol=1e-6, atol=1e-6)


def spmd_ddp() -> None:
    """An spmd_safe DDP step under DeferAndFuse runs fewer programs than the skinny step, same result."""
    rank, world = init()
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_tpu
    from torch_tpu import metrics
    from torch_tpu.distributed import compiled as fused
    from torch_tpu.distributed import process_group as pg
    from torch_tpu.distributed import spmd_safe

    def programs_run() -> int:  # DeferAndFuse's fused programs and the collectives' own programs
        return metrics.counts.fused_executions + pg.stats["collectives"]

    steps, batches = 3, _batches(world, 3)
    results, counts = {}, {}
    for label in ("skinny", "spmd_safe"):
        model = DDP(_mlp().to(TPU))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        body = spmd_safe(step, name="ddp step") if label == "spmd_safe" else step
        per_step = []
        for x, y in batches[:steps]:
            xs, ys = x[rank * 4:(rank + 1) * 4].to(TPU), y[rank * 4:(rank + 1) * 4].to(TPU)
            torch.tpu.synchronize()
            before = programs_run()
            with torch_tpu.defer_and_fuse():
                body(xs, ys)
                torch.tpu.synchronize()
            per_step.append(programs_run() - before)
        results[label] = [p.detach().cpu() for p in model.module.parameters()]
        counts[label] = per_step[-1]  # a later step: compiled and handshaken already
        print(f"{label}: programs per DDP step {per_step}", flush=True)
    check("spmd_safe ddp step recorded its all_reduce", fused.stats["recorded"] >= steps, True)
    check("spmd_safe ddp step runs fewer programs", counts["spmd_safe"] < counts["skinny"], True)
    for k, (a, b) in enumerate(zip(results["spmd_safe"], results["skinny"])):
        check(f"spmd_safe ddp param {k} == skinny", a, b, exact=False, rtol=1e-5, atol=1e-6)
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches[:steps]:
        loss = torch.nn.functional.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    for k, (a, q) in enumerate(zip(results["spmd_safe"], ref.parameters())):
        check(f"spmd_safe ddp param {k} == one process", a, q.detach(), exact=False, rtol=2e-4, atol=2e-5)


def main() -> None:
    name = sys.argv[1]
    if os.environ.get("TPU_DIST_TRACE"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TPU_DIST_TRACE"]), exit=True)
    for part in name.split("+"):  # several programs in one launch share JAX's start-up
        globals()[part]()
    if dist.is_initialized():
        dist.destroy_process_group()
    print("CHECKS " + ",".join(checks), flush=True)


if __name__ == "__main__":
    main()
