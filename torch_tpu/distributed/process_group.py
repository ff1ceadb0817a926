"""The "tpu_dist" process group: c10d collectives on tpu tensors as XLA collective programs.

`ProcessGroupTPU` is a Python `torch.distributed.ProcessGroup` (PyTorch's
pybind trampoline forwards the C++ calls of DDP's reducer and of the
functional collectives to it). Each collective:
  1. is a materialization point: pending DeferAndFuse work is run first;
  2. takes this rank's input values from their tpu storages (strided views
     read by the executor's own programs);
  3. launches one cached XLA collective program over the group's mesh
     (programs.py), asynchronously;
  4. installs the results into the output tensors' storages;
  5. returns a Work whose wait() blocks until the program finished, for at
     most the group's timeout; a timeout names the collective and the ranks
     that never reached it (found through the c10d store).

CPU tensors handed to this group go to a gloo process group over the same
store: an explicit fallback, logged once and counted (`fallback_stats`).

Owns: argument checks, tensor <-> buffer conversion, Work, timeouts.
Does not own: the JAX programs (programs.py) or JAX start-up (bootstrap.py).
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from torch_tpu.distributed import bootstrap, programs, spmd
from torch_tpu import metrics
from torch_tpu.runtime import dtypes, local_device, platform, storage

log = logging.getLogger("torch_tpu.distributed")

ReduceOp = dist.ReduceOp
_OPS = {
    ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
    ReduceOp.PRODUCT: "product",
}
fallback_stats = {"gloo_cpu_collectives": 0}
stats = {"collectives": 0, "bytes": 0, "timeouts": 0}


def _report() -> dict:
    return {
        "collectives launched": stats["collectives"], "bytes sent (this rank)": stats["bytes"],
        "collective programs compiled": programs.stats["programs_compiled"], "timeouts": stats["timeouts"],
        "gloo fallback (CPU tensors)": fallback_stats["gloo_cpu_collectives"],
    }


metrics.add_section("distributed (tpu_dist)", _report)


def _op_name(op) -> str:
    if getattr(op, "op", None) == ReduceOp.RedOpType.PREMUL_SUM:  # sum of factor * x (FSDP2's gradient divide)
        factor = op.factor
        if not isinstance(factor, float):
            raise ValueError("tpu_dist supports ReduceOp.PREMUL_SUM with a Python float factor only")
        return "sum" if factor == 1.0 else f"premul_sum*{factor!r}"
    for known, name in _OPS.items():
        if op == known:
            return name
    raise ValueError(f"tpu_dist does not support reduce op {op} (supported: sum, avg, min, max, product, premul_sum)")


class CollectiveTimeoutError(dist.DistBackendError):
    """A collective did not complete within the process group's timeout."""


# ---------------------------------------------------------------------------
# tensors <-> flat device blocks


def _jax_dtype(dtype: torch.dtype):
    return jnp.dtype(dtypes.to_numpy(dtype))


def _local(t: torch.Tensor):
    """This rank's value of tpu tensor `t` as a flat device array (numel,)."""
    from torch_tpu.runtime import transfer

    if t.is_complex():
        t = torch.view_as_real(t)
    array = transfer.dense_array(t, flat=True) if t.numel() else None
    if array is None:
        return programs.zeros(t.numel(), _jax_dtype(t.dtype), platform.process_device())
    return array


class _Block:
    """A tensor's flat (dtype, size), as spmd_safe fingerprints describe a block, without reading it."""

    __slots__ = ("dtype", "shape")

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = _jax_dtype(t.dtype), (t.numel(),)


