"""torch_tpu: a TPU as a native PyTorch device.

`import torch_tpu` (or just `import torch`, through PyTorch's device-backend
autoload) makes "tpu" a PyTorch device: tensors on it are plain torch.Tensors
with real storage, strides and views; ops run eagerly, each as a cached XLA
program, on a TPU if present, else a GPU, else the CPU.

Import is light: it registers the backend with PyTorch and nothing else.
JAX starts on first use of the device.
"""
from __future__ import annotations

import torch

from torch_tpu import _native  # loads the device guard and allocator (C++ static registration)

__version__ = "0.1.0"


def _register_backend() -> None:
    from torch_tpu import autocast, dlpack, profiler, streams
    from torch_tpu import device as device_module
    from torch_tpu.eager import kernels
    from torch_tpu.runtime import platform, storage

    torch.utils.rename_privateuse1_backend("tpu")
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module("tpu", device_module)
    device_module._refuse_storage_slices()  # storage[a:b] of a tpu storage would share no memory
    autocast.set_default_dtype()
    _native.register_hooks()
    _native.set_runtime_callbacks(streams)  # the device guard's synchronize, events, memory info
    profiler.install()  # torch.profiler device rows (Kineto PrivateUse1 profiler)
    dlpack.install()  # torch.from_dlpack / to_dlpack of tpu tensors (kDLExtDev capsules)
    _native.set_init_callback(platform.count_for_torch)
    device_module._start_on_own_device()  # torchrun's LOCAL_RANK: tpu:{LOCAL_RANK} is this process's device
    if hasattr(_native, "set_resize_callback"):  # a shim built before storage resize_ support lacks it
        _native.set_resize_callback(storage.resized)
        _native.set_copy_callback(storage.copied)  # copy-on-write storages (Tensor._lazy_clone)
    kernels.register_fallback()
    platform.on_init(kernels.register_all)
    platform.on_init(device_module._apply_pending_seed)
    platform.on_init(_route_kernels)
    from torch_tpu.compile import routing as compile_routing  # torch.compile's default backend: tpu graphs to "tpu"

    compile_routing.install()
    from torch_tpu import flex_attention  # PyTorch's FlexAttention device list: "tpu" too

    flex_attention.install()


def _route_kernels() -> None:
    from torch_tpu.kernels import routing  # SDPA -> bundled kernels where they compile natively (docs/kernels.md)

    routing.install()


if torch._C._get_privateuse1_backend_name() != "tpu":
    _register_backend()

from torch_tpu import distributed, metrics, numerics, precision  # noqa: E402
from torch_tpu.modes import (  # noqa: E402
    defer_and_fuse, execution_mode, get_execution_mode, set_defer_options, set_execution_mode,
)
from torch_tpu.precision import TpuPerformanceWarning  # noqa: E402
from torch_tpu.runtime.platform import set_num_cpu_devices  # noqa: E402
from torch_tpu import metrics_file as _metrics_file  # noqa: E402
from torch_tpu.config import config as _config  # noqa: E402

_metrics_file.register(_config.metrics_file)  # TORCH_TPU_METRICS_FILE: metrics as JSON at exit


__all__ = [
    "distributed", "metrics", "numerics", "precision", "set_num_cpu_devices", "TpuPerformanceWarning", "__version__",
    "set_execution_mode", "get_execution_mode", "execution_mode", "defer_and_fuse", "set_defer_options",
]
