"""Builds the native shim (device guard, hooks, allocator, autocast kernels) against the installed torch."""
import os

# Building imports torch; torch would autoload the installed (maybe stale) torch_tpu.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

setup(
    ext_modules=[
        CppExtension(
            "torch_tpu._native",
            ["torch_tpu/csrc/native.cpp", "torch_tpu/csrc/autocast.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
