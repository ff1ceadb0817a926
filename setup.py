"""Builds the native shim (device guard, hooks, allocator, autocast kernels) against the installed torch."""
import os

# Building imports torch; torch would autoload the installed (maybe stale) torch_tpu.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths  # noqa: E402

KINETO = torch.autograd.kineto_available()

setup(
    ext_modules=[
        CppExtension(
            "torch_tpu._native",
            ["torch_tpu/csrc/native.cpp", "torch_tpu/csrc/autocast.cpp", "torch_tpu/csrc/profiler.cpp",
             "torch_tpu/csrc/nested.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
            # profiler.cpp's Kineto plugin (torch.profiler device rows) needs a torch built with Kineto.
            define_macros=[("TORCH_TPU_KINETO", None)] if KINETO else [],
            include_dirs=[os.path.join(include_paths()[0], "kineto")] if KINETO else [],
        )
    ],
    # ninja (installed by `make install`) compiles the sources in parallel; without it, one after another.
    cmdclass={"build_ext": BuildExtension},
)
