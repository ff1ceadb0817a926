"""fused=True optimizers on tpu (aten._fused_adam(w)_/_fused_sgd_/_fused_adagrad_): one program, no CPU
fallback, the same parameters and state as PyTorch's fused CPU kernels."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TPU, no_fallback

SHAPES = [(4, 3), (7,)]

CASES = [
    (torch.optim.AdamW, dict(weight_decay=0.1)),
    (torch.optim.AdamW, dict(amsgrad=True, maximize=True)),
    (torch.optim.Adam, dict(weight_decay=0.1, amsgrad=True)),
    (torch.optim.Adam, dict(lr=torch.tensor(0.01))),  # the tensor_lr overload
    (torch.optim.SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.1)),
    (torch.optim.SGD, dict(momentum=0.9, dampening=0.1, maximize=True)),
    (torch.optim.SGD, dict()),  # no momentum buffers
    (torch.optim.Adagrad, dict(lr_decay=0.1, weight_decay=0.1)),
]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _pair(cls, kwargs):
    base = _params()
    cpu = [p.clone().requires_grad_() for p in base]
    tpu = [p.to(TPU).requires_grad_() for p in base]
    kwargs = dict(kwargs)
    lr = kwargs.pop("lr", 0.01)
    tpu_lr = lr.to(TPU) if isinstance(lr, torch.Tensor) and cls is not torch.optim.Adam else lr
    return cpu, tpu, cls(cpu, lr=lr, fused=True, **kwargs), cls(tpu, lr=tpu_lr, fused=True, **kwargs)


def _set_grads(cpu, tpu, seed):
    # Gradients set directly: the comparison is of the optimizer step alone.
    g = torch.Generator().manual_seed(seed)
    for a, b in zip(cpu, tpu):
        grad = torch.randn(a.shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.to(TPU)


def _assert_same(cpu, tpu, cpu_opt, tpu_opt):
    for a, b in zip(cpu, tpu):
        assert b.device.type == "tpu"
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.grad.cpu(), a.grad)
        sa, sb = cpu_opt.state[a], tpu_opt.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert sb[key].device.type == "tpu"
                torch.testing.assert_close(sb[key].cpu(), sa[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls,kwargs", CASES, ids=[f"{c.__name__}-{'-'.join(k) or 'plain'}" for c, k in CASES])
def test_fused_step_matches_cpu_fused(cls, kwargs):
    cpu, tpu, cpu_opt, tpu_opt = _pair(cls, kwargs)
    with no_fallback():
        for step in range(3):
            _set_grads(cpu, tpu, step)
            cpu_opt.step()
            tpu_opt.step()
    _assert_same(cpu, tpu, cpu_opt, tpu_opt)


def test_fused_adamw_with_grad_scaler_skips_inf_step_like_cpu():
    cpu, tpu, cpu_opt, tpu_opt = _pair(torch.optim.AdamW, dict(weight_decay=0.1))
    scalers = torch.amp.GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("tpu", init_scale=4.0)
    with no_fallback():
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            grads = [torch.randn(s, generator=g) for s in SHAPES]
            if step == 1:  # an overflow: this step is skipped and the scale backs off
                grads[0][0, 0] = float("inf")
            for params, opt, scaler in zip((cpu, tpu), (cpu_opt, tpu_opt), scalers):
                opt.zero_grad()
                device = params[0].device
                loss = sum((p * grad.to(device)).sum() for p, grad in zip(params, grads))  # d loss/dp = grad
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == 4.0 * 0.5 * 1.0
    _assert_same(cpu, tpu, cpu_opt, tpu_opt)
    assert cpu_opt.state[cpu[0]]["step"].item() == tpu_opt.state[tpu[0]]["step"].item() == 2


def test_fused_low_precision_params_match_cpu():
    """bfloat16 parameters and state: computed in float32 and rounded once, like the CPU kernel."""
    base = _params()
    cpu = [p.to(torch.bfloat16).requires_grad_() for p in base]
    tpu = [p.to(torch.bfloat16).to(TPU).requires_grad_() for p in base]
    cpu_opt = torch.optim.AdamW(cpu, lr=0.01, fused=True)
    tpu_opt = torch.optim.AdamW(tpu, lr=0.01, fused=True)
    with no_fallback():
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            for a, b in zip(cpu, tpu):
                grad = torch.randn(a.shape, generator=g).to(torch.bfloat16)
                a.grad, b.grad = grad.clone(), grad.to(TPU)
            cpu_opt.step()
            tpu_opt.step()
    for a, b in zip(cpu, tpu):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1.6e-2, atol=1e-2)


def test_fused_adamw_step_is_one_program_in_strict():
    """The whole update of every parameter is one executed op (plus the step-count increment), and a
    new learning rate (a scheduler's) is a run-time value: no recompilation."""
    import torch_tpu
    from torch_tpu import metrics

    if torch_tpu.get_execution_mode() != "strict":
        pytest.skip("counts Strict op launches; DeferAndFuse records the step into its fused program")
    cpu, tpu, cpu_opt, tpu_opt = _pair(torch.optim.AdamW, dict(weight_decay=0.1))
    with no_fallback():
        for step in range(3):
            _set_grads(cpu, tpu, step)
            for opt in (cpu_opt, tpu_opt):
                opt.param_groups[0]["lr"] = 0.01 / (step + 1)
            before, compiled = metrics.counts.ops_executed, metrics.counts.programs_compiled
            tpu_opt.step()
            cpu_opt.step()
    assert metrics.counts.ops_executed - before == 2  # _foreach_add_(state_steps, 1), _fused_adamw_
    assert metrics.counts.programs_compiled == compiled
    _assert_same(cpu, tpu, cpu_opt, tpu_opt)
