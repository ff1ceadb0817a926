"""Which tpu index a launched process owns (one process per device, as torchrun starts them).

torchrun starts LOCAL_WORLD_SIZE processes on a host, each with its LOCAL_RANK, and CUDA code
(TorchTitan, DeviceMesh's own default) selects `cuda:{LOCAL_RANK}` / `set_device(local_rank)`.
Each such process computes on exactly one XLA device (tpu_dist), which PyTorch addresses as
`tpu:{LOCAL_RANK}`: the device count is LOCAL_WORLD_SIZE (the host's devices, as CUDA counts
them), the process's current device starts at its own index, and every other index is another
process's device: using one raises an error naming its owner, and two processes of one job that
claim the same index on one host (a launcher that repeats a LOCAL_RANK) fail at start-up.

Owns: reading the launcher's variables, the index-checked device tuples, the per-host claim.
Does not own: starting JAX (platform.py) or the multi-process runtime (distributed/bootstrap.py).
"""
from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
from dataclasses import dataclass

_MAX_DEVICES = 64  # the native shim's per-index tables


@dataclass(frozen=True)
class Assignment:
    index: int  # this process's tpu index: LOCAL_RANK
    count: int  # tpu indices on this host: LOCAL_WORLD_SIZE (torch.tpu.device_count())
    rank: int  # global RANK (for messages)


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"torch_tpu: {name}={value!r} is not an integer (set by the launcher)") from None


_UNREAD = object()
_assignment = _UNREAD  # read once: the launcher's variables fix the layout for the process's life


def assignment() -> Assignment | None:
    """This process's device when a launcher started one process per device (WORLD_SIZE > 1, RANK), else None.

    Read from the environment on first call (torch_tpu's import, in a launched process) and kept:
    a program may pop RANK/WORLD_SIZE later (to init_process_group with explicit ranks) without
    changing the device count PyTorch has already seen."""
    global _assignment
    if _assignment is _UNREAD:
        _assignment = _read()
    return _assignment


def _read() -> Assignment | None:
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in os.environ:
        return None
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK")
    if local_rank is None:  # a launcher without LOCAL_RANK: the process's one device is tpu:0
        return Assignment(index=0, count=1, rank=rank)
    count = _env_int("LOCAL_WORLD_SIZE", local_rank + 1)
    if not 0 <= local_rank < count:
        raise RuntimeError(
            f"torch_tpu: LOCAL_RANK={local_rank} is not in [0, LOCAL_WORLD_SIZE={count}) (set by the launcher)"
        )
    if count > _MAX_DEVICES:
        raise RuntimeError(f"torch_tpu: LOCAL_WORLD_SIZE={count}: at most {_MAX_DEVICES} processes per host")
    return Assignment(index=local_rank, count=count, rank=rank)


def not_owned_message(index: int, a: Assignment) -> str:
    return (
        f"tpu:{index} is the device of local rank {index}'s process: this process (RANK={a.rank}, "
        f"LOCAL_RANK={a.index} of LOCAL_WORLD_SIZE={a.count}) owns tpu:{a.index} only (one process per "
        f"device). Use torch.device('tpu') or f'tpu:{{LOCAL_RANK}}'; a new thread starts on tpu:0, call "
        f"torch.tpu.set_device({a.index}) in it first"
    )


class OwnedSlots(tuple):
    """A per-index tuple (jax devices or shardings) of length `count` whose every slot is this
    process's one device; indexing another process's slot raises (iteration and len do not)."""

    def __new__(cls, item, a: Assignment):
        slots = super().__new__(cls, (item,) * a.count)
        slots.assignment = a
        return slots

    def __getitem__(self, index):
        if isinstance(index, int) and index != self.assignment.index and -len(self) <= index < len(self):
            raise RuntimeError(not_owned_message(index % len(self), self.assignment))
        return tuple.__getitem__(self, index)

    @property
    def own(self):
        return tuple.__getitem__(self, self.assignment.index)


# ---------------------------------------------------------------------------
# the per-host claim

_claim_fd: int | None = None  # held open (and flock-ed) for the process's life


def _job_key() -> str:
    parts = [os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("MASTER_ADDR", ""),
             os.environ.get("MASTER_PORT", "")]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(p for p in parts if p) or "job")


def claim_path(a: Assignment) -> str:
    return os.path.join(tempfile.gettempdir(), "torch_tpu_device_claims", f"{_job_key()}-tpu{a.index}.lock")


def claim(a: Assignment) -> None:
    """Lock tpu:{index} of this host for this job; a second process of the job claiming it raises.

    A lock file per (job, index) under the temp directory, flock-ed while the process lives (the
    kernel drops it when the process dies, so a crashed run leaves nothing to clean).
    """
    global _claim_fd
    if _claim_fd is not None:
        return
    import fcntl

    path = claim_path(a)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            os.close(fd)
            raise
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RuntimeError(
            f"torch_tpu: tpu:{a.index} on host {socket.gethostname()} is already claimed by {holder} of this job "
            f"(LOCAL_RANK={a.index}); this process (pid {os.getpid()}, RANK={a.rank}) cannot share it: every "
            "process of a job needs its own LOCAL_RANK (torchrun --nproc-per-node=N sets 0..N-1)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} (RANK={a.rank})".encode(), 0)
    _claim_fd = fd
