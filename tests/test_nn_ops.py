"""Neural-network ops on tpu match PyTorch CPU, forward and backward, with no CPU fallback."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_close_tree, assert_matches_cpu

from torch_tpu import metrics


# Non-nn ops these tests reach that run as a torch._decomp decomposition (native, but not one program).
DECOMPOSED_ELSEWHERE = {
    "aten.norm.out",  # torch.norm (pairwise_distance): a reduction, ops/reduction.py
}


@pytest.fixture(autouse=True)
def _no_fallback():
    """Every op in these tests is native: no CPU fallback, and no nn op takes a torch._decomp detour."""
    fallbacks, decomposed = dict(metrics.fallbacks), dict(metrics.decomposed)
    yield
    assert dict(metrics.fallbacks) == fallbacks, f"CPU fallbacks: {set(metrics.fallbacks) - set(fallbacks)}"
    new = {op for op, n in metrics.decomposed.items() if n != decomposed.get(op)} - DECOMPOSED_ELSEWHERE
    assert not new, f"decomposed: {new}"


def randn(*shape, grad=True, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def uniform(*shape, low=0.05, high=0.95, grad=True):
    return (torch.rand(*shape) * (high - low) + low).requires_grad_(grad)


def labels(high, *shape):
    return torch.randint(0, high, shape)


def signs(*shape):
    return torch.randint(0, 2, shape).float() * 2 - 1


def case(name, fn, *args, atol=1e-5, rtol=1e-5, grads=True, marks=()):
    return pytest.param(fn, args, atol, rtol, grads, id=name, marks=marks)



def run_cases(fn, args, atol, rtol, grads):
    torch.manual_seed(0)
    assert_matches_cpu(fn, *args, grads=grads, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- convolution
CONV = [
    case("conv1d", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1), randn(2, 4, 9), randn(6, 4, 3), randn(6)),
    case("conv1d-groups", lambda x, w: F.conv1d(x, w, groups=2, dilation=2), randn(2, 4, 11), randn(6, 2, 3)),
    case("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), randn(2, 3, 8, 8), randn(4, 3, 3, 3), randn(4)),
    case("conv2d-strided-dilated-grouped", lambda x, w, b: F.conv2d(x, w, b, (2, 1), (1, 0), (2, 1), 2),
         randn(2, 4, 9, 7), randn(6, 2, 3, 2), randn(6)),
    case("conv2d-depthwise", lambda x, w: F.conv2d(x, w, padding=2, groups=4), randn(2, 4, 7, 7), randn(8, 1, 5, 5)),
    case("conv2d-same", lambda x, w: F.conv2d(x, w, padding="same"), randn(2, 3, 8, 7), randn(4, 3, 4, 3)),
    case("conv2d-unbatched", lambda x, w: F.conv2d(x, w), randn(3, 6, 6), randn(2, 3, 3, 3)),
    case("conv3d", lambda x, w, b: F.conv3d(x, w, b, stride=2, padding=(1, 0, 1)), randn(1, 2, 5, 6, 5),
         randn(3, 2, 2, 3, 2), randn(3)),
    case("conv_transpose1d", lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1, output_padding=1),
         randn(2, 4, 5), randn(4, 3, 3), randn(3)),
    case("conv_transpose2d-grouped", lambda x, w, b: F.conv_transpose2d(x, w, b, 2, 1, 1, groups=2),
         randn(2, 4, 5, 6), randn(4, 3, 3, 3), randn(6)),
    case("conv_transpose2d-dilated",
         lambda x, w: F.conv_transpose2d(x, w, stride=(2, 3), padding=(0, 1), dilation=(2, 1)),
         randn(2, 4, 5, 6), randn(4, 3, 3, 2)),
    case("conv_transpose3d", lambda x, w: F.conv_transpose3d(x, w, stride=2), randn(1, 2, 3, 4, 3),
         randn(2, 2, 2, 2, 2)),
    case("conv2d-float64", lambda x, w: F.conv2d(x, w, padding=1), randn(2, 3, 6, 6, dtype=torch.float64),
         randn(4, 3, 3, 3, dtype=torch.float64), atol=1e-10, rtol=1e-10),
    case("conv2d-bfloat16", lambda x, w: F.conv2d(x, w, padding=1), randn(2, 3, 6, 6, dtype=torch.bfloat16),
         randn(4, 3, 3, 3, dtype=torch.bfloat16), atol=3e-2, rtol=3e-2),
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", CONV)
def test_convolution(fn, args, atol, rtol, grads):
    """Convolutions (1d/2d/3d, grouped, dilated, transposed) and their gradients."""
    run_cases(fn, args, 1e-4 if atol == 1e-5 else atol, 1e-4 if rtol == 1e-5 else rtol, grads)


def test_convolution_weight_only_gradient():
    """A frozen input asks convolution_backward for the weight and bias gradients only."""
    x = torch.randn(2, 3, 6, 6)
    assert_matches_cpu(lambda x, w, b: F.conv2d(x, w, b), x, randn(4, 3, 3, 3), randn(4), grads=True, atol=1e-4,
                       rtol=1e-4)


# ---------------------------------------------------------------- pooling
POOL = [
    case("max_pool1d", lambda x: F.max_pool1d(x, 3, 2, 1), randn(2, 3, 10)),
    case("max_pool2d", lambda x: F.max_pool2d(x, 2), randn(2, 3, 8, 8)),
    case("max_pool2d-ceil-dilated", lambda x: F.max_pool2d(x, (3, 2), (2, 1), (1, 1), (1, 2), ceil_mode=True),
         randn(2, 3, 9, 8)),
    case("max_pool2d-indices", lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), randn(2, 3, 9, 9)),
    case("max_pool2d-unbatched", lambda x: F.max_pool2d(x, 2, ceil_mode=True), randn(3, 7, 7)),
    case("max_pool3d-indices", lambda x: F.max_pool3d(x, 2, 2, 1, return_indices=True), randn(1, 2, 5, 6, 5)),
    case("avg_pool1d", lambda x: F.avg_pool1d(x, 3, 2, 1), randn(2, 3, 10)),
    case("avg_pool2d", lambda x: F.avg_pool2d(x, 3, 2, 1), randn(2, 3, 9, 9)),
    case("avg_pool2d-ceil-exclude-pad", lambda x: F.avg_pool2d(x, 3, 2, 1, True, False), randn(2, 3, 8, 8)),
    case("avg_pool2d-ceil-include-pad", lambda x: F.avg_pool2d(x, 3, 2, 1, True, True), randn(2, 3, 8, 8)),
    case("avg_pool2d-divisor", lambda x: F.avg_pool2d(x, 2, divisor_override=3), randn(2, 3, 8, 8)),
    case("avg_pool3d", lambda x: F.avg_pool3d(x, 2, 1, 1, count_include_pad=False), randn(1, 2, 4, 5, 4)),
    case("adaptive_avg_pool1d", lambda x: F.adaptive_avg_pool1d(x, 4), randn(2, 3, 10)),
    case("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (3, 5)), randn(2, 3, 8, 7)),
    case("adaptive_avg_pool2d-global", lambda x: F.adaptive_avg_pool2d(x, 1), randn(2, 3, 8, 7)),
    case("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), randn(1, 2, 5, 6, 5)),
    case("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 4, True), randn(2, 3, 10)),
    case("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, (3, 5), True), randn(2, 3, 8, 7)),
    case("adaptive_max_pool3d", lambda x: F.adaptive_max_pool3d(x, (2, 3, 2), True), randn(1, 2, 5, 6, 5)),
    case("max_unpool2d", lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2), randn(2, 3, 8, 8)),
    case("max_unpool3d", lambda x: F.max_unpool3d(*F.max_pool3d(x, 2, return_indices=True), 2), randn(1, 2, 4, 4, 4)),
    case("lp_pool2d", lambda x: F.lp_pool2d(x, 2, 2), randn(2, 3, 8, 8)),
    case("fractional_max_pool2d", lambda x, s: F.fractional_max_pool2d(x, 2, output_size=(4, 3), return_indices=True,
                                                                       _random_samples=s),
         randn(2, 3, 9, 7), torch.rand(2, 3, 2)),
    case("fractional_max_pool2d-unbatched", lambda x, s: F.fractional_max_pool2d(x, (2, 3), output_ratio=(0.5, 0.5),
                                                                                 _random_samples=s),
         randn(3, 8, 9), torch.rand(1, 3, 2)),
    case("fractional_max_pool3d", lambda x, s: F.fractional_max_pool3d(x, (2, 3, 2), output_size=(4, 5, 3),
                                                                       return_indices=True, _random_samples=s),
         randn(2, 3, 9, 8, 7), torch.rand(2, 3, 3)),
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", POOL)
def test_pooling(fn, args, atol, rtol, grads):
    """Max/average/adaptive pooling, indices and unpooling, and their gradients."""
    run_cases(fn, args, atol, rtol, grads)


# ---------------------------------------------------------------- normalization
def _train_step(module, x):
    y = module(x)
    (y * y).sum().backward()
    return y, x.grad, [p.grad for p in module.parameters()], list(module.buffers())


NORM_MODULES = [
    pytest.param(lambda: nn.BatchNorm1d(3), (4, 3, 5), id="batch_norm1d"),
    pytest.param(lambda: nn.BatchNorm2d(3), (4, 3, 4, 4), id="batch_norm2d"),
    pytest.param(lambda: nn.BatchNorm3d(3), (2, 3, 3, 4, 5), id="batch_norm3d"),
    pytest.param(lambda: nn.BatchNorm2d(3, affine=False), (4, 3, 4, 4), id="batch_norm2d-no-affine"),
    pytest.param(lambda: nn.BatchNorm2d(3, track_running_stats=False), (4, 3, 4, 4), id="batch_norm2d-no-stats"),
    pytest.param(lambda: nn.BatchNorm2d(3, momentum=0.3), (4, 3, 4, 4), id="batch_norm2d-momentum"),
    pytest.param(lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (2, 3, 4, 4), id="instance_norm"),
    pytest.param(lambda: nn.InstanceNorm1d(3), (2, 3, 6), id="instance_norm1d"),
    pytest.param(lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3), id="group_norm"),
    pytest.param(lambda: nn.GroupNorm(3, 6, affine=False), (2, 6, 5), id="group_norm-no-affine"),
    pytest.param(lambda: nn.LayerNorm([4, 4]), (2, 3, 4, 4), id="layer_norm"),
    pytest.param(lambda: nn.RMSNorm(8), (2, 3, 8), id="rms_norm"),
    pytest.param(lambda: nn.LocalResponseNorm(3), (2, 5, 4, 4), id="local_response_norm"),
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("make,shape", NORM_MODULES)
def test_normalization_module(make, shape, train):
    """Norm layers: output, input/parameter gradients and running statistics (updated in place) match CPU."""
    torch.manual_seed(0)
    cpu = make().train(train)
    for p in cpu.parameters():
        p.data.uniform_(0.5, 1.5)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(*shape)
    for _ in range(2):  # two steps: the second uses the running stats the first wrote
        expected = _train_step(cpu, x.clone().requires_grad_())
        actual = _train_step(tpu, x.to("tpu").requires_grad_())
        assert_close_tree(actual, expected, atol=1e-4, rtol=1e-4)
        cpu.zero_grad()
        tpu.zero_grad()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("make,shape", [p for p in NORM_MODULES if list(p.values[0]().parameters())])
def test_normalization_module_of_an_input_without_grad(make, shape, train):
    """A model's first layer: its input needs no gradient, its parameters do, so autograd asks the backward
    kernels for the parameters' gradients only (output_mask). Parameter gradients and running statistics
    match CPU (batch norm's backward used to fail: its meta allocated the input's gradient)."""
    torch.manual_seed(0)
    cpu = make().train(train)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(*shape)
    expected = _train_step(cpu, x)
    actual = _train_step(tpu, x.to("tpu"))
    assert actual[1] is None and expected[1] is None
    assert_close_tree(actual, expected, atol=1e-4, rtol=1e-4)


def test_batch_norm_updates_running_stats_in_one_program():
    """The running-stat update is part of the batch-norm program: no extra copies are launched for it."""
    bn = nn.BatchNorm2d(3).to("tpu")
    x = torch.randn(4, 3, 2, 2, device="tpu")
    before = bn.running_mean.clone()
    torch.tpu.synchronize()  # DeferAndFuse counts an op as executed when its graph runs
    executed = metrics.counts.ops_executed
    torch.ops.aten.native_batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5)
    torch.tpu.synchronize()
    assert metrics.counts.ops_executed == executed + 1
    expected = 0.9 * before.cpu() + 0.1 * x.cpu().mean(dim=(0, 2, 3))
    torch.testing.assert_close(bn.running_mean.cpu(), expected)


def test_batch_norm_cumulative_momentum_does_not_recompile():
    """BatchNorm(momentum=None) passes 1/num_batches_tracked, a new float each step: a runtime scalar,
    so steps after the first compile nothing, and the running statistics still match CPU."""
    torch.manual_seed(0)
    cpu = nn.BatchNorm2d(3, momentum=None)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(4, 3, 2, 2)
    for step in range(5):
        if step == 2:  # warm: DeferAndFuse's second step can still fuse differently (donations)
            compiled = metrics.counts.programs_compiled
        cpu(x * (step + 1))
        tpu(x.to("tpu") * (step + 1))
        torch.tpu.synchronize()
    assert metrics.counts.programs_compiled == compiled
    torch.testing.assert_close(tpu.running_mean.cpu(), cpu.running_mean)
    torch.testing.assert_close(tpu.running_var.cpu(), cpu.running_var)


NORM_FUNCTIONS = [
    case("batch_norm-functional-eval", lambda x, w, b: F.batch_norm(x, torch.zeros(3, device=x.device),
                                                                     torch.ones(3, device=x.device), w, b),
         randn(4, 3, 5), randn(3), randn(3)),
    case("group_norm-functional", lambda x, w, b: F.group_norm(x, 2, w, b), randn(2, 4, 3, 3), randn(4), randn(4)),
    case("layer_norm-no-affine", lambda x: F.layer_norm(x, (5,)), randn(3, 5)),
    case("rms_norm-functional", lambda x, w: F.rms_norm(x, (2, 4), w, eps=1e-3), randn(3, 2, 4), randn(2, 4)),
    case("normalize", lambda x: F.normalize(x, dim=1), randn(4, 5)),
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", NORM_FUNCTIONS)
def test_normalization_functional(fn, args, atol, rtol, grads):
    """Functional normalization calls and their gradients."""
    run_cases(fn, args, 1e-4, 1e-4, grads)


# ---------------------------------------------------------------- interpolation and padding
INTERPOLATE = [
    case(f"{mode}-{shape_id}-{kw_id}", lambda x, mode=mode, kw=kw: F.interpolate(x, mode=mode, **kw), randn(*shape))
    for mode, shape_id, shape in [
        ("nearest", "1d", (2, 3, 5)), ("nearest", "2d", (2, 3, 5, 4)), ("nearest", "3d", (1, 2, 3, 4, 3)),
        ("nearest-exact", "2d", (2, 3, 5, 4)), ("linear", "1d", (2, 3, 5)), ("bilinear", "2d", (2, 3, 5, 4)),
        ("trilinear", "3d", (1, 2, 3, 4, 3)), ("bicubic", "2d", (2, 3, 5, 4)), ("area", "2d", (2, 3, 8, 6)),
    ]
    for kw_id, kw in [
        ("x2", dict(scale_factor=2)), ("size7", dict(size=(7,) * (len(shape) - 2))), ("x0.6", dict(scale_factor=0.6)),
        ("x1.7-scale", dict(scale_factor=1.7, recompute_scale_factor=False)),
        *([("align", dict(scale_factor=1.5, align_corners=True))] if "linear" in mode or mode == "bicubic" else []),
    ]
] + [
    case(f"antialias-{mode}-{kw_id}", lambda x, mode=mode, kw=kw: F.interpolate(x, mode=mode, antialias=True, **kw),
         randn(2, 3, 10, 7))
    for mode in ("bilinear", "bicubic")
    for kw_id, kw in [("x0.4", dict(scale_factor=0.4)), ("size", dict(size=(9, 3))),
                      ("x2-align", dict(scale_factor=2, align_corners=True))]
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", INTERPOLATE)
def test_interpolate(fn, args, atol, rtol, grads):
    """F.interpolate in every mode (scale factors, sizes, align_corners, antialias) and its gradient."""
    run_cases(fn, args, atol, rtol, grads)


PAD = [
    case(f"{mode}-{shape_id}", lambda x, mode=mode, pad=pad: F.pad(x, pad, mode=mode), randn(*shape))
    for mode in ("constant", "reflect", "replicate", "circular")
    for shape_id, shape, pad in [
        ("1d", (2, 3, 6), (2, 1)), ("1d-unbatched", (3, 6), (1, 3)), ("2d", (2, 3, 5, 6), (1, 2, 3, 0)),
        ("2d-crop", (2, 3, 5, 6), (-1, 2, 1, -2)), ("3d", (1, 2, 4, 5, 6), (1, 1, 2, 0, 1, 3)),
    ]
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", PAD)
def test_pad(fn, args, atol, rtol, grads):
    """F.pad in every mode, with negative (cropping) pads, and its gradient."""
    run_cases(fn, args, atol, rtol, grads)


# ---------------------------------------------------------------- activations
ACTIVATIONS = [
    case(name, fn, randn(3, 7) * 3)
    for name, fn in [
        ("relu", F.relu), ("relu6", F.relu6), ("elu", lambda x: F.elu(x, 0.7)), ("selu", F.selu),
        ("celu", lambda x: F.celu(x, 1.3)), ("gelu", F.gelu), ("gelu-tanh", lambda x: F.gelu(x, approximate="tanh")),
        ("silu", F.silu), ("mish", F.mish), ("softplus", lambda x: F.softplus(x, 2, 3)), ("hardsigmoid", F.hardsigmoid),
        ("hardswish", F.hardswish), ("hardtanh", lambda x: F.hardtanh(x, -2, 1.5)),
        ("leaky_relu", lambda x: F.leaky_relu(x, 0.2)), ("logsigmoid", F.logsigmoid),
        ("softshrink", lambda x: F.softshrink(x, 0.7)), ("hardshrink", lambda x: F.hardshrink(x, 0.7)),
        ("tanhshrink", F.tanhshrink), ("softsign", F.softsign), ("threshold", lambda x: F.threshold(x, 0.5, -1.0)),
        ("sigmoid", torch.sigmoid), ("tanh", torch.tanh), ("softmax", lambda x: F.softmax(x, 1)),
        ("log_softmax", lambda x: F.log_softmax(x, 0)), ("softmin", lambda x: F.softmin(x, 1)),
        ("glu", lambda x: F.glu(x.reshape(3, 7)[:, :6], 1)), ("rrelu-eval", lambda x: F.rrelu(x, 0.1, 0.3)),
    ]
] + [
    case("prelu", lambda x, w: F.prelu(x, w), randn(2, 3, 4), randn(3)),
    case("logit", lambda x: torch.logit(x, 1e-3), uniform(4, 5)),
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", ACTIVATIONS)
def test_activation(fn, args, atol, rtol, grads):
    """Activation functions and their gradients."""
    run_cases(fn, args, atol, rtol, grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_is_pytorchs_erf_formula(dtype):
    """GELU is x/2 * (1 + erf(x/sqrt(2))) as PyTorch computes it (in float32 for bfloat16): equal to
    CPU within float rounding everywhere, and 0 where PyTorch's formula rounds to 0 (x < ~-5.6),
    where the erfc form (jax.nn.gelu) would give tiny negatives instead."""
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([-30.0, 30.0, 0.0])]).to(dtype)
    actual, expected = F.gelu(x.to("tpu")).cpu(), F.gelu(x)
    torch.testing.assert_close(actual, expected, atol=2e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    tail = x < -6
    assert (actual[tail] == 0).all() and (expected[tail] == 0).all()


def test_rrelu_training_uses_the_noise_it_samples():
    """Training rrelu: negative slopes lie in [lower, upper] and the gradient is the sampled slope."""
    x = torch.randn(64, device="tpu").abs().neg().requires_grad_()
    y = F.rrelu(x, 0.1, 0.3, training=True)
    y.sum().backward()
    slope = (y / x).detach().cpu()
    assert bool(((slope >= 0.1) & (slope <= 0.3)).all())
    torch.testing.assert_close(x.grad.cpu(), slope)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_rrelu_in_place(training):
    """F.rrelu(inplace=True) (rrelu_with_noise_) writes its result into the input."""
    x = torch.linspace(-2, 2, 9)
    y = x.to("tpu")
    out = F.rrelu(y, 0.1, 0.3, training=training, inplace=True)
    assert out is y
    if training:
        slope = y.cpu()[x < 0] / x[x < 0]
        assert bool(((slope >= 0.1) & (slope <= 0.3)).all())
        torch.testing.assert_close(y.cpu()[x >= 0], x[x >= 0])
    else:
        torch.testing.assert_close(y.cpu(), F.rrelu(x.clone(), 0.1, 0.3, inplace=True))


# ---------------------------------------------------------------- losses
def _ctc_inputs(concatenated):
    log_probs = torch.randn(12, 3, 6).log_softmax(2).detach().requires_grad_()
    target_lengths = torch.tensor([4, 2, 3])
    if concatenated:
        targets = torch.randint(1, 6, (int(target_lengths.sum()),))
    else:
        targets = torch.randint(1, 6, (3, 5))
    return log_probs, targets, torch.tensor([12, 9, 10]), target_lengths


LOSSES = [
    case("l1", F.l1_loss, randn(4, 5), randn(4, 5, grad=False)),
    case("mse", F.mse_loss, randn(4, 5), randn(4, 5)),
    case("mse-none", lambda x, t: F.mse_loss(x, t, reduction="none"), randn(4, 5), randn(4, 5)),
    case("smooth_l1", lambda x, t: F.smooth_l1_loss(x, t, beta=0.5), randn(4, 5), randn(4, 5)),
    case("huber", lambda x, t: F.huber_loss(x, t, reduction="sum", delta=0.7), randn(4, 5), randn(4, 5)),
    case("cross_entropy", F.cross_entropy, randn(6, 5), labels(5, 6)),
    case("cross_entropy-weight-ignore", lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=2), randn(6, 5),
         labels(5, 6), uniform(5, grad=False)),
    case("cross_entropy-smoothing", lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), randn(6, 5), labels(5, 6)),
    case("cross_entropy-probs", lambda x, t: F.cross_entropy(x, t.softmax(1)), randn(6, 5), randn(6, 5, grad=False)),
    case("cross_entropy-2d", F.cross_entropy, randn(2, 5, 3, 4), labels(5, 2, 3, 4)),
    case("cross_entropy-3d-none", lambda x, t: F.cross_entropy(x, t, reduction="none"), randn(2, 5, 3),
         labels(5, 2, 3)),
    case("nll", F.nll_loss, randn(6, 5), labels(5, 6)),
    case("nll-unbatched-sum", lambda x, t: F.nll_loss(x, t, reduction="sum"), randn(5), labels(5)),
    case("binary_cross_entropy", F.binary_cross_entropy, uniform(4, 5), uniform(4, 5, grad=False)),
    case("binary_cross_entropy-weight", lambda x, t, w: F.binary_cross_entropy(x, t, w, reduction="sum"),
         uniform(4, 5), uniform(4, 5, grad=False), uniform(5, grad=False)),
    case("bce_with_logits", F.binary_cross_entropy_with_logits, randn(4, 5), uniform(4, 5)),
    case("bce_with_logits-pos_weight", lambda x, t, p: F.binary_cross_entropy_with_logits(x, t, pos_weight=p),
         randn(4, 5), uniform(4, 5, grad=False), uniform(5, grad=False)),
    case("kl_div", lambda x, t: F.kl_div(x, t, reduction="batchmean"), randn(4, 5), uniform(4, 5)),
    case("kl_div-log_target", lambda x, t: F.kl_div(x, t, log_target=True), randn(4, 5), randn(4, 5)),
    case("poisson_nll", F.poisson_nll_loss, randn(4, 5), uniform(4, 5, grad=False)),
    case("poisson_nll-full", lambda x, t: F.poisson_nll_loss(x, t * 5, log_input=False, full=True), uniform(4, 5),
         uniform(4, 5, grad=False)),
    case("gaussian_nll", F.gaussian_nll_loss, randn(4, 5), randn(4, 5), uniform(4, 5)),
    case("hinge_embedding", F.hinge_embedding_loss, randn(4, 5), signs(4, 5)),
    case("margin_ranking", lambda a, b, y: F.margin_ranking_loss(a, b, y, margin=0.2), randn(6), randn(6), signs(6)),
    case("cosine_embedding", F.cosine_embedding_loss, randn(4, 5), randn(4, 5), signs(4)),
    case("triplet_margin", F.triplet_margin_loss, randn(4, 5), randn(4, 5), randn(4, 5)),
    case("triplet_margin_with_distance", F.triplet_margin_with_distance_loss, randn(4, 5), randn(4, 5), randn(4, 5)),
    case("soft_margin", F.soft_margin_loss, randn(4, 5), signs(4, 5)),
    case("multilabel_soft_margin", F.multilabel_soft_margin_loss, randn(4, 5), torch.randint(0, 2, (4, 5)).float()),
    case("multi_margin", F.multi_margin_loss, randn(6, 5), labels(5, 6)),
    case("multi_margin-p2-weight", lambda x, t, w: F.multi_margin_loss(x, t, p=2, margin=0.5, weight=w,
                                                                     reduction="none"),
         randn(6, 5), labels(5, 6), uniform(5, grad=False)),
    case("multilabel_margin", F.multilabel_margin_loss, randn(3, 5),
         torch.tensor([[3, 0, -1, 1, 2], [1, 2, 3, 4, 0], [4, -1, 2, 2, 2]])),
    case("ctc-padded", lambda lp, t, il, tl: F.ctc_loss(lp, t, il, tl), *_ctc_inputs(False), atol=1e-4, rtol=1e-4),
    case("ctc-concatenated-sum", lambda lp, t, il, tl: F.ctc_loss(lp, t, il, tl, reduction="sum", zero_infinity=True),
         *_ctc_inputs(True), atol=1e-4, rtol=1e-4),
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", LOSSES)
def test_loss(fn, args, atol, rtol, grads):
    """Every torch.nn.functional loss and its gradient."""
    run_cases(fn, args, atol, rtol, grads)


# ---------------------------------------------------------------- embedding and rearrangements
MISC = [
    case("embedding", lambda w, i: F.embedding(i, w), randn(10, 4), labels(10, 3, 5)),
    case("embedding-padding", lambda w, i: F.embedding(i, w, padding_idx=2), randn(10, 4), labels(10, 3, 5)),
    case("embedding-scale_grad", lambda w, i: F.embedding(i, w, scale_grad_by_freq=True), randn(10, 4), labels(10, 12)),
    case("embedding-max_norm", lambda w, i: F.embedding(i, w.detach().clone(), max_norm=1.0), randn(10, 4, grad=False),
         labels(10, 6), grads=False),
    case("one_hot", lambda i: F.one_hot(i, 7), labels(7, 3, 4), grads=False),
    case("one_hot-inferred", lambda i: F.one_hot(i), labels(7, 3, 4), grads=False),
    case("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), randn(2, 8, 3, 3)),
    case("pixel_unshuffle", lambda x: F.pixel_unshuffle(x, 2), randn(2, 2, 4, 6)),
    case("channel_shuffle", lambda x: F.channel_shuffle(x, 3), randn(2, 6, 3, 3)),
    case("unfold", lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)), randn(2, 3, 6, 7)),
    case("fold", lambda x: F.fold(x, (5, 6), (2, 3), padding=(1, 0)), randn(2, 12, 24)),
    case("cosine_similarity", lambda a, b: F.cosine_similarity(a, b, dim=1), randn(4, 5), randn(4, 5)),
    case("pairwise_distance", F.pairwise_distance, randn(4, 5), randn(4, 5)),
    case("linear", F.linear, randn(4, 5), randn(3, 5), randn(3)),
    case("bilinear", F.bilinear, randn(4, 5), randn(4, 6), randn(3, 5, 6), randn(3)),
    case("dropout-eval", lambda x: F.dropout(x, 0.5, training=False), randn(4, 5)),
    *[case(f"pdist-p{p}", lambda x, p=p: F.pdist(x, p), randn(5, 4)) for p in (2, 1, 3, 0.5, 0, float("inf"))],
    *[case(f"grid_sample-{mode}-{padding}-{'align' if align else 'noalign'}",
           lambda x, g, mode=mode, padding=padding, align=align: F.grid_sample(x, g, mode, padding, align),
           randn(2, 3, 5, 6), (torch.rand(2, 4, 3, 2) * 2.4 - 1.2).requires_grad_(), atol=1e-4, rtol=1e-4)
      for mode in ("bilinear", "nearest", "bicubic") for padding in ("zeros", "border", "reflection")
      for align in (False, True)],
    case("grid_sample-3d", lambda x, g: F.grid_sample(x, g, align_corners=False), randn(1, 2, 4, 5, 3),
         (torch.rand(1, 2, 3, 4, 3) * 2.4 - 1.2).requires_grad_(), atol=1e-4, rtol=1e-4),
    case("affine_grid-grid_sample",
         lambda x, t: F.grid_sample(x, F.affine_grid(t, (2, 3, 4, 5), False), align_corners=False),
         randn(2, 3, 5, 6), randn(2, 2, 3), atol=1e-4, rtol=1e-4),
]
EMBEDDING_BAG = [
    case(f"embedding_bag-{mode}{suffix}", lambda w, i, o, mode=mode, kw=kw: F.embedding_bag(i, w, o, mode=mode, **kw),
         randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5]))
    for mode in ("sum", "mean", "max")
    for suffix, kw in [("", {}), ("-padding", dict(padding_idx=4))]
] + [
    case("embedding_bag-per_sample_weights",
         lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
         randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5]), randn(8)),
    case("embedding_bag-last_offset", lambda w, i, o: F.embedding_bag(i, w, o, mode="mean", include_last_offset=True),
         randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5, 8])),
    case("embedding_bag-max-last_offset",
         lambda w, i, o: F.embedding_bag(i, w, o, mode="max", include_last_offset=True),
         randn(10, 3), torch.tensor([3, 1, 1, 1, 4, 0]), torch.tensor([0, 0, 3, 3, 6, 6])),
    case("embedding_bag-empty-input", lambda w, i, o: F.embedding_bag(i, w, o, mode="sum"),
         randn(10, 3), torch.tensor([], dtype=torch.int64), torch.tensor([0, 0])),
    case("embedding_bag-2d-input", lambda w, i: F.embedding_bag(i, w, mode="max"), randn(10, 3), labels(10, 4, 3)),
    case("embedding_bag-module", lambda w, i: nn.EmbeddingBag.from_pretrained(w, freeze=False)(i), randn(10, 3),
         labels(10, 4, 3)),
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", MISC + EMBEDDING_BAG)
def test_misc(fn, args, atol, rtol, grads):
    """Embeddings, embedding bags, one_hot, pixel/channel shuffle, fold/unfold, distances, linear layers."""
    run_cases(fn, args, atol, rtol, grads)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_scale_grad_by_freq(mode):
    """scale_grad_by_freq divides each row's gradient by its index's frequency.

    The reference is F.embedding(scale_grad_by_freq=True) reduced per bag on CPU: PyTorch 2.13's CPU
    embedding_bag backward divides by the wrong count for mixed frequencies (pytorch/pytorch#190063).
    """
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5])
    bags = [(0, 2), (2, 2), (2, 5), (5, 8)]

    def reference(w):
        rows = F.embedding(indices, w, scale_grad_by_freq=True)
        reduce = torch.sum if mode == "sum" else torch.mean
        return torch.stack([reduce(rows[a:b], 0) if b > a else torch.zeros(3) for a, b in bags])

    w = torch.randn(10, 3)
    w_cpu, w_tpu = w.clone().requires_grad_(), w.to("tpu").requires_grad_()
    expected = reference(w_cpu)
    actual = F.embedding_bag(indices.to("tpu"), w_tpu, offsets.to("tpu"), mode=mode, scale_grad_by_freq=True)
    torch.testing.assert_close(actual.cpu(), expected)
    g = torch.randn(4, 3)
    expected.backward(g)
    actual.backward(g.to("tpu"))
    torch.testing.assert_close(w_tpu.grad.cpu(), w_cpu.grad)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_sparse_gradient_matches_cpu(mode):
    """EmbeddingBag(sparse=True) gives a sparse COO gradient on tpu, as ATen's composite sparse backward does
    on CPU (per-sample weights, padding_idx), and an SGD step applies it."""
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5])
    weights = torch.randn(8) if mode == "sum" else None
    results = []
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        bag = nn.EmbeddingBag(10, 3, mode=mode, sparse=True, padding_idx=4).to(device)
        opt = torch.optim.SGD(bag.parameters(), lr=0.5)
        out = bag(indices.to(device), offsets.to(device),
                  per_sample_weights=None if weights is None else weights.to(device))
        (out * torch.arange(12.0).view(4, 3).to(device)).sum().backward()
        grad = bag.weight.grad
        assert grad.layout == torch.sparse_coo and grad.device.type == device
        dense = grad.to_dense().cpu()
        opt.step()
        results.append((out.detach().cpu(), dense, bag.weight.detach().cpu()))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected)


def test_embedding_max_norm_renormalizes_weight_in_place():
    """F.embedding(max_norm=...) rescales the looked-up rows of the weight in place, as on CPU."""
    w = torch.randn(10, 4) * 3
    i = torch.tensor([1, 3, 3, 7])
    w_tpu = w.to("tpu")
    F.embedding(i.to("tpu"), w_tpu, max_norm=1.0)
    F.embedding(i, w, max_norm=1.0)
    torch.testing.assert_close(w_tpu.cpu(), w)


def test_dropout_training_mask_and_gradient_agree():
    """Training dropout zeroes a plausible fraction, scales the rest by 1/(1-p), and the gradient uses the same mask."""
    x = torch.ones(4000, device="tpu", requires_grad=True)
    y = F.dropout(x, 0.25)
    y.sum().backward()
    kept = (y != 0).cpu()
    assert 0.70 < kept.float().mean().item() < 0.80
    torch.testing.assert_close(y.detach().cpu()[kept], torch.full((int(kept.sum()),), 1 / 0.75))
    torch.testing.assert_close(x.grad.cpu(), y.detach().cpu())


# ---------------------------------------------------------------- attention
def _sdpa(**kw):
    return lambda q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


ATTENTION = [
    case("sdpa", _sdpa(), randn(2, 3, 5, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 4)),
    case("sdpa-causal", _sdpa(is_causal=True), randn(2, 3, 5, 8), randn(2, 3, 5, 8), randn(2, 3, 5, 8)),
    case("sdpa-causal-rectangular", _sdpa(is_causal=True), randn(2, 3, 4, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8)),
    case("sdpa-bool-mask", _sdpa(), randn(2, 3, 5, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8), torch.rand(5, 6) > 0.3),
    case("sdpa-float-mask", _sdpa(), randn(2, 3, 5, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8), randn(2, 1, 5, 6)),
    case("sdpa-fully-masked-row", _sdpa(), randn(1, 1, 3, 4), randn(1, 1, 3, 4), randn(1, 1, 3, 4),
         torch.tensor([[True, True, False], [False, False, False], [True, False, True]])),
    case("sdpa-scale", _sdpa(scale=0.3), randn(2, 3, 5, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8)),
    case("sdpa-gqa", _sdpa(is_causal=True, enable_gqa=True), randn(2, 6, 5, 8), randn(2, 2, 5, 8), randn(2, 2, 5, 8)),
    case("sdpa-3d", _sdpa(), randn(3, 5, 8), randn(3, 6, 8), randn(3, 6, 8)),
    case("sdpa-bfloat16", _sdpa(is_causal=True), randn(2, 2, 5, 8, dtype=torch.bfloat16),
         randn(2, 2, 5, 8, dtype=torch.bfloat16), randn(2, 2, 5, 8, dtype=torch.bfloat16), atol=2e-2, rtol=2e-2),
    case("multi_head_attention", lambda x, w, b, o: F.multi_head_attention_forward(
        x, x, x, 8, 2, w, b, None, None, False, 0.0, o, None, need_weights=False)[0],
        randn(5, 2, 8), randn(24, 8), randn(24), randn(8, 8), atol=1e-4, rtol=1e-4),
]


@pytest.mark.parametrize("fn,args,atol,rtol,grads", ATTENTION)
def test_attention(fn, args, atol, rtol, grads):
    """scaled_dot_product_attention (masks, causal, scale, GQA) and its gradients."""
    run_cases(fn, args, atol, rtol, grads)


def test_attention_is_one_fused_program():
    """SDPA runs as the overrideable fused op, forward and backward: no matmul/softmax programs of its own."""
    q, k, v = (torch.randn(2, 2, 4, 8, device="tpu", requires_grad=True) for _ in range(3))
    launched = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            launched.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert "aten._scaled_dot_product_fused_attention_overrideable.default" in launched
    assert "aten._scaled_dot_product_fused_attention_overrideable_backward.default" in launched
    assert not any("bmm" in op or "softmax" in op for op in launched), launched


@pytest.mark.parametrize("transform", ["vmap", "vmap_of_grad", "grad_of_vmap"])
def test_attention_under_torch_func_transforms_matches_cpu(transform):
    """torch.func.vmap over SDPA (per-sample gradients too): the overrideable fused op has no batching rule, so
    a batched or grad-wrapped operand takes the math path (vmap raised "Batching rule not implemented"; found by
    running functorch's test_vmap on tpu)."""
    from torch.func import grad, vmap

    def loss(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum()

    run = {
        "vmap": lambda q, k, v: vmap(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))(q, k, v),
        "vmap_of_grad": lambda q, k, v: vmap(grad(loss))(q, k, v),
        "grad_of_vmap": lambda q, k, v: grad(lambda q: vmap(loss)(q, k, v).sum())(q),
    }[transform]
    q, k, v = (torch.randn(3, 2, 4, 8, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(run(q.to("tpu"), k.to("tpu"), v.to("tpu")).cpu(), run(q, k, v))


def test_attention_math_backend_still_available():
    """sdpa_kernel(MATH) selects PyTorch's math decomposition, which is native too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        assert_matches_cpu(_sdpa(is_causal=True), randn(2, 2, 4, 8), randn(2, 2, 4, 8), randn(2, 2, 4, 8), grads=True)


def test_attention_dropout_gradient_uses_the_forward_mask():
    """With dropout, the backward regenerates the forward's mask: gradients equal CPU's for that same mask."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    eye = torch.eye(6).expand(2, 2, 6, 6)  # value = identity: the output is the dropped-out probability matrix
    qt, kt, vt = (t.to("tpu").requires_grad_() for t in (q, k, eye))
    out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=0.4)
    g = torch.randn(2, 2, 6, 6)
    out.backward(g.to("tpu"))
    keep = out.detach().cpu() != 0
    assert 0.35 < 1 - keep.float().mean().item() < 0.45

    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, eye))
    probs = torch.softmax(qc @ kc.transpose(-1, -2) / 8 ** 0.5, -1)
    expected = (probs * keep / 0.6) @ vc
    expected.backward(g)
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for actual, reference in ((qt, qc), (kt, kc), (vt, vc)):
        torch.testing.assert_close(actual.grad.cpu(), reference.grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- recurrent layers
RECURRENT = [
    pytest.param(lambda: nn.LSTM(4, 8, batch_first=True), (2, 5, 4), id="lstm"),
    pytest.param(lambda: nn.LSTM(4, 8, num_layers=2, bidirectional=True), (5, 2, 4), id="lstm-2layer-bidirectional"),
    pytest.param(lambda: nn.LSTM(4, 8, proj_size=3), (5, 2, 4), id="lstm-projection"),
    pytest.param(lambda: nn.LSTM(4, 8, bias=False), (5, 4), id="lstm-unbatched-no-bias"),
    pytest.param(lambda: nn.GRU(4, 8), (5, 2, 4), id="gru"),
    pytest.param(lambda: nn.GRU(4, 8, num_layers=2, bidirectional=True, batch_first=True), (2, 5, 4),
                 id="gru-2layer-bidirectional"),
    pytest.param(lambda: nn.GRU(4, 8, bias=False), (5, 2, 4), id="gru-no-bias"),
    pytest.param(lambda: nn.RNN(4, 8, nonlinearity="relu"), (5, 2, 4), id="rnn-relu"),
    pytest.param(lambda: nn.RNN(4, 8), (5, 2, 4), id="rnn-tanh"),
    pytest.param(lambda: nn.LSTMCell(4, 8), (3, 4), id="lstm_cell"),
    pytest.param(lambda: nn.GRUCell(4, 8), (3, 4), id="gru_cell"),
]


@pytest.mark.parametrize("make,shape", RECURRENT)
def test_recurrent(make, shape):
    """nn.LSTM/GRU/RNN and their cells: outputs, final states, input and weight gradients."""
    torch.manual_seed(0)
    cpu = make()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(*shape)

    def step(module, x):
        out = torch.utils._pytree.tree_leaves(module(x))
        sum(((o * (i + 1)).sum() for i, o in enumerate(out))).backward()
        return out, x.grad, [p.grad for p in module.parameters()]

    expected = step(cpu, x.clone().requires_grad_())
    actual = step(tpu, x.to("tpu").requires_grad_())
    assert_close_tree(actual, expected, atol=1e-5, rtol=1e-5)


def test_lstm_packed_sequence():
    """An LSTM over a packed batch of variable-length sequences."""
    torch.manual_seed(0)
    cpu = nn.LSTM(3, 5)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(6, 3, 3)
    lengths = torch.tensor([6, 4, 2])

    def run(module, x):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths)
        out, (h, c) = module(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out)
        (padded.sum() + 2 * h.sum() + 3 * c.sum()).backward()
        return padded, h, c, x.grad

    expected = run(cpu, x.clone().requires_grad_())
    actual = run(tpu, x.to("tpu").requires_grad_())
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, atol=1e-5, rtol=1e-5)