def _whole(t: torch.Tensor) -> bool:
    entry = storage.buffers.get(t.untyped_storage().data_ptr())
    return (
        (entry is None or entry[1] == t.dtype) and t.storage_offset() == 0 and t.is_contiguous()
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def _install(out: torch.Tensor, flat) -> None:
    """Write a flat result (numel,) into tpu tensor `out` (in place, through its view)."""
    from torch_tpu.runtime import transfer

    if out.is_complex():
        out = torch.view_as_real(out)
    if out.numel() == 0:
        return
    storage.drain()
    if _whole(out):  # the result becomes the storage's buffer
        storage.buffers[out.untyped_storage().data_ptr()] = (flat, out.dtype)
        return
    fresh = transfer._fresh(flat, tuple(out.shape), out.dtype, out.device.index or 0)
    with torch.no_grad():
        out.copy_(fresh)


def _check(name: str, tensors) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tpu_dist {name}: expected tensors, got {type(t).__name__}")
        if t.device.type != "tpu":
            raise ValueError(
                f"tpu_dist {name}: tensor on {t.device}; tpu_dist runs collectives on tpu tensors "
                "(CPU tensors go to its gloo fallback only all together)"
            )


# ---------------------------------------------------------------------------
# waiting with a timeout

class _Worker:
    """One daemon thread that launches collective programs and waits on their results.

    A collective whose peer never comes blocks XLA (on XLA:CPU already its launch);
    the caller waits on an event with the group's timeout instead, so it can raise.
    A stuck thread never keeps the process alive (daemon).
    """

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="tpu_dist-worker", daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            fn, done, box = self._queue.get()
            try:
                box.append((True, fn()))
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                box.append((False, err))
            done.set()

    def call(self, fn, seconds: float):
        """fn() on the worker thread; (finished, ok, value)."""
        done, box = threading.Event(), []
        self._queue.put((fn, done, box))
        if not done.wait(seconds):
            return False, False, None
        ok, value = box[0]
        return True, ok, value


_worker: _Worker | None = None


def _get_worker() -> _Worker:
    global _worker
    if _worker is None:
        _worker = _Worker()
    return _worker


class Work(dist.Work):
    """A launched collective: wait() blocks until its program finished (at most the group's timeout)."""

    def __init__(self, group: "ProcessGroupTPU", name: str, seq: int, arrays, result, after=None):
        super().__init__()
        self._group, self._name, self._seq = group, name, seq
        self._arrays = list(arrays)
        self._result = result
        self._after = after  # run once the program finished (e.g. gloo fallback finishing)
        self._done = not self._arrays
        self._error = None
        self._future = None

    def is_completed(self) -> bool:
        if not self._done and all(a.is_ready() for a in self._arrays):
            self._done = True
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._error is not None:
            raise self._error
        if not self._done:
            limit = None if timeout in (None, datetime.timedelta(0)) else timeout
            arrays = self._arrays
            if all(a.is_ready() for a in arrays):  # finished already: no hand-off to the worker
                self._done = True
                arrays = None
        if not self._done:
            self._group._bounded(self._name, self._seq, lambda: jax.block_until_ready(arrays), limit)
            self._done = True
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return True

    def get_future(self) -> Future:
        if self._future is None:
            self.wait()
            self._future = Future()
            self._future.set_result(self._result)
        return self._future

    def result(self):
        self.wait()
        return self._result


class _P2PWork(dist.Work):
    """A queued send/recv: wait() runs the group's queue of point-to-point ops, then waits."""

    def __init__(self, group, name: str, tensors):
        super().__init__()
        self._group, self._name, self._tensors = group, name, tensors
        self._inner = None

    def _set(self, inner) -> None:
        self._inner = inner

    def _run(self):
        if self._inner is None:
            self._group._flush_p2p()
        return self._inner

    def wait(self, timeout=None) -> bool:
        return self._run().wait(timeout)

    def is_completed(self) -> bool:
        return self._inner is not None and self._inner.is_completed()

    def get_future(self) -> Future:
        return self._run().get_future()

    def result(self):
        return self._run().result()


class _DoneWork(dist.Work):
    """A finished Work (the gloo fallback's, or a rank with nothing to do)."""

    def __init__(self, inner=None, result=None):
        super().__init__()
        self._inner, self._result = inner, result

    def wait(self, timeout=None) -> bool:
        if self._inner is not None:
            self._inner.wait()
        return True

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()

    def get_future(self) -> Future:
        if self._inner is not None:
            return self._inner.get_future()
        fut = Future()
        fut.set_result(self._result)
        return fut

    def result(self):
        return self._result


# ---------------------------------------------------------------------------


class ProcessGroupTPU(dist.ProcessGroup):
    """c10d process group whose collectives are XLA collective programs over the group's devices."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks=None):
        super().__init__(rank, size)
        self._store = store
        self._rank, self._size = rank, size
        self._timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self._global_ranks = tuple(global_ranks) if global_ranks else tuple(range(size))
        self._seq = 0
        self._name = ""
        self._desc = ""
        self._gloo = None
        self._devices_cache = None
        self._p2p: list = []  # queued isend/irecv (see _flush_p2p)

    # --- identity (PyProcessGroup forwards these C++ virtuals by their C++ names)

    def getBackendName(self) -> str:
        return "tpu_dist"

    def name(self) -> str:
        return "tpu_dist"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def _get_backend_name(self) -> str:
        return "tpu_dist"

    def __repr__(self):
        return f"ProcessGroupTPU(rank={self._rank}, size={self._size}, ranks={list(self._global_ranks)})"

    @property
    def _devices(self) -> tuple:
        if self._devices_cache is None:
            every = bootstrap.global_devices()
            self._devices_cache = tuple(every[r] for r in self._global_ranks) if len(every) > 1 else tuple(every)
        return self._devices_cache

    # --- the machinery

    def _launch(self, name: str, kind: str, inputs, params=(), install=None, result=None) -> Work:
        """Run collective `kind` on the flat values of `inputs`; install(results) writes the outputs."""
        storage.materialize("collective")
        self._flush_p2p()
        self._seq += 1
        blocks = [_local(t) for t in inputs]
        spmd.before_collective(self, name, blocks, params)
        stats["collectives"] += 1
        stats["bytes"] += sum(b.size * b.dtype.itemsize for b in blocks)
        devices = self._devices
        results = self._bounded(name, self._seq, lambda: programs.run(kind, devices, blocks, params))
        if install is not None:
            install(results)
        return Work(self, name, self._seq, results, result)

    def _bounded(self, name: str, seq: int, fn, timeout=None):
        """fn() (a launch, or a wait for results) on the worker thread, for at most the timeout."""
        limit = timeout if timeout is not None else self._timeout
        seconds = limit.total_seconds() if isinstance(limit, datetime.timedelta) else float(limit)
        finished, ok, value = _get_worker().call(fn, seconds)
        if not finished:
            raise self._timed_out(name, seq, seconds)
        if not ok:
            if isinstance(value, (ValueError, TypeError)) and "Gloo" not in str(value) and "UNKNOWN" not in str(value):
                raise value  # a bad argument met while tracing, not a peer's failure
            raise dist.DistBackendError(
                f"tpu_dist: {name} (collective #{seq} of group {self._name or '0'}) failed: {value}; "
                f"{self._missing(seq, 3.0)}. The process group cannot be used after this; end the process."
            ) from value
        return value

    def _missing(self, seq: int, grace: float) -> str:
        """Which ranks never reached collective `seq`: every rank that did says so in the store."""
        key = f"tpu_dist/stuck/{seq}/"
        try:
            self._store.set(key + str(self._rank), "1")
            deadline = time.monotonic() + grace
            arrived = {self._rank}
            while time.monotonic() < deadline and len(arrived) < self._size:
                for r in range(self._size):
                    if r not in arrived and self._store.check([key + str(r)]):
                        arrived.add(r)
                time.sleep(0.05)
        except Exception as err:  # noqa: BLE001 - the store itself may be gone with rank 0
            return f"the c10d store could not say which ranks are missing ({err})"
        missing = [self._global_ranks[r] for r in range(self._size) if r not in arrived]
        waited = sorted(self._global_ranks[r] for r in arrived)
        return f"ranks {missing} never reached it (dead, or running other code); ranks {waited} did"

    def _timed_out(self, name: str, seq: int, seconds: float) -> CollectiveTimeoutError:
        """The error of a collective that timed out, naming the ranks that never reached it."""
        stats["timeouts"] += 1
        detail = self._missing(seq, min(3.0, max(seconds / 4, 0.5)))
        return CollectiveTimeoutError(
            f"tpu_dist: {name} (collective #{seq} of group {self._name or '0'}, ranks "
            f"{list(self._global_ranks)}) timed out after {seconds:.1f} s: {detail}. The process group "
            "cannot be used after a timeout; end the process."
        )

    def _cpu(self, tensors) -> bool:
        devices = {t.device.type for t in tensors}
        if devices == {"cpu"}:
            return True
        if "cpu" in devices:
            raise ValueError("tpu_dist: a collective mixes CPU and tpu tensors; move them to one device")
        return False

    def _gloo_group(self):
        """The gloo group CPU tensors fall back to (created when all ranks first need it)."""
        if self._gloo is None:
            log.warning(
                "tpu_dist: collectives on CPU tensors run through a gloo process group "
                "(counted in torch_tpu.distributed.fallback_stats)"
            )
            prefix = dist.PrefixStore("gloo_cpu_fallback/", self._store)
            self._gloo = dist.ProcessGroupGloo(prefix, self._rank, self._size, self._timeout)
        fallback_stats["gloo_cpu_collectives"] += 1
        return self._gloo

    # --- collectives (names and signatures of c10d's ProcessGroup)

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        if self._cpu(tensors):
            return _DoneWork(self._gloo_group().allreduce(tensors, opts), tensors)
        _check("all_reduce", tensors)
        op = _op_name(opts.reduceOp)
        for t in tensors:
            if op == "avg" and not (t.is_floating_point() or t.is_complex()):
                raise ValueError(f"tpu_dist all_reduce: ReduceOp.AVG needs a floating tensor, got {t.dtype}")
            if t.is_complex() and op not in ("sum", "avg"):
                raise ValueError(f"tpu_dist all_reduce: {op} is not defined for complex tensors")
        if spmd.fuses(self) and not any(t.is_complex() for t in tensors):
            # spmd_safe under DeferAndFuse: recorded with the surrounding work, one SPMD program.
            spmd.before_collective(self, "all_reduce", [_Block(t) for t in tensors], (op,))
            from torch_tpu.distributed import compiled

            compiled.record_all_reduce(tensors, op, self)
            return _DoneWork(None, tensors)
        return self._launch(
            "all_reduce", "all_reduce", tensors, (op,),
            lambda rs: [_install(t, r) for t, r in zip(tensors, rs)], tensors,
        )

    def allreduce_coalesced(self, tensors, opts=None):
        o = dist.AllreduceOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
        return self.allreduce(tensors, o)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        if self._cpu(tensors):
            return _DoneWork(self._gloo_group().broadcast(tensors, opts), tensors)
        _check("broadcast", tensors)
        src = opts.rootRank
        return self._launch(
            "broadcast", "broadcast", tensors, (src,),
            lambda rs: [_install(t, r) for t, r in zip(tensors, rs)] if self._rank != src else None, tensors,
        )

    def allgather(self, output_tensors, input_tensors, opts=None):
        """output_tensors[i][r] <- rank r's input_tensors[i]."""
        flat_out = [t for ts in output_tensors for t in ts]
        if self._cpu(list(input_tensors) + flat_out):
            return _DoneWork(self._gloo_group().allgather(output_tensors, input_tensors), output_tensors)
        _check("all_gather", list(input_tensors) + flat_out)
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self._size:
                raise ValueError(f"tpu_dist all_gather: expected {self._size} output tensors, got {len(outs)}")
            for o in outs:
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ValueError(
                        "tpu_dist all_gather: every output tensor must match the input's size and dtype "
                        f"(got {tuple(o.shape)} {o.dtype} for input {tuple(inp.shape)} {inp.dtype})"
                    )

        def install(rs):
            for outs, r in zip(output_tensors, rs):
                pieces = r.reshape(self._size, -1)
                for k, o in enumerate(outs):
                    _install(o, pieces[k])

        return self._launch("all_gather", "all_gather", input_tensors, (), install, output_tensors)

    def _allgather_base(self, output, input, opts=None):
        if self._cpu([output, input]):
            return _DoneWork(self._gloo_group()._allgather_base(output, input), output)
        _check("all_gather_into_tensor", [output, input])
        if output.numel() != input.numel() * self._size:
            raise ValueError(
                f"tpu_dist all_gather_into_tensor: output has {output.numel()} elements, expected "
                f"world size ({self._size}) x input ({input.numel()})"
            )
        if output.dtype != input.dtype:
            raise ValueError("tpu_dist all_gather_into_tensor: output and input dtypes differ")
        return self._launch(
            "all_gather_into_tensor", "all_gather", [input], (), lambda rs: _install(output, rs[0]), output,
        )

    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if self._cpu(list(outputs) + list(inputs)):
            works = [self._gloo_group()._allgather_base(o, i) for o, i in zip(outputs, inputs)]
            return _DoneWork(works[-1] if works else None, outputs)
        _check("all_gather_into_tensor_coalesced", list(outputs) + list(inputs))
        return self._launch(
            "all_gather_into_tensor_coalesced", "all_gather", inputs, (),
            lambda rs: [_install(o, r) for o, r in zip(outputs, rs)], outputs,
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        """output_tensors[i] <- reduction over ranks of their input_lists[i][this rank]."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        flat_in = [t for ts in input_lists for t in ts]
        if self._cpu(list(output_tensors) + flat_in):
            return _DoneWork(self._gloo_group().reduce_scatter(output_tensors, input_lists, opts), output_tensors)
        _check("reduce_scatter", list(output_tensors) + flat_in)
        op = _op_name(opts.reduceOp)
        stacked = []
        for out, ins in zip(output_tensors, input_lists):
            if len(ins) != self._size:
                raise ValueError(f"tpu_dist reduce_scatter: expected {self._size} input tensors, got {len(ins)}")
            if ins[self._rank].numel() != out.numel() or any(t.dtype != out.dtype for t in ins):
                raise ValueError(
                    f"tpu_dist reduce_scatter: input {self._rank} (this rank's chunk) must match the output's "
                    f"size and dtype (got {tuple(ins[self._rank].shape)} {ins[self._rank].dtype} for output "
                    f"{tuple(out.shape)} {out.dtype})"
                )
            # Uneven chunks (as NCCL allows): every rank's list has the same sizes, so each pads every
            # chunk to the largest one; padding only meets padding in the reduction and is dropped.
            chunk = max(t.numel() for t in ins)
            stacked.append(torch.cat([
                torch.nn.functional.pad(t.reshape(-1), (0, chunk - t.numel())) if t.numel() < chunk else t.reshape(-1)
                for t in ins
            ]))

        def install(rs):
            for o, r in zip(output_tensors, rs):
                _install(o, r if r.shape[0] == o.numel() else r[:o.numel()])

        return self._launch("reduce_scatter", "reduce_scatter", stacked, (op,), install, output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if self._cpu([output, input]):
            return _DoneWork(self._gloo_group()._reduce_scatter_base(output, input, opts), output)
        _check("reduce_scatter_tensor", [output, input])
        if input.numel() != output.numel() * self._size:
            raise ValueError(
                f"tpu_dist reduce_scatter_tensor: input has {input.numel()} elements, expected "
                f"world size ({self._size}) x output ({output.numel()})"
            )
        op = _op_name(opts.reduceOp)
        return self._launch(
            "reduce_scatter_tensor", "reduce_scatter", [input], (op,), lambda rs: _install(output, rs[0]), output,
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        _check("reduce_scatter_tensor_coalesced", list(outputs) + list(inputs))
        op = _op_name(opts.reduceOp)
        return self._launch(
            "reduce_scatter_tensor_coalesced", "reduce_scatter", inputs, (op,),
            lambda rs: [_install(o, r) for o, r in zip(outputs, rs)], outputs,
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        if self._cpu(tensors):
            return _DoneWork(self._gloo_group().reduce(tensors, opts), tensors)
        _check("reduce", tensors)
        op, dst = _op_name(opts.reduceOp), opts.rootRank
        return self._launch(
            "reduce", "all_reduce", tensors, (op,),
            lambda rs: [_install(t, r) for t, r in zip(tensors, rs)] if self._rank == dst else None, tensors,
        )

    def gather(self, output_lists, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        flat_out = [t for ts in output_lists for t in ts]
        if self._cpu(list(input_tensors) + flat_out):
            return _DoneWork(self._gloo_group().gather(output_lists, input_tensors, opts), output_lists)
        _check("gather", list(input_tensors) + flat_out)
        dst = opts.rootRank

        def install(rs):
            if self._rank != dst:
                return
            for outs, r in zip(output_lists, rs):
                pieces = r.reshape(self._size, -1)
                for k, o in enumerate(outs):
                    _install(o, pieces[k])

        return self._launch("gather", "all_gather", input_tensors, (), install, output_lists)

    def scatter(self, output_tensors, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        flat_in = [t for ts in input_lists for t in ts]
        if self._cpu(list(output_tensors) + flat_in):
            return _DoneWork(self._gloo_group().scatter(output_tensors, input_lists, opts), output_tensors)
        _check("scatter", list(output_tensors) + flat_in)
        src = opts.rootRank
        if self._rank == src:
            stacked = [torch.cat([t.reshape(-1) for t in ins]) for ins in input_lists]
        else:  # same program on every rank: the others contribute zeros
            stacked = [torch.zeros(o.numel() * self._size, dtype=o.dtype, device=o.device) for o in output_tensors]
        return self._launch(
            "scatter", "scatter", stacked, (src,),
            lambda rs: [_install(o, r) for o, r in zip(output_tensors, rs)], output_tensors,
        )

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if self._cpu(list(output_tensors) + list(input_tensors)):
            return _DoneWork(self._gloo_group().alltoall(output_tensors, input_tensors), output_tensors)
        _check("all_to_all", list(output_tensors) + list(input_tensors))
        sizes = {t.numel() for t in list(output_tensors) + list(input_tensors)}
        if len(sizes) != 1:
            # Different sizes per peer: pad to a common chunk through all_to_all_single's path.
            return self._alltoall_uneven(output_tensors, input_tensors)
        stacked = torch.cat([t.reshape(-1) for t in input_tensors])

        def install(rs):
            pieces = rs[0].reshape(self._size, -1)
            for k, o in enumerate(output_tensors):
                _install(o, pieces[k])

        return self._launch("all_to_all", "all_to_all", [stacked], (), install, output_tensors)

    def _alltoall_uneven(self, output_tensors, input_tensors):
        dtype = input_tensors[0].dtype
        send = torch.cat([t.reshape(-1) for t in input_tensors])
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype, device=send.device)
        work = self._all_to_all_split(recv, send, [t.numel() for t in output_tensors],
                                      [t.numel() for t in input_tensors], 1)
        work.wait()
        for o, piece in zip(output_tensors, torch.split(recv, [t.numel() for t in output_tensors])):
            with torch.no_grad():
                o.copy_(piece.reshape(o.shape))
        return _DoneWork(None, output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if self._cpu([output, input]):
            return _DoneWork(
                self._gloo_group().alltoall_base(output, input, output_split_sizes, input_split_sizes), output
            )
        _check("all_to_all_single", [output, input])
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % self._size or output.numel() != input.numel():
                raise ValueError(
                    f"tpu_dist all_to_all_single: without split sizes input and output need equal sizes "
                    f"divisible by the world size ({self._size})"
                )
            return self._launch("all_to_all_single", "all_to_all", [input], (), lambda rs: _install(output, rs[0]),
                                output)
        row = input[0].numel() if input.dim() and input.shape[0] else 1
        outs = list(output_split_sizes) or [output.shape[0] // self._size] * self._size
        ins = list(input_split_sizes) or [input.shape[0] // self._size] * self._size
        if len(outs) != self._size or len(ins) != self._size:
            raise ValueError(f"tpu_dist all_to_all_single: split sizes need {self._size} entries")
        if sum(ins) != input.shape[0] or sum(outs) != output.shape[0]:
            raise ValueError("tpu_dist all_to_all_single: split sizes do not add up to the tensors' first dims")
        return self._all_to_all_split(output, input, [n * row for n in outs], [n * row for n in ins], 1)

    alltoall_base = all_to_all_single

    def _all_to_all_split(self, output, input, out_counts, in_counts, _):
        """Uneven all_to_all: every chunk padded to the largest one of any rank, then one all_to_all."""
        chunk = int(self._host_max(max(in_counts + out_counts)))
        device = platform.process_device()
        src = _local(input)
        # Gather indices on the host: chunk j of the send buffer, padded with the zero at the end.
        index = np.full((self._size, chunk), src.shape[0], dtype=np.int64)
        start = 0
        for j, n in enumerate(in_counts):
            index[j, :n] = np.arange(start, start + n)
            start += n
        padded = jnp.take(jnp.concatenate([src, jnp.zeros((1,), src.dtype)]),
                          jax.device_put(index.reshape(-1), device))
        storage.materialize("collective")
        self._flush_p2p()
        self._seq += 1
        stats["collectives"] += 1
        devices = self._devices
        (got,) = self._bounded("all_to_all_single", self._seq, lambda: programs.run("all_to_all", devices, [padded], ()))
        keep = np.concatenate([np.arange(j * chunk, j * chunk + n) for j, n in enumerate(out_counts)]).astype(np.int64)
        flat = jnp.take(got, jax.device_put(keep, device)) if keep.size else got[:0]
        _install(output, flat)
        return Work(self, "all_to_all_single", self._seq, [flat], output)

    def _host_max(self, value: int) -> int:
        """max(value) over the group's ranks, on the host (one small collective program)."""
        device = platform.process_device()
        block = jax.device_put(np.array([value], dtype=np.int64), device)
        self._flush_p2p()
        self._seq += 1
        devices = self._devices

        def run():
            (out,) = programs.run("all_reduce", devices, [block], ("max",))
            return int(np.asarray(out)[0])

        return self._bounded("all_to_all_single (split sizes)", self._seq, run)

    def barrier(self, opts=None):
        self._flush_p2p()
        token = torch.ones(1, device="tpu")
        return self._launch("barrier", "all_reduce", [token], ("sum",), None, None)

    # --- point to point: a ppermute over the pair's two-device mesh (both sides run it).
    # isend/irecv are queued and run together, in one order every rank agrees on (by pair,
    # then lower rank's send first), so a ring of isend/irecv (batch_isend_irecv) cannot
    # deadlock; a wait(), a blocking send/recv or any other collective runs the queue.

    def _pair(self, peer: int):
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"tpu_dist send/recv: invalid peer rank {peer} for rank {self._rank} of {self._size}")
        low, high = sorted((self._rank, peer))
        return low, high, (self._devices[low], self._devices[high])

    def _queue_p2p(self, name: str, tensors, peer: int, sending: bool):
        if self._cpu(tensors):
            gloo = self._gloo_group()
            return _DoneWork(gloo.send(tensors, peer, 0) if sending else gloo.recv(tensors, peer, 0), tensors)
        _check(name, tensors)
        low, high, devices = self._pair(peer)
        src = self._rank if sending else peer
        a, b = (0, 1) if src == low else (1, 0)
        work = _P2PWork(self, f"{name} {'to' if sending else 'from'} rank {peer}", tensors)
        # Sends read their tensors now (a later in-place update must not leak into the message).
        blocks = [_local(t) for t in tensors] if sending else None
        self._p2p.append(((low, high, a != 0, len(self._p2p)), devices, (a, b), tensors, blocks, sending, work))
        return work

    def _flush_p2p(self) -> None:
        pending, self._p2p = self._p2p, []
        if not pending:
            return
        storage.materialize("collective")
        for _, devices, perm, tensors, blocks, sending, work in sorted(pending, key=lambda p: p[0]):
            self._seq += 1
            if blocks is None:  # the receiver's block is a same-shaped placeholder
                blocks = [_local(t) for t in tensors]
            results = self._bounded(work._name, self._seq, lambda: programs.run("permute", devices, blocks, perm))
            if not sending:
                for t, r in zip(tensors, results):
                    _install(t, r)
            work._set(Work(self, work._name, self._seq, results, tensors))

    def send(self, tensors, dst: int, tag: int = 0):
        return self._queue_p2p("send", tensors, dst, True)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._queue_p2p("recv", tensors, src, False)

    def recv_anysource(self, tensors, tag: int = 0):
        raise NotImplementedError("tpu_dist: recv from any source is not supported (name the sender)")

    # --- sub-groups and lifetime

    def _get_backend(self, device):
        return self

    # `init_process_group(device_id=...)` (eager init) and `split_group` ask the group's backend
    # for these. A tpu_dist group is a set of XLA devices, not a communicator: connecting binds the
    # process's own device, and a split is a new group over the member ranks (nothing to split on
    # the other ranks).
    @property
    def supports_splitting(self) -> bool:
        return True

    @property
    def options(self):
        return None  # no backend options (split_group copies its parent's)

    def eager_connect_single_device(self, device) -> None:
        """Bind `device` (init_process_group's device_id): it must be this process's own tpu device."""
        device = torch.device(device)
        mine = local_device.assignment()
        if device.type != "tpu" or (mine is not None and device.index != mine.index):
            own = f"tpu:{mine.index}" if mine is not None else "a tpu device"
            raise ValueError(f"tpu_dist: init_process_group(device_id={device}) on rank {self._rank}: this process's "
                             f"device is {own} (a launched process's device is tpu:LOCAL_RANK)")
        self.bound_device_id = device

    def perform_nocolor_split(self, device) -> None:
        return None  # a rank outside a new group builds nothing

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """`dist.split_group`'s split: the group over `ranks` (ranks of this group); None off it."""
        ranks = sorted(ranks)
        if self._rank not in ranks:
            return None
        timeout = self._timeout if timeout is None else timeout
        store = dist.PrefixStore(f"{group_name}/", self._store)
        group = ProcessGroupTPU(store, ranks.index(self._rank), len(ranks), timeout,
                                [self._global_ranks[r] for r in ranks])
        group._set_group_name(group_name or "")
        group._set_group_desc(group_desc or "")
        return group

    def get_group_store(self):
        return self._store

    def _set_sequence_number_for_group(self) -> None:
        return None  # collectives count their own sequence (self._seq)

    def _wait_for_pending_works(self):
        return None

    def _has_hooks(self) -> bool:
        return False

    def abort(self):
        return None

    def shutdown(self):
        return None


def create_process_group(backend_opts, pg_options=None) -> ProcessGroupTPU:
    """c10d's creator for "tpu_dist" (extended API: gets the group's global ranks)."""
    store = backend_opts.store
    rank, size = backend_opts.group_rank, backend_opts.group_size
    timeout = backend_opts.timeout
    ranks = list(backend_opts.global_ranks_in_group) or list(range(size))
    if not dist.is_initialized():  # the default group: start JAX's multi-process runtime
        bootstrap.start(store, rank, size, timeout)
    elif not bootstrap.is_started():
        raise RuntimeError("tpu_dist: a sub-group needs the default process group to be tpu_dist")
    return ProcessGroupTPU(store, rank, size, timeout, ranks)
