"""Model families on tpu match PyTorch CPU: forward, gradients, one optimizer step, a second forward.

Random-initialised, built here (no downloads), float32 at "highest" matmul
precision (the conftest fixture). Every op runs natively: the tests assert that
no op fell back to the CPU. Tolerances and measured errors: docs/model-families.md
(`python tests/test_models.py` prints the measured errors).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from torch_tpu import metrics

pytestmark = pytest.mark.heavy


# ---------------------------------------------------------------- ResNet (batch norm)
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layers = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 32, 2))
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ---------------------------------------------------------------- ViT
class ViT(nn.Module):
    def __init__(self, image=16, patch=4, dim=32, depth=2, heads=4, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


# ---------------------------------------------------------------- UNet (transposed conv + upsampling)
def _double_conv(cin, cout):
    # No conv bias before a norm: it would have a mathematically zero gradient (the norm subtracts it).
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(4, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.enc1, self.enc2, self.mid = _double_conv(3, 8), _double_conv(8, 16), _double_conv(16, 32)
        self.up2 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec2 = _double_conv(32, 16)
        self.up1 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(16, 8, 1))
        self.dec1 = _double_conv(16, 8)
        self.out = nn.Conv2d(8, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.avg_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.out(d1)


# ---------------------------------------------------------------- LSTM / GRU sequence model
class Recurrent(nn.Module):
    def __init__(self, vocab=50, dim=16, hidden=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, vocab)

    def forward(self, tokens):
        x, _ = self.lstm(self.embed(tokens))
        x, _ = self.gru(x)
        return self.head(x)


# ---------------------------------------------------------------- Llama-style decoder
def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, kv_heads)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab=64, dim=32, depth=2, heads=4, kv_heads=2, hidden=64, max_len=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads, kv_heads, hidden) for _ in range(depth))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        freqs = 1.0 / (10000 ** (torch.arange(half).float() / half))
        angles = torch.outer(torch.arange(max_len).float(), freqs)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        return self.head(self.norm(x))


# ---------------------------------------------------------------- Mixture of experts (top-k routing)
class MoE(nn.Module):
    """Top-k routed experts, dispatched densely (static shapes, as TPU MoE layers do), with a load-balancing loss."""

    def __init__(self, dim=16, hidden=32, experts=4, k=2):
        super().__init__()
        self.k, self.experts = k, experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(-1)
        top, index = probs.topk(self.k, dim=-1)
        gates = torch.zeros_like(probs).scatter(1, index, top / top.sum(-1, keepdim=True))
        hidden = F.gelu(torch.einsum("td,edh->teh", tokens, self.w_in))
        out = torch.einsum("te,teh,ehd->td", gates, hidden, self.w_out)
        load = F.one_hot(index, self.experts).float().sum(1).mean(0)
        self.aux_loss = self.experts * (load * probs.mean(0)).sum()
        return out.reshape(x.shape)


class SparseMoE(MoE):
    """The same experts, dispatched sparsely as PyTorch MoE code usually is: each expert gathers its
    routed tokens (`torch.where` on the routing: a data-dependent shape) and scatters back with index_add_."""

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(-1)
        top, index = probs.topk(self.k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e in range(self.experts):
            token, slot = torch.where(index == e)
            hidden = F.gelu(tokens[token] @ self.w_in[e])
            out.index_add_(0, token, (hidden @ self.w_out[e]) * top[token, slot, None])
        load = F.one_hot(index, self.experts).float().sum(1).mean(0)
        self.aux_loss = self.experts * (load * probs.mean(0)).sum()
        return out.reshape(x.shape)


class MoEModel(nn.Module):
    def __init__(self, vocab=40, dim=16, moe=MoE):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.moe = moe(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.moe(self.norm(x)))


# ---------------------------------------------------------------- the check
def _token_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _moe_loss(model):
    return lambda logits, target: _token_loss(logits, target) + 0.01 * model.moe.aux_loss


FAMILIES = {
    # name: (model, batch (inputs, target), loss, optimizer, (atol, rtol))
    "resnet": (ResNet, lambda: (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))), lambda m: F.cross_entropy,
               lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4), (1e-4, 1e-4)),
    # eps=1e-6: the attention key bias has a mathematically zero gradient (softmax ignores a per-query
    # constant), so with eps=1e-8 Adam's first step turns rounding noise (~1e-9) into steps of +-lr.
    "vit": (ViT, lambda: (torch.randn(3, 3, 16, 16), torch.randint(0, 10, (3,))), lambda m: F.cross_entropy,
            lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-6), (1e-4, 1e-4)),
    "unet": (UNet, lambda: (torch.randn(2, 3, 16, 16), torch.randint(0, 3, (2, 16, 16))), lambda m: F.cross_entropy,
             lambda p: torch.optim.Adam(p, lr=1e-3), (1e-4, 1e-4)),
    "lstm-gru": (Recurrent, lambda: (torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))),
                 lambda m: _token_loss, lambda p: torch.optim.Adam(p, lr=1e-3), (1e-4, 1e-4)),
    "llama": (Llama, lambda: (torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))), lambda m: _token_loss,
              lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1), (1e-4, 1e-4)),
    "moe": (MoEModel, lambda: (torch.randint(0, 40, (3, 8)), torch.randint(0, 40, (3, 8))), _moe_loss,
            lambda p: torch.optim.AdamW(p, lr=1e-3), (1e-4, 1e-4)),
    "moe-sparse": (lambda: MoEModel(moe=SparseMoE),
                   lambda: (torch.randint(0, 40, (3, 8)), torch.randint(0, 40, (3, 8))), _moe_loss, lambda p: torch.optim.AdamW(p, lr=1e-3), (1e-4, 1e-4)),
}
# Families whose shapes depend on values: a step whose routing changes the tokens per expert compiles
# programs for the new sizes (one count-and-synchronise per expert, docs/ops.md "dynamic shapes").
DATA_DEPENDENT_SHAPES = {"moe-sparse"}


def _errors(actual, expected):
    """Max absolute error and the max magnitude of the reference, over matching tensors."""
    pairs = list(zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)))
    error = max(float((a.detach().cpu() - e.detach()).abs().max()) for a, e in pairs)
    scale = max(float(e.detach().abs().max()) for _, e in pairs)
    return error, scale


def run_family(name):
    """Run forward, backward, one optimizer step and a second forward on CPU and tpu; return both sides' results."""
    make_model, make_batch, make_loss, make_optimizer, _ = FAMILIES[name]
    torch.manual_seed(0)
    cpu_model = make_model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    inputs, target = make_batch()
    results = {}
    for side, model, device in (("cpu", cpu_model, "cpu"), ("tpu", tpu_model, "tpu")):
        optimizer = make_optimizer(model.parameters())
        x, y = inputs.to(device), target.to(device)
        out = model(x)
        loss = make_loss(model)(out, y)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        again = model(x)
        results[side] = {"forward": out, "loss": loss, "grads": grads, "params": list(model.parameters()),
                         "buffers": list(model.buffers()), "second forward": again}
    return results


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_family_matches_cpu(name):
    """Forward, loss, gradients, parameters after one optimizer step and a second forward match CPU, natively."""
    fallbacks = dict(metrics.fallbacks)
    results = run_family(name)
    assert dict(metrics.fallbacks) == fallbacks, f"CPU fallbacks: {set(metrics.fallbacks) - set(fallbacks)}"
    atol, rtol = FAMILIES[name][-1]
    for part, expected in results["cpu"].items():
        actual = results["tpu"][part]
        for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)):
            assert a.device.type == "tpu"
            torch.testing.assert_close(a.detach().cpu(), e.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{part}: {m}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_compiled_training_step_matches_cpu(name):
    """torch.compile(backend="tpu") of the whole step (forward, loss, backward, optimizer step): three
    steps give CPU eager's losses, parameters and buffers, through compiled graphs, natively."""
    import torch_tpu.compile

    torch_tpu.compile.register()  # an uninstalled checkout has no entry point
    make_model, make_batch, make_loss, make_optimizer, (atol, rtol) = FAMILIES[name]
    torch.manual_seed(0)
    cpu_model = make_model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    inputs, target = make_batch()
    fallbacks, calls, eager_graphs = dict(metrics.fallbacks), torch_tpu.compile.stats.calls, torch_tpu.compile.stats.eager_graphs
    results = {}
    for device, model in (("cpu", cpu_model), ("tpu", tpu_model)):
        optimizer, loss_fn = make_optimizer(model.parameters()), make_loss(model)

        def step(x, y):
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        if device == "tpu":
            step = torch.compile(step, backend="tpu")
        x, y = inputs.to(device), target.to(device)
        losses = [step(x, y).detach() for _ in range(3)]
        results[device] = {"losses": losses, "params": list(model.parameters()), "buffers": list(model.buffers())}
    assert dict(metrics.fallbacks) == fallbacks, f"CPU fallbacks: {set(metrics.fallbacks) - set(fallbacks)}"
    assert torch_tpu.compile.stats.calls > calls and torch_tpu.compile.stats.eager_graphs == eager_graphs
    for part, expected in results["cpu"].items():
        for a, e in zip(results["tpu"][part], expected):
            assert a.device.type == "tpu"
            torch.testing.assert_close(a.detach().cpu(), e.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{part}: {m}")


@pytest.mark.parametrize("name", [name for name in FAMILIES if name not in DATA_DEPENDENT_SHAPES])
def test_training_steps_do_not_recompile(name):
    """Once warm (two steps: SGD's momentum buffer starts on the second), a training step compiles nothing."""
    make_model, make_batch, make_loss, make_optimizer, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = make_model().to("tpu")
    optimizer = make_optimizer(model.parameters())
    x, y = (t.to("tpu") for t in make_batch())

    def step():
        loss = make_loss(model)(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    step(), step()
    compiled = metrics.counts.programs_compiled
    losses = [step().item() for _ in range(2)]
    assert metrics.counts.programs_compiled == compiled
    assert all(math.isfinite(v) for v in losses)


def test_vit_inference_fast_path_matches_cpu():
    """Eval + no_grad: nn.TransformerEncoder takes PyTorch's fused inference path, natively."""
    torch.manual_seed(0)
    cpu_model = ViT().eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    x = torch.randn(3, 3, 16, 16)
    fallbacks = dict(metrics.fallbacks)
    with torch.no_grad():
        expected, actual = cpu_model(x), tpu_model(x.to("tpu"))
    assert dict(metrics.fallbacks) == fallbacks, f"CPU fallbacks: {set(metrics.fallbacks) - set(fallbacks)}"
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


if __name__ == "__main__":  # measure the errors documented in docs/model-families.md
    import torch_tpu  # noqa: F401

    torch.set_float32_matmul_precision("highest")
    print(f"{'family':10s} {'part':15s} {'max abs error':>14s} {'max |reference|':>16s}")
    for family in FAMILIES:
        measured = run_family(family)
        for part in measured["cpu"]:
            if not pytree.tree_leaves(measured["cpu"][part]):
                continue
            error, scale = _errors(measured["tpu"][part], measured["cpu"][part])
            print(f"{family:10s} {part:15s} {error:14.2e} {scale:16.2e}")