FAST_PATH = [
    pytest.param(lambda: nn.MultiheadAttention(8, 2, batch_first=True), {}, id="mha"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, batch_first=True), {"need_weights": True}, id="mha-weights"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, batch_first=True), {"need_weights": False},
                 id="mha-no-weights"),  # weights None, as CPU's kernel leaves them
    pytest.param(lambda: nn.MultiheadAttention(8, 2, batch_first=True),
                 {"need_weights": True, "average_attn_weights": False}, id="mha-head-weights"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, batch_first=True), {"key_padding_mask": "padding"},
                 id="mha-key-padding"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, batch_first=True), {"attn_mask": "causal"}, id="mha-attn-mask"),
    pytest.param(lambda: nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True), {}, id="encoder-post-norm-relu"),
    pytest.param(lambda: nn.TransformerEncoderLayer(8, 2, 16, 0.0, "gelu", batch_first=True, norm_first=True),
                 {"src_key_padding_mask": "padding"}, id="encoder-pre-norm-gelu-padding"),
]


@pytest.mark.parametrize("make,kwargs", FAST_PATH)
def test_inference_fast_path(make, kwargs):
    """Eval + no_grad nn.MultiheadAttention / nn.TransformerEncoderLayer take PyTorch's fused kernels, natively."""
    torch.manual_seed(0)
    cpu = make().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 5, 8)
    masks = {"padding": torch.tensor([[False] * 5, [False, False, False, True, True]]),
             "causal": torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)}

    def run(module, device):
        kw = {k: masks[v].to(device) if isinstance(v, str) else v for k, v in kwargs.items()}
        inputs = (x.to(device),) * (3 if isinstance(module, nn.MultiheadAttention) else 1)
        with torch.no_grad():
            return module(*inputs, **kw)

    mha = isinstance(cpu, nn.MultiheadAttention)
    fused = "aten._native_multi_head_attention" if mha else "aten._transformer_encoder_layer_fwd"
    launched = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            launched.append(str(func))
            return func(*args, **(kwargs or {}))

    expected = run(cpu, "cpu")
    with Record():
        actual = run(tpu, "tpu")
    assert any(op.startswith(fused) for op in launched), launched
    assert_close_tree(actual, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- float32 precision policy
def _bf16(t):
    return t.bfloat16().float()


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "conv_transpose"])
def test_convolution_follows_matmul_precision(transposed):
    """At "medium" a float32 convolution multiplies bfloat16-rounded operands, accumulating in float32."""
    torch.manual_seed(0)
    conv = F.conv_transpose2d if transposed else F.conv2d
    x, w = torch.randn(2, 4, 7, 7), torch.randn(4, 3, 3, 3) if transposed else torch.randn(3, 4, 3, 3)
    g = torch.randn_like(conv(x, w, stride=2))
    xc, wc = _bf16(x).requires_grad_(), _bf16(w).requires_grad_()
    expected = conv(xc, wc, stride=2)
    expected.backward(_bf16(g))  # the backward products round the incoming gradient too
    xt, wt = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
    torch.set_float32_matmul_precision("medium")
    actual = conv(xt, wt, stride=2)
    actual.backward(g.to("tpu"))
    torch.set_float32_matmul_precision("highest")
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wt.grad.cpu(), wc.grad, atol=1e-5, rtol=1e-5)
    highest = conv(x.to("tpu"), w.to("tpu"), stride=2).cpu()
    assert not torch.equal(highest, actual.detach().cpu()), "the precision is part of the program's cache key"


