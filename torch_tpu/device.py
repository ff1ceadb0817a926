"""The `torch.tpu` module: device management, RNG, memory statistics.

Mirrors `torch.cuda` where it is meaningful. Nothing here initialises the
runtime (JAX) until a function needs the devices.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from torch_tpu import _native

__all__ = [
    "is_available", "device_count", "current_device", "set_device", "device", "synchronize",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "default_generators",
    "get_device_name", "get_device_properties", "get_device_capability",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "memory_stats", "empty_cache", "set_per_process_memory_fraction",
    "is_initialized", "init", "Stream", "Event", "current_stream", "default_stream", "stream",
    "get_amp_supported_dtype", "is_bf16_supported", "mem_get_info", "set_stream", "StreamContext",
    "reset_accumulated_memory_stats",
]

_in_bad_fork = False
_pending_seed: int | None = None  # manual_seed_all before the runtime started


def _after_fork_in_child():
    global _in_bad_fork
    from torch_tpu.runtime import platform

    if platform.is_initialized():
        _in_bad_fork = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _is_in_bad_fork() -> bool:
    return _in_bad_fork


def _runtime():
    from torch_tpu.runtime import platform

    if _in_bad_fork:
        raise RuntimeError(
            "Cannot re-initialize the tpu runtime in a forked subprocess. To use tpu with multiprocessing, "
            "use the 'spawn' start method"
        )
    return platform.get()


def init() -> None:
    """Initialise the runtime now (it otherwise starts on first use)."""
    _runtime()


def is_initialized() -> bool:
    from torch_tpu.runtime import platform

    return platform.is_initialized()


def is_available() -> bool:
    """True when an XLA platform (TPU, GPU or CPU) backs the "tpu" device."""
    try:
        return device_count() > 0
    except RuntimeError:
        return False


def device_count() -> int:
    from torch_tpu.runtime import platform

    if _in_bad_fork:
        _runtime()  # the fork error
    return platform.count_for_torch()  # a launched process: LOCAL_WORLD_SIZE, without starting JAX


def _index(device=None, owned: bool = True) -> int:
    """The tpu index `device` names; in a launched process (one per device) it must be this
    process's own (`owned=False`: any index in range, for per-index tables like the generators)."""
    if device is None:
        index = current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        index = device.index if device.index is not None else current_device()
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"Invalid device 'tpu:{index}': torch.tpu.device_count() is {count}")
    if owned:
        from torch_tpu.runtime import local_device

        a = local_device.assignment()
        if a is not None and index != a.index:
            raise RuntimeError(local_device.not_owned_message(index, a))
    return index


def _start_on_own_device() -> None:
    """A launched process (torchrun: LOCAL_RANK) starts on tpu:{LOCAL_RANK}, its one device (no JAX start)."""
    from torch_tpu.runtime import local_device

    try:
        a = local_device.assignment()
    except RuntimeError:  # a malformed LOCAL_RANK: reported when the device is used, not at `import torch`
        return
    if a is not None and a.index != 0:
        _native.set_device(a.index)


def current_device() -> int:
    return _native.current_device()


def set_device(device) -> None:
    """Set the current tpu device of this thread (like torch.cuda.set_device)."""
    _native.set_device(_index(device))


class device:
    """Context manager that changes the current tpu device."""

    def __init__(self, device):
        self.index = -1 if device is None else _index(device)
        self.previous = -1

    def __enter__(self):
        self.previous = current_device()
        if self.index >= 0:
            _native.set_device(self.index)

    def __exit__(self, *exc):
        if self.index >= 0:
            _native.set_device(self.previous)
        return False


def synchronize(device=None) -> None:
    """Wait until every queued computation on the device has finished (DeferAndFuse: runs what is recorded)."""
    from torch_tpu import streams
    from torch_tpu.runtime import local_device

    index = _index(device, owned=False)
    a = local_device.assignment()
    if a is not None and index != a.index:
        return  # another process's device: nothing of this process runs there (CUDA allows the call too)
    streams.synchronize(index)


