"""Show the platform, devices and versions backing the "tpu" device."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    import jax
    import torch

    import torch_tpu

    print(f"torch_tpu {torch_tpu.__version__}, torch {torch.__version__}, jax {jax.__version__}")
    count = torch.tpu.device_count()
    props = torch.tpu.get_device_properties(0)
    print(f"platform: {props.platform}, devices: {count}")
    for i in range(count):
        p = torch.tpu.get_device_properties(i)
        print(f"  tpu:{i}  {p.name}  {p.total_memory / 2**30:.1f} GiB")
    return 0
