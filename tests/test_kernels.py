"""Bundled kernels (torch_tpu.kernels): attention vs PyTorch's CPU SDPA, grouped matmul vs a per-expert loop,
torch._grouped_mm's lowering, and the routing policy."""
import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from torch_tpu import kernels, metrics
from torch_tpu.eager import defer, executor
from torch_tpu.kernels import routing

TPU = torch.device("tpu:0")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _qkv(heads, kv_heads, dtype, seq=8, dim=8, batch=2):
    torch.manual_seed(0)
    return [torch.randn(batch, h, seq, dim, dtype=dtype, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


_CASES = [(h, kv, causal, dtype, "auto") for h, kv in ((2, 2), (4, 2)) for causal in (False, True)
          for dtype in (torch.float32, torch.bfloat16)]
_CASES += [(4, 2, True, torch.float32, "reference"), (4, 1, False, torch.bfloat16, "reference")]


@pytest.mark.parametrize("heads,kv_heads,causal,dtype,implementation", _CASES)
def test_flash_attention_matches_sdpa_forward_and_backward(heads, kv_heads, causal, dtype, implementation):
    """flash_attention equals CPU SDPA (GQA through enable_gqa), outputs and input gradients."""
    q, k, v = _qkv(heads, kv_heads, dtype)
    qt, kt, vt = (t.detach().to(TPU).requires_grad_() for t in (q, k, v))
    out = kernels.flash_attention(qt, kt, vt, causal=causal, implementation=implementation)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    assert out.dtype == dtype and out.device.type == "tpu"
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL[dtype])
    grad = torch.randn_like(ref)
    out.backward(grad.to(TPU))
    ref.backward(grad)
    for got, expected in ((qt, q), (kt, k), (vt, v)):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.cpu(), expected.grad, **TOL[dtype])


def test_flash_attention_window_and_scale_match_sdpa_with_a_mask():
    """Sliding-window attention with a custom scale equals SDPA with the same boolean band mask."""
    q, k, v = _qkv(2, 2, torch.float32, seq=10)
    before, after = 3, 0
    i = torch.arange(10)
    band = (i[None, :] >= i[:, None] - before) & (i[None, :] <= i[:, None] + after)
    out = kernels.flash_attention(*(t.detach().to(TPU) for t in (q, k, v)), scale=0.3, window=(before, after))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=0.3)
    torch.testing.assert_close(out.cpu(), ref.detach(), **TOL[torch.float32])


def test_flash_attention_in_defer_and_fuse_is_one_program():
    """Projections, the attention kernel and the output projection fuse into one program."""
    q, k, v = (t.detach() for t in _qkv(4, 2, torch.float32))
    w = torch.randn(8, 8)
    qt, kt, vt, wt = (t.to(TPU) for t in (q, k, v, w))
    torch.tpu.synchronize()
    metrics.reset()
    before = set(defer._executables)
    with torch_tpu.defer_and_fuse():
        out = (kernels.flash_attention(qt @ wt, kt, vt, causal=True) @ wt).sum(-1)
        result = out.cpu()
    fused = [key for key in set(defer._executables) - before if not (isinstance(key, tuple) and key[0] == "flatten")]
    assert metrics.counts.fused_executions == 1 and len(fused) == 1
    ref = (F.scaled_dot_product_attention(q @ w, k, v, is_causal=True, enable_gqa=True) @ w).sum(-1)
    torch.testing.assert_close(result, ref, atol=1e-4, rtol=1e-4)


def test_flash_attention_errors():
    """Bad layouts and head counts get clear errors."""
    x = torch.zeros(2, 4, 8, device="tpu")
    with pytest.raises(ValueError, match="batch, heads, seq, head_dim"):
        kernels.flash_attention(x, x, x)
    q, k = torch.zeros(1, 3, 4, 8, device="tpu"), torch.zeros(1, 2, 4, 8, device="tpu")
    with pytest.raises(ValueError, match="cannot be grouped"):
        kernels.flash_attention(q, k, k)
    with pytest.raises(ValueError, match="implementation must be one of"):
        kernels.flash_attention(k, k, k, implementation="cuda")


def _per_expert(x, w, sizes):
    rows, start = [], 0
    for g, n in enumerate(sizes):
        rows.append(x[start:start + n].float() @ w[g].float())
        start += n
    return torch.cat(rows).to(x.dtype)


