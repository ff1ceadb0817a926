"""Batch/layer/group norm saved statistics and out= variants on tpu, compared with PyTorch's CPU kernels.

PyTorch's meta kernels give CUDA's saved statistics (float32 for bfloat16 inputs, (C,) in eval mode);
its CPU kernels save them in the parameters' dtype and save nothing in eval mode. tpu follows the CPU.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torch_tpu.compile
from conftest import to_cpu, to_tpu

aten = torch.ops.aten
BF16, F32 = torch.bfloat16, torch.float32
# (input dtype, parameter dtype): plain float32, plain bfloat16, and CPU's "mixed type" (float32 parameters)
DTYPES = [(F32, F32), (BF16, BF16), (BF16, F32)]


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == F32 else dict(atol=1e-2, rtol=1.6e-2)


def _check(actual, expected, dtype):
    actual, expected = to_cpu(actual), list(expected) if isinstance(expected, tuple) else expected
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a.dtype, a.shape) == (e.dtype, e.shape), f"result {i}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        torch.testing.assert_close(a, e, **_tol(dtype), msg=lambda m: f"result {i}: {m}")


def _bn_args(xd, pd, c=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, c, 5, generator=g).to(xd)
    weight, bias = torch.randn(c, generator=g).to(pd), torch.randn(c, generator=g).to(pd)
    running_mean, running_var = torch.randn(c, generator=g).to(pd), torch.rand(c, generator=g).add(0.5).to(pd)
    return x, weight, bias, running_mean, running_var


@pytest.mark.parametrize("xd,pd", DTYPES)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("op", [aten.native_batch_norm.default, aten._native_batch_norm_legit_functional.default])
def test_batch_norm_saved_stats_like_cpu(op, training, xd, pd):
    """Results, saved mean/invstd (dtype, (0,) in eval mode) and the updated running statistics."""
    x, w, b, rm, rv = _bn_args(xd, pd)
    cpu_stats, tpu_stats = (rm.clone(), rv.clone()), to_tpu((rm, rv))
    expected = op(x, w, b, *cpu_stats, training, 0.1, 1e-5)
    actual = op(*to_tpu((x, w, b)), *tpu_stats, training, 0.1, 1e-5)
    _check(actual, expected, xd)
    _check(tpu_stats, cpu_stats, pd)  # written in place (native_batch_norm, _native_batch_norm_legit)


@pytest.mark.parametrize("xd,pd", DTYPES[1:])
@pytest.mark.parametrize("op,training", [(aten._native_batch_norm_legit_no_training.default, False),
                                         (aten._batch_norm_no_update.default, False),
                                         (aten._batch_norm_with_update.default, True)])
def test_batch_norm_fixed_mode_ops_like_cpu(op, training, xd, pd):
    x, w, b, rm, rv = _bn_args(xd, pd)
    cpu_stats, tpu_stats = (rm.clone(), rv.clone()), to_tpu((rm, rv))
    _check(op(*to_tpu((x, w, b)), *tpu_stats, 0.1, 1e-5), op(x, w, b, *cpu_stats, 0.1, 1e-5), xd)
    _check(tpu_stats, cpu_stats, pd)


@pytest.mark.parametrize("xd,pd", DTYPES)
def test_batch_norm_no_stats_like_cpu(xd, pd):
    x, w, b, _, _ = _bn_args(xd, pd)
    op = aten._native_batch_norm_legit.no_stats
    _check(op(*to_tpu((x, w, b)), True, 0.1, 1e-5), op(x, w, b, True, 0.1, 1e-5), xd)


@pytest.mark.parametrize("xd,pd", DTYPES + [(BF16, None)])
def test_layer_and_group_norm_saved_stats_like_cpu(xd, pd):
    """float32 statistics only with float32 parameters; without parameters, the input's dtype (as CPU)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 6, generator=g).to(xd)
    wl, bl = ((None, None) if pd is None else (torch.randn(6, generator=g).to(pd), torch.randn(6, generator=g).to(pd)))
    wg = None if pd is None else torch.randn(4, generator=g).to(pd)
    ln, gn = aten.native_layer_norm.default, aten.native_group_norm.default
    _check(ln(*to_tpu((x, [6], wl, bl)), 1e-5), ln(x, [6], wl, bl, 1e-5), xd)
    _check(gn(*to_tpu((x, wg, None)), 3, 4, 6, 2, 1e-5), gn(x, wg, None, 3, 4, 6, 2, 1e-5), xd)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("op", [aten.native_batch_norm.out, aten._native_batch_norm_legit.out])
