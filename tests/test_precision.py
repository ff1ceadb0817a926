"""Float32 matmul precision on tpu: the "medium" default, honouring torch's setting, the context, the warning."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from torch_tpu import metrics, precision
from conftest import TPU

_TORCH_RECORDS = ("generic", "all"), ("mkldnn", "matmul"), ("cuda", "matmul"), ("mkldnn", "conv")


@pytest.fixture
def torch_default():
    """PyTorch's matmul precision as in a fresh process: nothing chosen (every fp32_precision record "none")."""
    getter, setter = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter
    saved = [getter(*record) for record in _TORCH_RECORDS]
    for record in _TORCH_RECORDS:
        setter(*record, "none")
    assert torch.get_float32_matmul_precision() == "highest"
    yield
    for record, value in zip(_TORCH_RECORDS, saved):
        setter(*record, value)


@pytest.fixture
def fresh_warning(monkeypatch):
    """The one-time warning not yet given in this process."""
    monkeypatch.setattr(precision, "_warned", False)


# ------------------------------------------------------------------ execution modes
MODES = ["strict", "defer_and_fuse", "compile"]


def run_in_mode(mode: str, fn, *args):
    """fn(*args) on tpu tensors in an execution mode; results on CPU."""
    if mode == "strict":
        return fn(*args).cpu()
    if mode == "defer_and_fuse":
        with torch_tpu.execution_mode("defer_and_fuse"):
            return fn(*args).cpu()
    from torch_tpu.compile import register

    register()  # an uninstalled checkout has no entry point
    return torch.compile(fn, backend="tpu")(*args).cpu()


# ------------------------------------------------------------------ references computed on CPU
def bf16_product(fn, *tensors):
    """fn on bfloat16-rounded operands, products exact and summed in float64, rounded to float32."""
    return fn(*(t.bfloat16().double() for t in tensors)).float()


def bf16x3_product(fn, a, b):
    """fn(a, b) as three bfloat16 passes (lo*hi + hi*lo + hi*hi), summed in float64."""
    a_hi, b_hi = a.bfloat16(), b.bfloat16()
    a_lo, b_lo = (a - a_hi.float()).bfloat16(), (b - b_hi.float()).bfloat16()
    d = torch.Tensor.double
    return (fn(d(a_lo), d(b_hi)) + fn(d(a_hi), d(b_lo)) + fn(d(a_hi), d(b_hi))).float()


def rel_err(actual, expected) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


K = 256
PRODUCTS = {  # name: (fn, operand shapes)
    "mm": (torch.mm, ((64, K), (K, 32))),
    "bmm": (torch.bmm, ((3, 16, K), (3, K, 24))),
    "matmul_broadcast": (torch.matmul, ((2, 3, 8, K), (K, 16))),
    "mv": (torch.mv, ((32, K), (K,))),
    "dot": (torch.dot, ((K,), (K,))),
    "einsum": (lambda a, b: torch.einsum("bik,bkj->bij", a, b), ((2, 8, K), (2, K, 8))),
    "linear_nobias": (lambda x, w: F.linear(x, w), ((4, 8, K), (16, K))),
}


