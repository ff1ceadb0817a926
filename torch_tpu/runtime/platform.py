"""PJRT platform choice and device discovery (lazy: first use initialises JAX).

Owns: which XLA platform backs "tpu" (TPU if present, else GPU, else CPU;
TORCH_TPU_PLATFORM overrides), how many devices it exposes, their kinds and
memory limits. Does not own: buffers (storage.py) or programs (eager/).
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass

from torch_tpu import _native
from torch_tpu.config import config
from torch_tpu.runtime import local_device

_lock = threading.RLock()
_state: "Runtime | None" = None
_requested_cpu_devices: int | None = None
_on_init: list = []  # callables run once the devices exist (kernel registration, pending seeds)


def on_init(callback) -> None:
    """Run `callback()` when the runtime initialises (now, if it already has)."""
    _on_init.append(callback)
    if _state is not None:
        callback()


@dataclass(frozen=True)
class Runtime:
    platform: str  # "tpu", "gpu" or "cpu"
    devices: tuple  # jax.Device per tpu index
    shardings: tuple  # jax SingleDeviceSharding per tpu index

    @property
    def device_kind(self) -> str:
        return process_device(self).device_kind


def set_num_cpu_devices(n: int) -> None:
    """Ask for `n` XLA:CPU devices (testing multi-device code on one CPU).

    Must be called before the runtime initialises (before the first tpu tensor).
    """
    global _requested_cpu_devices
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"set_num_cpu_devices expects a positive int, got {n!r}")
    with _lock:
        if _state is not None:
            if _state.platform == "cpu" and len(_state.devices) == n:
                return
            raise RuntimeError(
                "set_num_cpu_devices() must be called before the tpu runtime initialises "
                "(before the first tpu tensor or torch.tpu.device_count())"
            )
        _requested_cpu_devices = n


def launched_per_device() -> bool:
    """Started by a distributed launcher (torchrun's RANK/WORLD_SIZE > 1): one device per process.

    Then the device count (LOCAL_WORLD_SIZE, runtime/local_device.py) is known before JAX starts,
    so PyTorch may ask it (init_process_group does) before tpu_dist joins the multi-process runtime.
    """
    return local_device.assignment() is not None


def count_for_torch() -> int:
    """The device count PyTorch's hooks see (without starting JAX in a launched process)."""
    if _state is None:
        a = local_device.assignment()
        if a is not None:
            return a.count
    return len(get().devices)


def process_device(rt: "Runtime | None" = None):
    """The jax device this process computes on by default: its own in a launched process, else tpu:0's."""
    devices = (rt or get()).devices
    return devices.own if isinstance(devices, local_device.OwnedSlots) else devices[0]


def physical_device_count() -> int:
    """Distinct local XLA devices (a launched process's tpu indices all name its one device)."""
    devices = get().devices
    return 1 if isinstance(devices, local_device.OwnedSlots) else len(devices)


def is_initialized() -> bool:
    return _state is not None


def get() -> Runtime:
    """The initialised runtime (initialising it on first call)."""
    state = _state
    return state if state is not None else init()


def init() -> Runtime:
    global _state
    with _lock:
        if _state is not None:
            return _state
        import jax

        # NOTE(torch-vs-xla): PyTorch's default integer type is int64; JAX is
        # 32-bit unless x64 is on. Our lowerings choose every dtype explicitly.
        jax.config.update("jax_enable_x64", True)
        platform = config.platform
        if platform in ("cuda", "rocm"):
            platform = "gpu"
        n_cpu = _requested_cpu_devices or config.num_cpu_devices
        assignment = local_device.assignment()
        if assignment is not None:  # one process per device (tpu_dist)
            n_cpu = 1
        if n_cpu is not None and (platform in (None, "cpu")):
            try:
                jax.config.update("jax_num_cpu_devices", n_cpu)
            except Exception as err:  # backends already initialised by user code
                warnings.warn(f"torch_tpu: could not set {n_cpu} CPU devices: {err}", stacklevel=2)
        if platform is None:
            platform = jax.default_backend()
        try:
            # This process's devices only: under jax.distributed (tpu_dist) jax.devices()
            # also lists other processes' devices, which this process cannot address.
            devices = tuple(jax.local_devices(backend=platform))
        except RuntimeError as err:
            raise RuntimeError(
                f"torch_tpu: XLA platform {platform!r} is not available ({err}). "
                "Unset TORCH_TPU_PLATFORM or choose one of tpu, gpu, cpu."
            ) from None
        if platform == "cpu" and n_cpu is not None and len(devices) != n_cpu:
            warnings.warn(
                f"torch_tpu: asked for {n_cpu} CPU devices but XLA exposes {len(devices)} "
                "(JAX was initialised before torch_tpu)",
                stacklevel=2,
            )
        from jax.sharding import SingleDeviceSharding

        shardings = tuple(SingleDeviceSharding(d) for d in devices)
        if assignment is not None:  # tpu:{LOCAL_RANK} is this process's one device
            if len(devices) != 1:
                raise RuntimeError(
                    f"tpu_dist: this process sees {len(devices)} local {devices[0].platform} devices; tpu_dist "
                    "runs one process per device (on a TPU host give each process one chip, e.g. "
                    "TPU_VISIBLE_CHIPS / TPU_PROCESS_BOUNDS, or launch with torchrun --nproc-per-node=<chips>)"
                )
            local_device.claim(assignment)
            devices = local_device.OwnedSlots(devices[0], assignment)
            shardings = local_device.OwnedSlots(shardings[0], assignment)
        state = Runtime(
            platform=next(iter(devices)).platform if platform != "gpu" else "gpu",
            devices=devices,
            shardings=shardings,
        )
        for index, device in enumerate(devices):
            _native.set_memory_limit(index, _memory_limit(device))
        _native.set_device_count(len(devices))
        _state = state
        try:
            for callback in _on_init:
                callback()
        except BaseException:
            _state = None
            _native.set_device_count(-1)
            raise
        return state


def _memory_limit(device) -> int:
    try:
        stats = device.memory_stats() or {}
    except Exception:
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    # XLA:CPU reports no limit: its devices share host memory.
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 2**62


def device_count() -> int:
    return len(get().devices)
