"""FlexAttention on "tpu": eager and compiled, forward and backward, against CPU (torch_tpu/flex_attention.py)."""
import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import torch_tpu
from conftest import TPU

B, H, L, E = 2, 4, 128, 32


def _relative_bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.05


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _inputs(kv_heads=H):
    torch.manual_seed(0)
    return torch.randn(B, H, L, E), torch.randn(B, kv_heads, L, E), torch.randn(B, kv_heads, L, E)


def _reference(q, k, v, bias=None, causal=False):
    """Attention written out on CPU (autograd gives the gradients CPU's FlexAttention does not have)."""
    scores = q @ k.transpose(-1, -2) / E ** 0.5
    if bias is not None:
        scores = scores + bias
    if causal:
        scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


def _bias():
    positions = torch.arange(L)
    return (positions[:, None] - positions[None, :]) * 0.05


def test_forward_matches_cpu_flex_attention():
    """score_mod, a block mask, a score_mod over a captured tensor, grouped-query heads and the logsumexp."""
    q, k, v = _inputs()
    head_bias = torch.randn(H)

    def per_head(score, b, h, q_idx, kv_idx):
        return score + head_bias[h]

    tpu_head_bias = head_bias.to(TPU)

    def per_head_tpu(score, b, h, q_idx, kv_idx):
        return score + tpu_head_bias[h]

    cases = [
        (dict(score_mod=_relative_bias), dict(score_mod=_relative_bias)),
        (dict(block_mask=create_block_mask(_causal, B, H, L, L, device="cpu")),
         dict(block_mask=create_block_mask(_causal, B, H, L, L, device=TPU))),
        (dict(score_mod=per_head), dict(score_mod=per_head_tpu)),
        (dict(score_mod=_relative_bias, return_aux=AuxRequest(lse=True)),
         dict(score_mod=_relative_bias, return_aux=AuxRequest(lse=True))),
    ]
    for cpu_kwargs, tpu_kwargs in cases:
        expected = flex_attention(q, k, v, **cpu_kwargs)
        got = flex_attention(q.to(TPU), k.to(TPU), v.to(TPU), **tpu_kwargs)
        torch.testing.assert_close(_on_cpu(got), expected, rtol=1e-5, atol=1e-5)
    q, k, v = _inputs(kv_heads=2)
    expected = flex_attention(q, k, v, score_mod=_relative_bias, enable_gqa=True)
    got = flex_attention(q.to(TPU), k.to(TPU), v.to(TPU), score_mod=_relative_bias, enable_gqa=True)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def _on_cpu(value):
    """A result, or (output, AuxOutput) with return_aux, on CPU."""
    if isinstance(value, tuple):
        out, aux = value
        return out.cpu(), type(aux)(**{k: v if v is None else v.cpu() for k, v in aux._asdict().items()})
    return value.cpu()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_match_attention_written_out(compiled):
    """Backward through score_mod and through a causal block mask, eager and compiled; compiled, the
    forward and backward graphs are one XLA program each (the higher-order ops planned inline)."""
    fn = torch.compile(flex_attention, backend="tpu") if compiled else flex_attention
    before = torch_tpu.compile.stats.eager_graphs
    q, k, v = _inputs()
    for tpu_kwargs, ref_kwargs in [(dict(score_mod=_relative_bias), dict(bias=_bias())),
                                   (dict(block_mask=create_block_mask(_causal, B, H, L, L, device=TPU)),
                                    dict(causal=True))]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = _reference(*leaves, **ref_kwargs)
        expected.square().sum().backward()
        tpu_leaves = [t.to(TPU).requires_grad_() for t in (q, k, v)]
        got = fn(*tpu_leaves, **tpu_kwargs)
        got.square().sum().backward()
        torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
        for g, e in zip(tpu_leaves, leaves):
            torch.testing.assert_close(g.grad.cpu(), e.grad, rtol=1e-4, atol=1e-5)
    if compiled:
        assert torch_tpu.compile.stats.eager_graphs == before


def test_other_devices_are_checked_as_before():
    q = torch.randn(1, 1, 16, 8, device="meta")
    with pytest.raises(ValueError, match="FlexAttention is only supported on"):
        flex_attention(q, q, q)