def _operands(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


# ------------------------------------------------------------------ the policy
def test_default_is_medium(torch_default):
    """With nothing chosen, tpu float32 products run at "medium" and PyTorch's own setting stays "highest"."""
    assert precision.matmul_precision() == "medium"
    assert precision.source() == "default"
    assert precision.torch_choice() is None
    a, b = _operands(((8, 8), (8, 8)))
    (a.to(TPU) @ b.to(TPU)).cpu()
    # We never write PyTorch's setting: CPU/CUDA numerics are untouched.
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch._C._get_fp32_precision_getter("mkldnn", "matmul") == "none"


@pytest.mark.parametrize("level", ["medium", "high", "highest"])
def test_torch_setting_is_honoured(torch_default, level):
    """torch.set_float32_matmul_precision(level) sets the tpu level."""
    torch.set_float32_matmul_precision(level)
    assert precision.torch_choice() == level
    assert precision.matmul_precision() == level
    assert precision.source() == "torch"


def test_generic_fp32_precision_is_honoured(torch_default):
    """PyTorch's new API, torch.backends.fp32_precision = "ieee", means "highest" on tpu too."""
    # The context manager, not assignment: torch.testing's common_utils freezes torch.backends flags when imported.
    with torch.backends.flags(fp32_precision="ieee"):
        assert precision.matmul_precision() == "highest"
    assert precision.matmul_precision() == "medium"


def test_cuda_only_switch_does_not_apply(torch_default):
    """torch.backends.cuda.matmul.allow_tf32 is CUDA's: tpu stays at the default."""
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert precision.matmul_precision() == "medium"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def test_legacy_reader(torch_default):
    """On a torch without fp32_precision records, only a non-default level counts as a choice."""
    assert precision._torch_choice_legacy() is None
    torch.set_float32_matmul_precision("medium")
    assert precision._torch_choice_legacy() == "medium"
    torch.set_float32_matmul_precision("highest")
    assert precision._torch_choice_legacy() is None


def test_use_overrides_and_restores(torch_default):
    """precision.use() overrides torch's setting for tpu inside the block, nests, and restores."""
    torch.set_float32_matmul_precision("highest")
    with precision.use("medium"):
        assert precision.matmul_precision() == "medium"
        assert precision.source() == "torch_tpu.precision.use"
        with precision.use("high"):
            assert precision.matmul_precision() == "high"
        assert precision.matmul_precision() == "medium"
        assert torch.get_float32_matmul_precision() == "highest"  # torch's own setting is left alone
    assert precision.matmul_precision() == "highest"


def test_use_is_per_thread(torch_default):
    """A use() block in one thread does not change another thread's level."""
    seen = []
    with precision.use("highest"):
        thread = threading.Thread(target=lambda: seen.append(precision.matmul_precision()))
        thread.start()
        thread.join()
    assert seen == ["medium"]


def test_use_rejects_unknown_level():
    """Levels are PyTorch's names."""
    with pytest.raises(ValueError, match="medium"):
        with precision.use("bf16"):
            pass


# ------------------------------------------------------------------ numerics of each level
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_default_medium_matches_bf16_reference(torch_default, mode, name):
    """At the default, tpu products equal bf16-rounded operands with float32 accumulation, and differ from fp32."""
    fn, shapes = PRODUCTS[name]
    operands = _operands(shapes)
    actual = run_in_mode(mode, fn, *(t.to(TPU) for t in operands))
    torch.testing.assert_close(actual, bf16_product(fn, *operands), rtol=2e-5, atol=2e-5)
    full = fn(*operands)
    assert rel_err(actual, full) > 1e-4, "medium should differ from full float32"
    assert rel_err(actual, full) < 1e-2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mm", "bmm", "einsum"])
def test_highest_matches_fp32(mode, name):
    """torch.set_float32_matmul_precision("highest") gives full float32 products (and not the bf16 ones)."""
    torch.set_float32_matmul_precision("highest")
    fn, shapes = PRODUCTS[name]
    operands = _operands(shapes)
    actual = run_in_mode(mode, fn, *(t.to(TPU) for t in operands))
    torch.testing.assert_close(actual, fn(*operands), rtol=2e-5, atol=2e-5)
    assert rel_err(actual, bf16_product(fn, *operands)) > 1e-4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mm", "bmm", "matmul_broadcast"])
def test_high_matches_bf16x3_reference(mode, name):
    """"high" is bf16x3: equal to the three-pass reference, far closer to float64 than "medium"."""
    fn, shapes = PRODUCTS[name]
    operands = _operands(shapes)
    with precision.use("high"):
        actual = run_in_mode(mode, fn, *(t.to(TPU) for t in operands))
    torch.testing.assert_close(actual, bf16x3_product(fn, *operands), rtol=2e-5, atol=2e-5)
    exact = fn(*(t.double() for t in operands))
    assert rel_err(actual, exact) < 5e-5
    assert rel_err(bf16_product(fn, *operands), exact) > 20 * rel_err(actual, exact)


@pytest.mark.parametrize("mode", MODES)
def test_context_applies_in_every_mode(torch_default, mode):
    """precision.use("highest") inside a block and the default outside, in each execution mode."""
    a, b = _operands(((32, K), (K, 32)))
    with precision.use("highest"):
        inside = run_in_mode(mode, torch.mm, a.to(TPU), b.to(TPU))
    outside = run_in_mode(mode, torch.mm, a.to(TPU), b.to(TPU))
    torch.testing.assert_close(inside, a @ b, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(outside, bf16_product(torch.mm, a, b), rtol=2e-5, atol=2e-5)


def test_linear_with_bias_and_backward(torch_default):
    """F.linear (addmm) and its gradients follow "medium": every product has bf16 operands."""
    x, w, bias, grad = _operands(((16, K), (32, K), (32,), (16, 32)), seed=3)
    xt, wt = x.to(TPU).requires_grad_(), w.to(TPU).requires_grad_()
    out = F.linear(xt, wt, bias.to(TPU))
    out.backward(grad.to(TPU))
    expected = (bf16_product(lambda x, w: x @ w.T, x, w).double() + bias.double()).float()
    torch.testing.assert_close(out.detach().cpu(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(xt.grad.cpu(), bf16_product(torch.mm, grad, w), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(wt.grad.cpu(), bf16_product(torch.mm, grad.T, x), rtol=2e-5, atol=2e-5)


TRANSPOSED = {  # name: (fn, operand shapes); transposed operands or results, in one program under DeferAndFuse
    "a.t() @ b": (lambda a, b: a.t() @ b, ((K, 48), (K, 32))),
    "a @ b.t()": (lambda a, b: a @ b.t(), ((48, K), (32, K))),
    "(a @ b).t() + 1": (lambda a, b: (a @ b).t() + 1, ((48, K), (K, 32))),
    "(a.t() @ b.t()).t()": (lambda a, b: (a.t() @ b.t()).t(), ((K, 48), (32, K))),
    "bmm, transposed": (lambda a, b: (a.transpose(1, 2) @ b).transpose(1, 2), ((4, K, 16), (4, K, 24))),
}


@pytest.mark.parametrize("mode", ["strict", "defer_and_fuse"])
@pytest.mark.parametrize("name", sorted(TRANSPOSED))
def test_transposed_operands_and_results(torch_default, mode, name):
    """Transposed operands and results (fused into one program under DeferAndFuse) give the bf16 products."""
    fn, shapes = TRANSPOSED[name]
    operands = _operands(shapes, seed=11)
    actual = run_in_mode(mode, fn, *(t.to(TPU) for t in operands))
    torch.testing.assert_close(actual, bf16_product(fn, *operands), rtol=2e-5, atol=2e-5)


def test_xla_cpu_products_keep_their_operand_type(torch_default):
    """On XLA:CPU every dot of a "medium" product, transposed operands included, multiplies the type
    precision.py chose: bfloat16 on a host with bfloat16 instructions, else float32 (the widened
    bfloat16 values: `widens_low_precision`).

    XLA:CPU widens a bfloat16 dot it will not run in its library kernel to float32 (same numbers,
    several times slower); precision.py hands it row-major operands so that it does not.
    """
    import re

    import jax
    import jax.numpy as jnp

    from torch_tpu.runtime import platform

    if platform.get().platform != "cpu":
        pytest.skip("XLA:CPU's dot forms")
    operand_type = "f32" if precision.widens_low_precision() else "bf16"
    x, w, g = (jnp.ones(s, jnp.float32) for s in ((128, K), (96, K), (128, 96)))
    forms = {
        "x @ w.T": lambda x, w, g: precision.matmul(x, w.T),
        "g.T @ x": lambda x, w, g: precision.matmul(g.T, x),
        "g @ w": lambda x, w, g: precision.matmul(g, w),
        "(x @ w.T).T": lambda x, w, g: precision.matmul(x, w.T).T + 1,
        "batched q @ k.T": lambda x, w, g: precision.matmul(x.reshape(4, 32, K), jnp.swapaxes(x.reshape(4, 32, K), 1, 2)),
    }
    for name, fn in forms.items():
        text = jax.jit(fn).lower(x, w, g).compile().as_text()
        dots = re.findall(r"= \S+ dot\(%([\w.\-]+), %([\w.\-]+)\)", text)
        assert dots, name
        for operands in dots:
            types = [re.search("%" + re.escape(o) + r" = (\w+)\[", text).group(1) for o in operands]
            assert types == [operand_type, operand_type], (name, types)


@pytest.mark.parametrize("level", ["medium", "high"])
def test_widened_low_precision_products_equal_bfloat16_ones(torch_default, monkeypatch, level):
    """The two forms of a low-precision product (bfloat16 operands, or float32 operands holding the
    same bfloat16 values: `widens_low_precision`) give the same numbers, up to float32 summation
    order, for float32 inputs at "medium"/"high", and for bfloat16 inputs; both match the CPU oracle."""
    import jax
    import jax.numpy as jnp

    a, b = _operands(((64, K), (K, 48)), seed=17)
    args = (_jnp(a), _jnp(b))
    bf = tuple(x.astype(jnp.bfloat16) for x in args)
    results = {}
    for widens in (False, True):
        monkeypatch.setattr(precision, "widens_low_precision", lambda widens=widens: widens)
        with precision.use(level):
            f32 = jax.jit(precision.matmul)(*args)
            conv = jax.jit(lambda x, w: precision.conv_general_dilated(x, w, (1,), "VALID"))(
                args[0].T[None], args[1].T[:, :, None])  # [1, K, 64] * [48, K, 1]: a 1x1 convolution
        low = jax.jit(precision.matmul)(*bf)
        results[widens] = [_torch(r.astype(jnp.float32)) for r in (f32, conv, low)]
    for narrow, wide in zip(results[False], results[True]):
        torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-5)
    if level == "medium":
        torch.testing.assert_close(results[True][0], bf16_product(torch.mm, a, b), rtol=2e-5, atol=2e-5)
    expected_low = (a.bfloat16().float() @ b.bfloat16().float()).bfloat16().float()
    torch.testing.assert_close(results[True][2], expected_low, rtol=0, atol=0)


def test_widens_low_precision_reads_the_host(monkeypatch):
    """XLA:CPU without bfloat16 multiply instructions widens; with avx512_bf16 or amx_bf16 it does not."""
    import builtins
    import io

    from torch_tpu.runtime import platform

    if platform.get().platform != "cpu":
        assert not precision.widens_low_precision()
        return
    real_open = builtins.open
    for flags, widens in (("fpu sse2 avx2 fma", True), ("fpu avx2 avx512f avx512_bf16", False), ("amx_bf16", False)):
        monkeypatch.setattr(builtins, "open", lambda path, *a, flags=flags, **k: io.StringIO(
            f"processor\t: 0\nflags\t\t: {flags}\n") if path == "/proc/cpuinfo" else real_open(path, *a, **k))
        precision.widens_low_precision.cache_clear()
        try:
            assert precision.widens_low_precision() is widens, flags
        finally:
            monkeypatch.setattr(builtins, "open", real_open)
            precision.widens_low_precision.cache_clear()


def test_xla_cpu_transposed_view_operand_is_taken_as_it_lies(torch_default):
    """A right operand read as a transposed view (a linear layer's weight.t()) reaches XLA:CPU's bf16
    library dot in its [n, k] form: contracted along its rows, not copied into a transpose first."""
    import jax
    import jax.numpy as jnp

    from torch_tpu.runtime import strided
    from torch_tpu.runtime import platform

    if platform.get().platform != "cpu":
        pytest.skip("XLA:CPU's dot forms")
    x, w = _operands(((64, K), (96, K)), seed=13)

    def linear(x, w_flat):
        w_t = strided.read(w_flat, (K, 96), (1, K), 0)  # w.t() of a row-major (96, K) weight
        assert strided.permuted_source(w_t) is not None
        return precision.matmul(x, w_t)

    args = (jnp.asarray(x.numpy()), jnp.asarray(w.reshape(-1).numpy()))
    torch.testing.assert_close(_torch(jax.jit(linear)(*args)), bf16_product(lambda x, w: x @ w.T, x, w),
                               rtol=2e-5, atol=2e-5)
    text = jax.jit(linear).lower(*args).compile().as_text()
    assert "rhs_contracting_dims={1}" in text and "transpose(" not in text


def test_attention_follows_policy(torch_default):
    """scaled_dot_product_attention: bf16-level error at the default, float32-level at "highest"."""
    q, k, v = _operands(((2, 4, 32, 64),) * 3, seed=5)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)

    def attend():
        return F.scaled_dot_product_attention(q.to(TPU), k.to(TPU), v.to(TPU), is_causal=True).cpu()

    medium = attend()
    with precision.use("highest"):
        highest = attend()
    assert 1e-4 < rel_err(medium, exact) < 2e-2
    assert rel_err(highest, exact) < 1e-5


def test_low_precision_and_exact_dtypes_unchanged(torch_default):
    """bfloat16/float16 accumulate in float32 as in PyTorch; float64 and integer products are exact."""
    a, b = _operands(((16, 64), (64, 16)))
    for dtype in (torch.bfloat16, torch.float16):
        actual = (a.to(dtype).to(TPU) @ b.to(dtype).to(TPU)).cpu()
        assert actual.dtype == dtype
        expected = (a.to(dtype).double() @ b.to(dtype).double()).to(dtype)
        torch.testing.assert_close(actual, expected, rtol=0, atol=0) if dtype == torch.bfloat16 else \
            torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close((a.double().to(TPU) @ b.double().to(TPU)).cpu(), a.double() @ b.double(),
                               rtol=1e-12, atol=1e-12)
    ai, bi = torch.randint(-1000, 1000, (8, 8)), torch.randint(-1000, 1000, (8, 8))
    assert torch.equal((ai.to(TPU) @ bi.to(TPU)).cpu(), ai @ bi)


@pytest.mark.parametrize("form", ["functional", "out", "inplace"])
def test_low_precision_bias_rounds_once(form):
    """bfloat16 linear/addmm adds the bias to the float32 accumulator and rounds once, as PyTorch's CUDA kernels do.

    The oracle is the float64 result rounded once. PyTorch's CPU kernel matches it on some CPUs and not on
    others (on an AVX2-only CPU its bfloat16 GEMM rounds differently), so it is not the reference here.
    A float32 accumulator is itself rounded: where the exact value lies within its error bound
    (n * 2**-24 * the sum of |terms|) of a bfloat16 rounding midpoint, either neighbour is right
    (1 element of 8192 on a host whose XLA:CPU keeps the dot in bfloat16); elsewhere the result is exact."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g).bfloat16(), torch.randn(128, 256, generator=g).bfloat16()
    bias = (torch.randn(128, generator=g) * 30).bfloat16()
    product = x.double() @ w.double().T
    exact = product + bias.double()
    expected = exact.bfloat16()
    # Rounding the bias into the product first (what "round twice" gives) is a different answer: the test can fail.
    twice = (product.bfloat16().double() + bias.double()).bfloat16()
    assert not torch.equal(twice, expected)
    xt, wt, bt = x.to(TPU), w.to(TPU), bias.to(TPU)
    if form == "functional":
        actual = F.linear(xt, wt, bt)
    elif form == "out":
        actual = torch.empty(64, 128, dtype=torch.bfloat16, device=TPU)
        torch.addmm(bt, xt, wt.T, out=actual)
    else:
        actual = bt.expand(64, 128).clone().addmm_(xt, wt.T)
    actual = actual.cpu()
    bound = 257 * 2.0**-24 * (x.double().abs() @ w.double().abs().T + bias.double().abs())  # 256 products + bias
    midpoint = (actual.double() + expected.double()) / 2
    off = actual != expected
    assert off.sum() <= 8, f"{off.sum()} of {off.numel()} elements are not the exact result rounded once"
    assert ((exact - midpoint).abs() <= bound)[off].all(), "a result off the rounded-once value, not at a tie"


def test_high_keeps_infinities():
    """bf16x3 splitting does not turn an infinite operand into NaN (inf - inf)."""
    a = torch.ones(4, 4)
    a[0, 0] = float("inf")
    b = torch.ones(4, 4)
    with precision.use("high"):
        actual = (a.to(TPU) @ b.to(TPU)).cpu()
    torch.testing.assert_close(actual, a @ b)


def test_vdot_conjugates_complex():
    """vdot conjugates its first argument (complex products run at full precision)."""
    a, b = torch.randn(6, dtype=torch.complex64), torch.randn(6, dtype=torch.complex64)
    torch.testing.assert_close(torch.vdot(a.to(TPU), b.to(TPU)).cpu(), torch.vdot(a, b), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ caching
def test_level_is_part_of_the_cache_key(torch_default):
    """Each level compiles its own program; coming back to a level reuses its program."""
    a, b = (t.to(TPU) for t in _operands(((24, 40), (40, 24)), seed=11))
    misses = metrics.counts.cache_misses
    (a @ b).cpu()
    with precision.use("highest"):
        (a @ b).cpu()
    assert metrics.counts.cache_misses == misses + 2
    (a @ b).cpu()
    with precision.use("highest"):
        (a @ b).cpu()
    assert metrics.counts.cache_misses == misses + 2


def test_bound_trace_ignores_ambient_level(torch_default):
    """A program traced later (as DeferAndFuse does) uses the level of its key, not the level at trace time."""
    import jax
    import jax.numpy as jnp

    a, b = _operands(((8, K), (K, 8)))
    bound = precision.bind(lambda x, y: precision.matmul(x, y), "medium")
    with precision.use("highest"):
        actual = _torch(jax.jit(bound)(jnp.asarray(a.numpy()), jnp.asarray(b.numpy())))
    torch.testing.assert_close(actual, bf16_product(torch.mm, a, b), rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ the helpers lowerings use
def _jnp(t):
    import jax.numpy as jnp

    return jnp.asarray(t.numpy())


def _torch(x):
    return torch.from_numpy(np.asarray(x).copy())


def test_helper_conv_general_dilated(torch_default):
    """precision.conv_general_dilated: bf16 operands + float32 accumulation at "medium", float32 at "highest"."""
    x, w = _operands(((2, 16, 12, 12), (8, 16, 3, 3)), seed=7)

    def conv(lhs, rhs):
        return precision.conv_general_dilated(lhs, rhs, (1, 1), "SAME")

    expected_medium = bf16_product(lambda x, w: F.conv2d(x, w, padding=1), x, w)
    torch.testing.assert_close(_torch(conv(_jnp(x), _jnp(w))), expected_medium, rtol=2e-5, atol=2e-5)
    with precision.use("highest"):
        torch.testing.assert_close(_torch(conv(_jnp(x), _jnp(w))), F.conv2d(x, w, padding=1), rtol=2e-5, atol=2e-5)
    with precision.use("high"):
        high = _torch(conv(_jnp(x), _jnp(w)))
    exact = F.conv2d(x.double(), w.double(), padding=1)
    assert rel_err(high, exact) < 5e-5 < rel_err(expected_medium, exact)


def test_helper_einsum_and_dot_general(torch_default):
    """precision.einsum and precision.dot_general follow the policy like matmul."""
    q, k = _operands(((2, 16, 4, 32), (2, 20, 4, 32)), seed=9)
    expected = bf16_product(lambda q, k: torch.einsum("bqhd,bkhd->bhqk", q, k), q, k)
    torch.testing.assert_close(_torch(precision.einsum("bqhd,bkhd->bhqk", _jnp(q), _jnp(k))), expected,
                               rtol=2e-5, atol=2e-5)
    a, b = _operands(((6, K), (K, 5)))
    actual = _torch(precision.dot_general(_jnp(a), _jnp(b), (((1,), (0,)), ((), ()))))
    torch.testing.assert_close(actual, bf16_product(torch.mm, a, b), rtol=2e-5, atol=2e-5)
    with precision.use("highest"):
        actual = _torch(precision.dot_general(_jnp(a), _jnp(b), (((1,), (0,)), ((), ()))))
    torch.testing.assert_close(actual, a @ b, rtol=2e-5, atol=2e-5)


def test_helper_dtypes(torch_default):
    """Helpers return the inputs' dtype: bf16 rounds once from float32 accumulation, ints stay exact."""
    import jax.numpy as jnp

    a = jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4)
    assert precision.matmul(a, a.T).dtype == jnp.bfloat16
    assert precision.matmul(a, a.T, accumulator=True).dtype == jnp.float32  # unrounded, for a bias add
    f = jnp.asarray(np.random.default_rng(0).standard_normal((8, K)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(precision.matmul_f32(f, f.T)), np.asarray(precision.matmul(f, f.T)))
    ft = torch.from_numpy(np.asarray(f))  # the oracle: CPU's product of the bfloat16-rounded operands, in float32
    torch.testing.assert_close(_torch(precision.matmul_f32(f, f.T)), bf16_product(torch.mm, ft, ft.T),
                               rtol=2e-5, atol=2e-5)
    i = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    out = precision.matmul(i, i.T)
    assert out.dtype == jnp.int32
    assert np.array_equal(np.asarray(out), np.asarray(i) @ np.asarray(i).T)


# ------------------------------------------------------------------ warning and report
def test_warning_fires_once(torch_default, fresh_warning):
    """Selecting "highest" warns once (a filterable UserWarning subclass) at the user's line; "medium" never."""
    a, b = (t.to(TPU) for t in _operands(((8, 16), (16, 8)), seed=13))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (a @ b).cpu()  # medium: no warning
        torch.set_float32_matmul_precision("highest")
        (a @ b).cpu()
        (a.T @ b.T).cpu()  # a second product, a second program: no second warning
        with precision.use("high"):
            (a @ b).cpu()
    perf = [w for w in caught if issubclass(w.category, torch_tpu.TpuPerformanceWarning)]
    assert len(perf) == 1
    assert issubclass(torch_tpu.TpuPerformanceWarning, UserWarning)
    assert "'highest'" in str(perf[0].message)
    assert perf[0].filename == __file__


def test_warning_can_be_filtered(torch_default, fresh_warning):
    """warnings.filterwarnings("ignore", category=TpuPerformanceWarning) silences it."""
    a, b = (t.to(TPU) for t in _operands(((8, 16), (16, 8)), seed=17))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=torch_tpu.TpuPerformanceWarning)
        with precision.use("highest"):
            (a @ b).cpu()
    assert not [w for w in caught if issubclass(w.category, torch_tpu.TpuPerformanceWarning)]


def test_precision_in_metrics_report(torch_default):
    """The metrics report shows the current level, where it comes from, and products traced per level."""
    a, b = (t.to(TPU) for t in _operands(((8, 20), (20, 8)), seed=19))
    before = precision.traced["medium"]
    (a @ b).cpu()
    assert precision.traced["medium"] > before  # once in Strict; DeferAndFuse also traces the fused graph
    report = metrics.report()
    assert "precision: float32 matmul" in report
    assert "medium (default)" in report
    torch.set_float32_matmul_precision("high")
    assert "high (torch)" in metrics.report()
