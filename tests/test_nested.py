"""Strided nested tensors (torch.nested) on tpu: PyTorch's NestedTensorCPU kernels on copies.

Compared with the same code on the CPU. nn.TransformerEncoder in eval with a padding mask
is the common way to meet them: PyTorch's fast path turns the batch into a nested tensor on
every device it supports, "tpu" included.
"""
import pytest
import torch

import torch_tpu
from conftest import no_fallback


def _components(d):
    return [torch.arange(6.0).reshape(2, 3).to(d), torch.arange(12.0).reshape(4, 3).to(d) - 5]


def test_transformer_encoder_fast_path_with_padding_mask():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    cpu = torch.nn.TransformerEncoder(layer, 2).eval()
    tpu = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
                                      2).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    x = torch.randn(3, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    before = torch_tpu.metrics.fallbacks["aten._transformer_encoder_layer_fwd.default"]
    with torch.no_grad():
        expected = cpu(x, src_key_padding_mask=mask)
        got = tpu(x.to("tpu"), src_key_padding_mask=mask.to("tpu"))
    assert got.device.type == "tpu" and not got.is_nested
    # the nested fast path was taken (the layers ran on a nested batch), not the padded one
    assert torch_tpu.metrics.fallbacks["aten._transformer_encoder_layer_fwd.default"] == before + 2
    torch.testing.assert_close(got.cpu(), expected)


def test_nested_ops_autograd_and_in_place_match_cpu():
    def run(d):
        a = torch.nested.nested_tensor(_components(d), requires_grad=True)
        w = torch.arange(15.0).reshape(5, 3).div(7).to(d)
        y = torch.nn.functional.linear((a * 2 + 1).relu(), w).softmax(-1)  # linear: a composite PyTorch
        padded = y.to_padded_tensor(0.0)                                  # decomposes except on nested
        padded.square().sum().backward()
        b = torch.nested.nested_tensor(_components(d))
        b.mul_(3)
        return padded, a.grad.to_padded_tensor(0.0), b.to_padded_tensor(-1.0), *b.unbind()

    expected, got = run("cpu"), run("tpu")
    for e, g in zip(expected, got):
        assert g.device.type == "tpu"
        torch.testing.assert_close(g.cpu(), e)


def test_sdpa_of_nested_tensors_takes_the_math_path_like_cpu():
    """SDPA's backend choice on nested inputs (irregular sequence lengths): the math path, as on CPU
    (PyTorch's test_autograd test_accumulate_grad_different_strides; the choice read an irregular size)."""
    def run(d):
        nt = torch.nested.as_nested_tensor([torch.rand(1, 4, 2, dtype=torch.float64, generator=g).to(d),
                                            torch.rand(1, 8, 2, dtype=torch.float64, generator=g).to(d)])
        return torch.nn.functional.scaled_dot_product_attention(nt, nt.clone(), nt.clone()).to_padded_tensor(0.0)

    g = torch.Generator().manual_seed(0)
    expected = run("cpu")
    g.manual_seed(0)
    torch.testing.assert_close(run("tpu").cpu(), expected)


def test_unbind_and_select_give_views_of_the_nested_tensor_like_cpu():
    """nt.unbind() and nt[i] are views of nt's buffer, as ATen's kernels make them: writes reach nt
    (they were CPU copies; PyTorch's test_nestedtensor found it through an in-place silu)."""
    def run(d):
        nt = torch.nested.nested_tensor(_components(d))
        nt.unbind()[0].mul_(5)
        torch.nn.functional.silu(nt[1], inplace=True)
        nt[-1][0].fill_(7.0)
        grad_of = torch.nested.nested_tensor(_components(d), requires_grad=True)
        (sum((c * c).sum() for c in grad_of.unbind()) + (grad_of[1] * 3).sum()).backward()
        with pytest.raises(IndexError, match="index 2 is out of bounds for dimension 0 with size 2"):
            nt[2]
        return *nt.unbind(), *grad_of.grad.unbind(), *nt.transpose(1, 2).unbind()

    for got, want in zip(run("tpu"), run("cpu")):
        assert got.device.type == "tpu"
        torch.testing.assert_close(got.cpu(), want)


def test_nested_tensors_move_between_devices():
    cpu = torch.nested.nested_tensor(_components("cpu"))
    on_tpu = cpu.to("tpu")
    assert on_tpu.is_nested and on_tpu.device.type == "tpu"
    assert torch.equal(on_tpu._nested_tensor_size(), cpu._nested_tensor_size())
    back = on_tpu.cpu()
    assert back.is_nested and back.device.type == "cpu"
    for e, g in zip(cpu.unbind(), back.unbind()):
        assert torch.equal(e, g)


def test_nested_fallback_obeys_fallback_error():
    a = torch.nested.nested_tensor(_components("tpu"))
    with no_fallback(), pytest.raises(NotImplementedError, match="TORCH_TPU_FALLBACK=error"):
        a * 2


def test_nested_fallback_warning_names_nested_tensors(monkeypatch):
    from torch_tpu.config import config
    from torch_tpu.eager import kernels

    monkeypatch.setattr(config, "fallback", "warn")
    monkeypatch.setattr(kernels, "_warned", set())
    a = torch.nested.nested_tensor(_components("tpu"))
    with pytest.warns(UserWarning, match="'aten.mul.Tensor' is not lowered for the 'tpu' device on nested tensors"):
        a * 2