# ------------------------------------------------------------------ RNG
class _DefaultGenerators:
    """`torch.tpu.default_generators[i]`: the default generator of each device."""

    def __getitem__(self, index: int) -> torch.Generator:
        return _native.default_generator(_index(index, owned=False))

    def __len__(self) -> int:
        return device_count()

    def __iter__(self):
        return (self[i] for i in range(len(self)))


default_generators = _DefaultGenerators()


def _apply_pending_seed() -> None:
    global _pending_seed
    if _pending_seed is not None:
        seed, _pending_seed = _pending_seed, None
        for generator in default_generators:
            generator.manual_seed(seed)


def manual_seed(seed: int) -> None:
    """Seed the current tpu device's generator."""
    seed = int(seed)
    if not is_initialized():
        manual_seed_all(seed)
        return
    default_generators[current_device()].manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Seed every tpu device's generator (called by torch.manual_seed)."""
    global _pending_seed
    seed = int(seed)
    if not is_initialized():
        _pending_seed = seed  # applied when the runtime starts: seeding must not start JAX
        return
    for generator in default_generators:
        generator.manual_seed(seed)


def seed() -> None:
    default_generators[current_device()].seed()


def seed_all() -> None:
    import random

    value = random.getrandbits(63)
    for generator in default_generators:
        generator.manual_seed(value)


def initial_seed() -> int:
    return default_generators[current_device()].initial_seed()


def get_rng_state(device="tpu") -> torch.Tensor:
    return default_generators[_index(device)].get_state()


def set_rng_state(new_state: torch.Tensor, device="tpu") -> None:
    default_generators[_index(device)].set_state(new_state)


def get_rng_state_all() -> list:
    return [g.get_state() for g in default_generators]


def set_rng_state_all(states) -> None:
    for generator, state in zip(default_generators, states):
        generator.set_state(state)


# ------------------------------------------------------------------ properties
@dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    kind: str
    index: int
    total_memory: int
    # Compute units XLA spreads one program over: TensorCores of the device on TPU (JAX's num_cores),
    # host cores on XLA:CPU. The field name is CUDA's (SMs), which device-generic code reads.
    multi_processor_count: int = 1
    major: int = 0
    minor: int = 0

    def __repr__(self):
        return (f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', "
                f"total_memory={self.total_memory // (1024 * 1024)}MB)")


def get_device_properties(device=None) -> DeviceProperties:
    rt = _runtime()
    index = _index(device)
    d = rt.devices[index]
    cores = getattr(d, "num_cores", None) or (os.cpu_count() if rt.platform == "cpu" else 1)
    return DeviceProperties(
        name=get_device_name(index), platform=rt.platform, kind=d.device_kind, index=index,
        total_memory=_native.memory_stats(index)["bytes_limit"], multi_processor_count=int(cores),
    )


def get_device_name(device=None) -> str:
    rt = _runtime()
    d = rt.devices[_index(device)]
    kind = d.device_kind
    return kind if rt.platform != "cpu" else f"XLA:CPU ({kind})"


def get_device_capability(device=None) -> tuple[int, int]:
    return (0, 0)


# ------------------------------------------------------------------ memory
# The native allocator is PyTorch's DeviceAllocator for tpu: these read torch.accelerator's memory
# API, which reads the allocator's counts (one XLA buffer per storage, so reserved == allocated).
def _accel_index(device) -> int:
    from torch_tpu.runtime import storage

    storage.drain()  # count freed storages' buffers as released now
    return _index(device)


def memory_allocated(device=None) -> int:
    """Bytes held by live tpu storages on the device."""
    return torch.accelerator.memory_allocated(_accel_index(device))


def max_memory_allocated(device=None) -> int:
    """Peak of memory_allocated since start or the last reset_peak_memory_stats."""
    return torch.accelerator.max_memory_allocated(_accel_index(device))


def memory_reserved(device=None) -> int:
    """Equals memory_allocated: XLA holds one buffer per storage and we cache none."""
    return torch.accelerator.memory_reserved(_accel_index(device))


def max_memory_reserved(device=None) -> int:
    return torch.accelerator.max_memory_reserved(_accel_index(device))