@pytest.mark.parametrize("dtype,implementation", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                                  (torch.float32, "xla"), (torch.float32, "reference")])
def test_grouped_matmul_matches_per_expert_loop(dtype, implementation):
    """grouped_matmul equals a loop over experts (an empty expert included), with gradients."""
    sizes = [3, 0, 4, 1]
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 16, 8, dtype=dtype, requires_grad=True)
    xt, wt = (t.detach().to(TPU).requires_grad_() for t in (x, w))
    out = kernels.grouped_matmul(xt, wt, torch.tensor(sizes, device="tpu"), implementation=implementation)
    ref = _per_expert(x, w, sizes)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL[dtype])
    grad = torch.randn_like(ref)
    out.backward(grad.to(TPU))
    ref.backward(grad)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, **TOL[dtype])
    torch.testing.assert_close(wt.grad.cpu(), w.grad, **TOL[dtype])


def test_grouped_matmul_errors():
    """Shapes and an integer group_sizes are checked."""
    x, w = torch.zeros(8, 16, device="tpu"), torch.zeros(2, 16, 4, device="tpu")
    with pytest.raises(ValueError, match="grouped_matmul expects"):
        kernels.grouped_matmul(x, w, torch.tensor([8], device="tpu"))
    with pytest.raises(TypeError, match="integer"):
        kernels.grouped_matmul(x, w, torch.tensor([4.0, 4.0], device="tpu"))


def test_torch_grouped_mm_lowering_matches_per_expert_loop():
    """torch._grouped_mm on tpu (bf16, as PyTorch requires): 2-D x 3-D with backward, 3-D x 2-D, 3-D x 3-D."""
    bf = torch.bfloat16
    sizes = [3, 0, 5]
    x = torch.randn(8, 16, dtype=bf, requires_grad=True)
    w = torch.randn(3, 16, 8, dtype=bf, requires_grad=True)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    xt, wt = (t.detach().to(TPU).requires_grad_() for t in (x, w))
    out = torch._grouped_mm(xt, wt, offs=offs.to(TPU))
    ref = _per_expert(x, w, sizes)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL[bf])
    grad = torch.randn_like(ref)
    out.backward(grad.to(TPU))
    ref.backward(grad)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, **TOL[bf])
    torch.testing.assert_close(wt.grad.cpu(), w.grad, **TOL[bf])

    a, b = torch.randn(3, 8, 16, dtype=bf), torch.randn(16, 24, dtype=bf)
    cols = torch.tensor([8, 16, 24], dtype=torch.int32)
    got = torch._grouped_mm(a.to(TPU), b.to(TPU), offs=cols.to(TPU)).cpu()
    expected = torch.cat([a[g].float() @ b[:, 8 * g:8 * (g + 1)].float() for g in range(3)], 1).to(bf)
    torch.testing.assert_close(got, expected, **TOL[bf])
    c = torch.randn(3, 16, 8, dtype=bf)
    torch.testing.assert_close(torch._grouped_mm(a.to(TPU), c.to(TPU)).cpu(), (a.float() @ c.float()).to(bf),
                               **TOL[bf])


@pytest.fixture
def kernel_policy():
    previous = routing.policy()
    yield routing.set_policy
    routing.set_policy(previous)


def _programs_named(fragment):
    return sum(fragment in key[0] for key in executor.programs)


def test_routing_default_keeps_xla_lowerings_on_cpu():
    """On XLA:CPU the default policy leaves SDPA on its XLA lowering."""
    assert routing.policy() == "auto" and not routing.use_kernels() and routing._library is None
    q, k, v = (t.detach().to(TPU) for t in _qkv(2, 2, torch.float32, seq=5))
    before = _programs_named("flash_attention")
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert _programs_named("flash_attention") == before


def test_routing_always_sends_sdpa_to_the_kernel(kernel_policy):
    """policy "always": SDPA without mask/dropout runs flash_attention (and matches CPU); with a mask it does not."""
    kernel_policy("always")
    q, k, v = _qkv(4, 2, torch.float32, seq=6)
    qt, kt, vt = (t.detach().to(TPU).requires_grad_() for t in (q, k, v))
    before = _programs_named("flash_attention")
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    assert _programs_named("flash_attention") > before
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL[torch.float32])
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(qt.grad.cpu(), q.grad, **TOL[torch.float32])
    counted = _programs_named("flash_attention")
    mask = torch.ones(6, 6, dtype=torch.bool, device="tpu").tril()
    masked = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    assert _programs_named("flash_attention") == counted
    torch.testing.assert_close(masked.detach().cpu(), ref.detach(), **TOL[torch.float32])
    kernel_policy("never")
    assert routing._library is None
    with pytest.raises(ValueError, match="routing policy"):
        kernel_policy("sometimes")
