"""Start JAX's multi-process runtime from a c10d rendezvous.

Owns: turning the default process group's (store, rank, world size, timeout)
into `jax.distributed.initialize`: rank 0 picks a free port on its host and
publishes "host:port" through the c10d store (no port to configure), every
rank reads it; on CPU, XLA's gloo cross-process collectives and one local CPU
device per process (one process per device, as on a TPU host).
Does not own: collectives (programs.py) or process groups (process_group.py).
"""
from __future__ import annotations

import datetime
import os
import socket

from torch_tpu.runtime import platform

_KEY = "tpu_dist/jax_coordinator"
_started: dict = {}  # "world": (rank, world size) once jax.distributed is up


def is_started() -> bool:
    return "world" in _started


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return sock.getsockname()[1]


def _coordinator_host() -> str:
    """Where rank 0's JAX coordinator listens: TORCH_TPU_COORDINATOR_HOST, else MASTER_ADDR, else loopback."""
    from torch_tpu.config import config

    return config.coordinator_host or os.environ.get("MASTER_ADDR") or "127.0.0.1"


def start(store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Join the JAX multi-process runtime (once per process, for the default group)."""
    if "world" in _started:
        if _started["world"] != (rank, world_size):
            raise RuntimeError(
                f"tpu_dist: this process already joined a JAX runtime as rank {_started['world'][0]} of "
                f"{_started['world'][1]}; it cannot rejoin as rank {rank} of {world_size} "
                "(destroy_process_group() does not end JAX's runtime; start a new process)"
            )
        return
    if world_size == 1:  # nothing to coordinate: this process's device is the whole mesh
        _started["world"] = (rank, world_size)
        return
    if platform.is_initialized():
        raise RuntimeError(
            "tpu_dist: init_process_group() must run before the first use of the tpu device in this "
            "process (JAX's multi-process runtime starts before its devices). Move tensor creation "
            "and .to('tpu') after init_process_group()."
        )
    import jax

    if rank == 0:
        host = _coordinator_host()
        address = f"{host}:{_free_port(host)}"
        store.set(_KEY, address)
    else:
        store.wait([_KEY], timeout)
        address = store.get(_KEY).decode()
    seconds = max(int(timeout.total_seconds()), 1)
    from torch_tpu.config import config

    if config.platform in (None, "cpu") and _no_accelerator():
        # One CPU device per process, and XLA:CPU's cross-process collectives (gloo over the
        # coordination service's key-value store).
        platform.set_num_cpu_devices(1)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=world_size,
        process_id=rank,
        initialization_timeout=seconds,
        # A process that dies stops heart-beating; survivors learn it from their collective
        # timeouts first (process_group.py), which name the missing ranks.
        shutdown_timeout_seconds=min(seconds, 60),
    )
    _started["world"] = (rank, world_size)
    rt = platform.get()
    count = platform.physical_device_count()  # a launched process's tpu indices all name its one device
    if count != 1:
        raise RuntimeError(
            f"tpu_dist: this process sees {count} local {rt.platform} devices; tpu_dist runs one "
            "process per device (on a TPU host give each process one chip, e.g. TPU_VISIBLE_CHIPS / "
            "TPU_PROCESS_BOUNDS, or launch with torchrun --nproc-per-node=<chips>)"
        )


def _no_accelerator() -> bool:
    """No TPU/GPU plugin JAX would pick (then "tpu" is XLA:CPU), asked without starting JAX."""
    import importlib.util

    return not any(importlib.util.find_spec(name) for name in ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin"))


def global_devices() -> list:
    """The device of each global rank (JAX orders processes by process id = c10d rank)."""
    import jax

    platform.get()
    if _started.get("world", (0, 1))[1] == 1:
        return [platform.process_device()]
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return devices