def reset_peak_memory_stats(device=None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device=None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


def memory_stats(device=None) -> dict:
    """CUDA-style memory statistics (torch.accelerator.memory_stats), plus the live device buffer count."""
    from torch_tpu.runtime import storage

    index = _accel_index(device)
    stats = dict(torch.accelerator.memory_stats(index))
    stats["bytes_limit"] = _native.memory_stats(index)["bytes_limit"]
    # Buffers that exist on the device (DeferAndFuse's pending values do not, yet).
    stats["num_device_buffers"] = sum(1 for value, _ in list(storage.buffers.values()) if hasattr(value, "nbytes"))
    return stats


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) device memory in bytes, like torch.cuda.mem_get_info (docs/device-generic.md)."""
    return torch.accelerator.get_memory_info(_index(device))


def empty_cache() -> None:
    """Release device buffers of freed storages now."""
    from torch_tpu.runtime import storage

    storage.drain()


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """Cap this process's tpu allocations at `fraction` of the device memory."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    index = _index(device)
    from torch_tpu.runtime import platform

    total = platform._memory_limit(_runtime().devices[index])
    _native.set_memory_limit(index, int(total * fraction))


# ------------------------------------------------------------------ streams
from torch_tpu.streams import (  # noqa: E402
    Event, Stream, StreamContext, current_stream, default_stream, set_stream, stream,
)


def get_amp_supported_dtype() -> list:
    """The dtypes `torch.autocast("tpu", dtype=...)` accepts (bfloat16 is the default and the MXU's)."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 is native on every tpu device (like torch.cuda.is_bf16_supported)."""
    return True


# ------------------------------------------------------------------ legacy typed storages
def _legacy_storage(name: str, dtype: torch.dtype) -> type:
    """torch.tpu.FloatStorage and its siblings, as torch.cuda has them: `tensor.storage_type()`, `isinstance`
    checks of `tensor.storage()` and `torch.tpu.FloatStorage(n)`. PyTorch's TypedStorage finds the device
    from the class's module name, so the classes only name their dtype."""
    return type(name, (torch.storage._LegacyStorage,), {
        "__module__": "torch.tpu",
        "dtype": torch._utils.classproperty(lambda cls: (torch.storage._warn_typed_storage_removal(), dtype)[1]),
        "_dtype": torch._utils.classproperty(lambda cls: dtype),
    })


for _dtype, _name in torch.storage._dtype_to_storage_type_map().items():
    globals()[_name] = _legacy_storage(_name, _dtype)
del _dtype, _name


def _refuse_storage_slices() -> None:
    """`storage[a:b]` of a tpu storage raises instead of returning a storage that reads zeros.

    PyTorch makes a slice a second storage whose data pointer points into the first; on tpu a data
    pointer names a whole device buffer (runtime/storage.py), so that storage would share nothing.
    Byte views of a storage (`torch.empty(0, dtype=torch.uint8, device="tpu").set_(s, a, (b - a,))`)
    do share it. Single bytes (`s[i]`, `s[i] = v`) and slice assignment work as on CPU."""
    getitem = torch.UntypedStorage.__getitem__

    def __getitem__(self, *args, **kwargs):
        if args and isinstance(args[0], slice) and self.device.type == "tpu":
            raise NotImplementedError(
                "Slicing a tpu storage is not supported: the slice would not share the storage's memory. "
                "View its bytes through a tensor instead: "
                "torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (stop - start,))")
        return getitem(self, *args, **kwargs)

    __getitem__.__doc__ = getitem.__doc__
    torch.UntypedStorage.__getitem__ = __getitem__


from torch_tpu import pallas  # noqa: E402  (torch.tpu.pallas: jax_op, get_pallas_mesh; imports no JAX)


# ------------------------------------------------------------------ TorchTPU's names (docs/compat.md)
import sys as _sys  # noqa: E402

from torch_tpu import tpu_api as _tpu_api  # noqa: E402

_tpu_api.install(_sys.modules[__name__])  # the names this module lacks, the two properties, the submodules
