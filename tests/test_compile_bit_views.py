"""Conjugate/negative-bit views in compiled graphs (torch_tpu/compile/plan.py BIT_VIEWS).

AOTAutograd's backward of a complex multiply takes `aten._conj` of the other factor (RoPE in
Llama-style models: `view_as_complex(x) * freqs_cis`); a program's ops read values, so the
conjugation must happen in the graph. Checked against PyTorch CPU.
"""
from __future__ import annotations

import torch

import torch_tpu.compile


def _rope_like(x, freqs, w):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return (torch.view_as_real(xc * freqs).flatten(2) * w).sum()


def test_complex_multiply_backward_conjugates_in_the_graph():
    torch_tpu.compile.register()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    freqs = torch.polar(torch.ones(5, 4), torch.randn(5, 4, generator=g))
    want_x = x.clone().requires_grad_()
    _rope_like(want_x, freqs, w).backward()
    got_x = x.clone().to("tpu").requires_grad_()
    fn = torch.compile(_rope_like, backend="tpu", fullgraph=True)
    before = torch_tpu.compile.stats.eager_graphs
    fn(got_x, freqs.to("tpu"), w.to("tpu")).backward()
    assert torch_tpu.compile.stats.eager_graphs == before
    torch.testing.assert_close(got_x.grad.cpu(), want_x.grad, rtol=1e-5, atol=1e-5)


def test_neg_view_in_a_graph_is_a_negation():
    torch_tpu.compile.register()
    x = torch.randn(4, 3, dtype=torch.complex64)
    fn = torch.compile(lambda t: torch.ops.aten._neg_view(t) * 2, backend="tpu", fullgraph=True)
    torch.testing.assert_close(fn(x.to("tpu")).cpu(), -x * 2)
