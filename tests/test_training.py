"""Training on tpu matches the same training on CPU; optimizer steps do not recompile."""
import copy
import os
import sys

import pytest
import torch

from torch_tpu import metrics

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, GPTConfig  # noqa: E402


def _mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.0), torch.nn.Linear(64, 5),
    )


def _mlp_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _gpt():
    return GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=2, n_embd=32))


def _gpt_loss(model, batch):
    return model(*batch)[1]


def _train(model, make_opt, loss_fn, batches, device):
    model = model.to(device)
    opt = make_opt(model.parameters())
    losses, compiled_after = [], []
    for batch in batches:
        batch = tuple(t.to(device) for t in batch)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        compiled_after.append(metrics.counts.programs_compiled)
    return losses, compiled_after, model


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam_scheduled": lambda p: torch.optim.Adam(p, lr=1e-3),
}


def _batches(kind, steps=20):
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(steps)]
    return [(torch.randint(0, 40, (4, 32), generator=g), torch.randint(0, 40, (4, 32), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_training_matches_cpu(kind, optimizer):
    """20 steps on tpu give CPU's losses within 1e-4 relative, and final parameters match."""
    torch.manual_seed(0)
    model = _mlp() if kind == "mlp" else _gpt()
    loss_fn = _mlp_loss if kind == "mlp" else _gpt_loss
    batches = _batches(kind)
    cpu_losses, _, cpu_model = _train(copy.deepcopy(model), OPTIMIZERS[optimizer], loss_fn, batches, "cpu")
    tpu_losses, compiled, tpu_model = _train(copy.deepcopy(model), OPTIMIZERS[optimizer], loss_fn, batches, "tpu")
    for step, (c, t) in enumerate(zip(cpu_losses, tpu_losses)):
        assert abs(t - c) <= 1e-4 * abs(c), f"step {step}: tpu {t} vs cpu {c}"
    assert min(cpu_losses[1:]) < cpu_losses[0]  # it actually trained
    for (name, p_cpu), p_tpu in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu, atol=1e-4, rtol=1e-4, msg=name)
    # Optimizer steps (and everything else) reuse their programs after step 2.
    assert compiled[-1] == compiled[2], f"recompiled after step 2: {compiled}"


def test_lr_schedule_does_not_recompile():
    """A learning-rate schedule changes a Python float each step: still no new programs."""
    torch.manual_seed(0)
    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    batches = _batches("mlp", 8)
    counts = []
    for x, y in batches:
        opt.zero_grad()
        _mlp_loss(model, (x.to("tpu"), y.to("tpu"))).backward()
        opt.step()
        sched.step()
        counts.append(metrics.counts.programs_compiled)
    assert counts[-1] == counts[2], counts


def test_grad_clipping_and_tied_weights():
    """clip_grad_norm_ works natively; tied weights stay tied after .to('tpu')."""
    torch.manual_seed(0)
    model = _gpt()
    tpu = copy.deepcopy(model).to("tpu")
    assert tpu.head.weight is tpu.tok_emb.weight
    x, y = _batches("gpt", 1)[0]
    results = []
    for m, dev in ((model, "cpu"), (tpu, "tpu")):
        loss = _gpt_loss(m, (x.to(dev), y.to(dev)))
        loss.backward()
        results.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).item())
    assert results[1] == pytest.approx(results[0], rel=1e-5)


def test_backward_on_second_device():
    """Autograd on tpu:2 computes the right gradient (the native guard knows every device)."""
    x = torch.randn(5, 3)
    w = torch.randn(3, 2, requires_grad=True)
    (x @ w).tanh().sum().backward()
    wt = w.detach().to("tpu:2").requires_grad_()
    (x.to("tpu:2") @ wt).tanh().sum().backward()
    assert wt.grad.device == torch.device("tpu:2")
    torch.testing.assert_close(wt.grad.cpu(), w.grad)
