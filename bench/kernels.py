"""The bundled attention kernel against SDPA's XLA lowering, on the same tpu tensors in one run.

For (batch, heads, kv_heads, seq, head_dim) in bf16, times forward and forward+backward of
`torch_tpu.kernels.flash_attention` (Tokamax: its Pallas kernel where one compiles, else its XLA
implementation) and of `F.scaled_dot_product_attention` with the routing policy "never" (the XLA
lowering in ops/attention.py), interleaved, and prints medians and the ratio kernel / XLA. Only
ratios from one run mean anything on a shared machine. On XLA:CPU both are XLA programs; the
number that matters comes from a TPU or GPU (`python bench/kernels.py --seq 2048`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import torch_tpu  # noqa: F401
from torch_tpu import kernels
from torch_tpu.kernels import routing


def _time(fn, rounds):
    kept = fn()  # results stay alive until the device has made them
    torch.tpu.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        kept = fn()
        torch.tpu.synchronize()
        del kept
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    routing.set_policy("never")  # SDPA keeps the XLA lowering; flash_attention is called directly
    shapes = [(args.batch, h, args.seq, args.dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    q, k, v = (torch.randn(s).to(torch.bfloat16).to("tpu").requires_grad_() for s in shapes)

    def xla(backward):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if backward:
            out.sum().backward()
        return out, q.grad

    def kernel(backward):
        out = kernels.flash_attention(q, k, v, causal=True)
        if backward:
            out.sum().backward()
        return out, q.grad

    print(f"bf16 causal GQA attention {tuple(shapes[0])} / kv {tuple(shapes[1])}, "
          f"platform {torch.tpu.get_device_properties(0).platform}, tokamax: {kernels.have_tokamax()}")
    for backward in (False, True):
        t_xla = _time(lambda: xla(backward), args.rounds)
        t_kernel = _time(lambda: kernel(backward), args.rounds)
        name = "fwd+bwd" if backward else "fwd"
        print(f"{name:8s} XLA lowering {t_xla * 1e3:8.2f} ms   kernel {t_kernel * 1e3:8.2f} ms   "
              f"kernel/XLA {t_kernel / t_xla:5.2f}")


if __name__ == "__main__":
    main()
