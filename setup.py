"""Builds the native shim (device guard, hooks, allocator, autocast kernels) against the installed torch."""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

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
