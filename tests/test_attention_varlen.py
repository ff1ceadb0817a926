"""Packed variable-length attention on tpu (torch_tpu/ops/attention_varlen.py): torch.nn.attention.varlen's
varlen_attn, forward and backward, against per-sequence scaled_dot_product_attention on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

LENS = [5, 3, 8]
CU = torch.tensor([0, 5, 8, 16], dtype=torch.int32)


def _reference(q, k, v, window):
    """Per-sequence SDPA with the window's mask (left, right; -1 unbounded)."""
    outs = []
    for b in range(len(LENS)):
        s, e = CU[b], CU[b + 1]
        qb, kb, vb = (t[s:e].transpose(0, 1) for t in (q, k, v))
        n = e - s
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = torch.ones(n, n, dtype=torch.bool)
        if window[1] >= 0:
            keep &= j <= i + window[1]
        if window[0] >= 0:
            keep &= j >= i - window[0]
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0)], ids=["full", "causal", "sliding"])
def test_varlen_attn_matches_per_sequence_sdpa(window):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # compared with CPU float32
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(16, 4, 8, generator=g, requires_grad=True) for _ in range(3))
        want = _reference(q, k, v, window)
        grad = torch.randn(want.shape, generator=g)
        want_grads = torch.autograd.grad(want, (q, k, v), grad)
        qt, kt, vt = (t.detach().to("tpu").requires_grad_() for t in (q, k, v))
        cu = CU.to("tpu")
        got = varlen_attn(qt, kt, vt, cu, cu, 8, 8, window_size=window)
        got_grads = torch.autograd.grad(got, (qt, kt, vt), grad.to("tpu"))
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_flash_attention_forward_rejects_what_it_does_not_do():
    q = torch.randn(16, 4, 8, device="tpu")
    cu = CU.to("tpu")
    with pytest.raises(NotImplementedError, match="dropout_p > 0"):
        torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 8, 8, 0.5, False, False)
    with pytest.raises(NotImplementedError, match="dense layout"):
        torch.ops.aten._flash_attention_forward(q[None], q[None], q[None], None, None, 16, 16, 0.0, False, False)