def test_batch_norm_out_variants_like_cpu(op, training):
    """out= forms (they also write the running statistics): results, resized out tensors, running stats."""
    x, w, b, rm, rv = _bn_args(F32, F32)
    cpu_stats, tpu_stats = (rm.clone(), rv.clone()), to_tpu((rm, rv))
    cpu_out = [torch.empty(0) for _ in range(3)]
    tpu_out = [torch.empty(0, device="tpu") for _ in range(3)]
    expected = op(x, w, b, *cpu_stats, training, 0.1, 1e-5, out=cpu_out[0], save_mean=cpu_out[1],
                  save_invstd=cpu_out[2])
    actual = op(*to_tpu((x, w, b)), *tpu_stats, training, 0.1, 1e-5, out=tpu_out[0], save_mean=tpu_out[1],
                save_invstd=tpu_out[2])
    assert all(a is t for a, t in zip(actual, tpu_out))
    _check(tpu_out, cpu_out, F32)
    _check(actual, expected, F32)
    _check(tpu_stats, cpu_stats, F32)


def test_out_variant_writing_inputs_has_no_functional_counterpart():
    """_native_batch_norm_legit.out writes its running stats: no_stats (no such arguments) is not its functional op."""
    from torch_tpu.eager.opspec import functional_counterpart

    assert functional_counterpart(aten._native_batch_norm_legit.out) is None
    assert functional_counterpart(aten._native_batch_norm_legit.no_stats_out) == aten._native_batch_norm_legit.no_stats


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(3)
        self.ln = torch.nn.LayerNorm(5)
        self.gn = torch.nn.GroupNorm(3, 3)

    def forward(self, x):
        return self.gn(self.ln(self.bn(x)))


@pytest.mark.parametrize("xd,pd,compiled", [(BF16, BF16, False), (BF16, F32, False), (BF16, BF16, True)],
                         ids=["bf16", "mixed", "bf16-compiled"])
def test_norm_modules_train_and_eval_like_cpu(xd, pd, compiled):
    """nn.BatchNorm/LayerNorm/GroupNorm: training step (forward, input and parameter grads, running stats),
    then eval forward, on tpu (eager and torch.compile(backend="tpu")) vs CPU."""
    torch_tpu.compile.register()
    torch.manual_seed(0)
    net = _Net().to(pd)
    tpu_net = copy.deepcopy(net).to("tpu")
    run = torch.compile(tpu_net, backend="tpu") if compiled else tpu_net
    x = torch.randn(4, 3, 5).to(xd)
    grad = torch.randn(4, 3, 5).to(xd)
    xt = to_tpu(x).requires_grad_()
    x.requires_grad_()
    net(x).backward(grad)
    run(xt).backward(to_tpu(grad))
    tol = dict(atol=3e-2, rtol=3e-2)  # bfloat16 outputs through three normalisations
    torch.testing.assert_close(xt.grad.cpu(), x.grad, **tol)
    for (name, p), pt in zip(net.named_parameters(), tpu_net.parameters()):
        torch.testing.assert_close(pt.grad.cpu(), p.grad, **tol, msg=lambda m: f"{name}: {m}")
    for (name, b), bt in zip(net.named_buffers(), tpu_net.buffers()):
        torch.testing.assert_close(bt.cpu(), b, **tol, msg=lambda m: f"{name}: {m}")
    net.eval()
    tpu_net.eval()
    with torch.no_grad():
        torch.testing.assert_close(run(to_tpu(x)).cpu(), net(x), **tol)