def test_attention_follows_matmul_precision():
    """At "medium" both SDPA products take bfloat16-rounded operands (scores, then probabilities @ values)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    probs = torch.softmax(_bf16(q) @ _bf16(k).transpose(-1, -2) / 8 ** 0.5, -1)
    expected = _bf16(probs) @ _bf16(v)
    torch.set_float32_matmul_precision("medium")
    actual = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu")).cpu()
    torch.set_float32_matmul_precision("highest")
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- executor support the nn kernels rely on
def test_lowering_mutates_adds_written_arguments():
    """`mutates=` marks arguments a kernel writes although its schema does not say so."""
    from torch_tpu import ops
    from torch_tpu.eager.opspec import spec
    from torch_tpu.ops import registry

    ops.load_all()
    op = torch.ops.aten.native_batch_norm.default
    assert spec(op).writes == ()
    written = spec(op, registry.get(op).mutates).writes
    assert [spec(op).names[i] for i in written] == ["running_mean", "running_var"]
    unlowered = torch.ops.aten.miopen_batch_norm.default  # a ROCm kernel: never lowered here
    assert registry.get(unlowered) is None
    with pytest.raises(ValueError, match="no arguments named"):
        registry.register(unlowered, lambda *a: a, mutates=("nope",))
    assert registry.get(unlowered) is None  # a refused registration leaves nothing behind


def test_non_tensor_returns_come_from_the_meta_run():
    """An op returning SymInts next to tensors (fused attention's max_q/max_k) returns the meta run's values."""
    q, k, v = (torch.randn(1, 2, 3, 4, device="tpu") for _ in range(3))
    result = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, k, v)
    assert result[4] == 3 and result[5] == 3
    torch.testing.assert_close(result[0].cpu(), F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu()))


# ---------------------------------------------------------------- layouts and higher-order gradients
def test_channels_last_cnn_block():
    """A conv/batch-norm/pool block on channels_last inputs and weights: values and gradients as on CPU.

    (Output strides follow PyTorch's meta kernels, which give convolution a contiguous output.)
    """
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Upsample(scale_factor=2, mode="nearest")).to(memory_format=torch.channels_last)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    expected = _train_step(cpu, x.clone().requires_grad_())
    actual = _train_step(tpu, x.to("tpu").requires_grad_())
    assert_close_tree(actual, expected, atol=1e-4, rtol=1e-4)


def test_double_backward_gradient_penalty():
    """A gradient penalty (create_graph=True) through conv, batch norm, pooling, upsampling and activations."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.2), nn.AvgPool2d(2),
                        nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(4, 1, 3), nn.Softplus())
    tpu = copy.deepcopy(cpu).to("tpu")

    def penalty(module, x):
        (g,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
        loss = (g * g).sum()
        loss.backward()
        return [loss] + [p.grad for p in module.parameters()]

    x = torch.randn(2, 2, 6, 6)
    expected = penalty(cpu, x.clone().requires_grad_())
    actual = penalty(tpu, x.to("tpu").requires_grad_())
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, atol=1e-4, rtol=1e-4)


def test_ops_without_meta_kernels_keep_pytorch_dtypes():
    """Ops with no (working) meta kernel take their result dtypes from the lowering: bfloat16 stays bfloat16."""
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), torch.randn(3)
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    bf = [t.bfloat16().to("tpu") for t in (x, w, b)]
    out = torch.ops.aten.convolution_overrideable(*bf, *args)
    expected = torch.ops.aten.convolution(*(t.bfloat16() for t in (x, w, b)), *args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), expected, atol=3e-2, rtol=3e-2)
    grads = torch.ops.aten.convolution_backward_overrideable(torch.ones_like(out), bf[0], bf[1], *args, [True] * 3)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    lstm = nn.LSTM(3, 4, bias=False).to(torch.bfloat16)
    cpu_out = lstm(torch.randn(5, 2, 3).bfloat16())[0]
    tpu_out = copy.deepcopy(lstm).to("tpu")(torch.randn(5, 2, 3).bfloat16().to("tpu"))[0]
    assert tpu_out.dtype == cpu_out.dtype == torch.bfloat16


def _forward_backward(fn, x, device):
    x = x.detach().to(device).requires_grad_(True)
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    return out.detach().cpu(), x.grad.cpu()


@pytest.mark.parametrize("name,fn,shape", [
    ("max_pool2d-batch0", lambda x: F.max_pool2d(x, 2), (0, 3, 6, 4)),
    ("adaptive_max_pool1d-batch0", lambda x: F.adaptive_max_pool1d(x, 3), (0, 3, 7)),
    ("adaptive_avg_pool2d-batch0", lambda x: F.adaptive_avg_pool2d(x, (3, 2)), (0, 3, 5, 5)),
    ("fractional_max_pool2d-batch0", lambda x: F.fractional_max_pool2d(x, 2, output_size=(3, 2)), (0, 3, 6, 4)),
    ("fractional_max_pool2d-out0", lambda x: F.fractional_max_pool2d(x, (1, 2), output_size=(0, 1)), (3, 6, 4)),
    ("fractional_max_pool3d-out0", lambda x: F.fractional_max_pool3d(x, 1, output_size=(0, 1, 1)), (2, 3, 3, 3)),
    ("max_unpool1d-batch0", lambda x: F.max_unpool1d(*F.max_pool1d(x, 2, return_indices=True), 2), (0, 3, 6)),
])
def test_pools_of_empty_batches_and_sizes_match_cpu(name, fn, shape):
    """Pools (and their backward) of an empty batch or to an empty output size: CPU's shapes and values."""
    x = torch.randn(shape)
    torch.manual_seed(0)
    expected = _forward_backward(fn, x, "cpu")
    torch.manual_seed(0)
    got = _forward_backward(fn, x, "tpu")
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_adaptive_pools_refuse_integers_and_empty_gradients_as_cpu():
    """Adaptive pools refuse integer inputs (CPU and CUDA dispatch floating types only), and
    adaptive_avg_pool backward refuses an empty non-batch gradient with ATen's message."""
    for fn in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool3d):
        x = torch.arange(64).view(1, 4, 4, 4)
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
            fn(x, 2)
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
            fn(x.to("tpu"), 2)
    for device in ("cpu", "tpu"):
        x = torch.randn(1, 4, 5, 5, device=device, requires_grad=True)
        out = F.adaptive_avg_pool2d(x, 0)
        assert out.shape == (1, 4, 0, 0)
        with pytest.raises(RuntimeError, match=r"grad_output has sizes \[1, 4, 0, 0\] with dimension 2 being empty"):
            out.sum().backward()


@pytest.mark.parametrize("shape,weight", [((2, 0, 7), (12, 0, 3)), ((2, 0, 7, 5), (4, 0, 3, 3)), ((0, 0, 6), (3, 0, 2))])
def test_convolution_of_an_input_without_channels_matches_cpu(shape, weight):
    """ATen gives an input with no channels an output with none ((N, 0, *spatial)), and zero gradients
    for the input, the weight and the bias."""
    results = []
    for device in ("cpu", "tpu"):
        x = torch.randn(shape, device=device, requires_grad=True)
        w = torch.randn(weight, device=device, requires_grad=True)
        b = torch.randn(weight[0], device=device, requires_grad=True)
        out = torch.ops.aten.convolution(x, w, b, (2,) * (len(shape) - 2), (0,) * (len(shape) - 2),
                                         (1,) * (len(shape) - 2), False, (0,) * (len(shape) - 2), 1)
        out.sum().backward()
        results.append([t.detach().cpu() for t in (out, x.grad, w.grad, b.grad)])
    for got, expected in zip(*results[::-1]):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)
