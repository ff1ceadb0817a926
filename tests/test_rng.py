"""Random numbers: seeded by torch.manual_seed, reproducible, (seed, offset) as runtime inputs."""
import pytest
import torch

import torch_tpu
from torch_tpu import metrics


def _draw():
    return [torch.rand(5, device="tpu"), torch.randn(3, 2, device="tpu"),
            torch.randint(0, 10, (6,), device="tpu"), torch.randperm(7, device="tpu")]


def test_same_seed_same_numbers():
    """torch.manual_seed(s) makes every tpu random op repeat its numbers."""
    torch.manual_seed(123)
    a = [t.cpu() for t in _draw()]
    torch.manual_seed(123)
    b = [t.cpu() for t in _draw()]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    torch.manual_seed(124)
    c = torch.rand(5, device="tpu").cpu()
    assert not torch.equal(a[0], c)


def test_consecutive_draws_differ_without_recompiling():
    """Each call advances the generator offset; the compiled program is reused."""
    torch.manual_seed(0)
    torch.rand(1000, device="tpu").cpu()  # warm-up, materialized (DeferAndFuse runs it here)
    compiled = metrics.counts.programs_compiled
    draws = [torch.rand(1000, device="tpu").cpu() for _ in range(5)]
    assert metrics.counts.programs_compiled == compiled
    for i in range(4):
        assert not torch.equal(draws[i], draws[i + 1])


def test_distributions_are_sane():
    """rand in [0,1), randn ~ N(0,1), randint in range, randperm a permutation, bernoulli rate."""
    torch.manual_seed(1)
    u = torch.rand(20000, device="tpu").cpu()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
    n = torch.randn(20000, device="tpu").cpu()
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03
    r = torch.randint(3, 9, (1000,), device="tpu").cpu()
    assert r.min() >= 3 and r.max() <= 8 and r.dtype == torch.int64
    p = torch.randperm(50, device="tpu").cpu()
    assert sorted(p.tolist()) == list(range(50))
    b = torch.bernoulli(torch.full((20000,), 0.3, device="tpu")).cpu()
    assert abs(b.mean() - 0.3) < 0.02
    d = torch.nn.functional.dropout(torch.ones(20000, device="tpu"), 0.25).cpu()
    assert abs((d == 0).float().mean() - 0.25) < 0.02 and abs(d.max() - 4 / 3) < 1e-5


def test_generator_objects_and_state():
    """torch.Generator(device='tpu'), get/set_rng_state, per-device default generators."""
    g = torch.Generator(device="tpu").manual_seed(7)
    a = torch.rand(4, device="tpu", generator=g).cpu()
    g.manual_seed(7)
    assert torch.equal(a, torch.rand(4, device="tpu", generator=g).cpu())
    torch.manual_seed(3)
    state = torch.tpu.get_rng_state()
    x = torch.rand(3, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(x, torch.rand(3, device="tpu").cpu())
    assert torch.tpu.initial_seed() == 3
    torch.tpu.manual_seed_all(11)
    assert all(g.initial_seed() == 11 for g in torch.tpu.default_generators)
    with pytest.raises(RuntimeError, match="generator"):
        torch.rand(2, device="tpu", generator=torch.Generator())


def test_devices_have_independent_generators():
    """Seeding device 1 does not change device 0's stream."""
    torch.manual_seed(5)
    a0 = torch.rand(3, device="tpu:0").cpu()
    torch.manual_seed(5)
    torch.tpu.default_generators[1].manual_seed(99)
    b0 = torch.rand(3, device="tpu:0").cpu()
    assert torch.equal(a0, b0)
    assert torch_tpu.__name__


@pytest.mark.parametrize("draw, dtype, n", [
    (lambda out: torch.randperm(7, out=out, device="tpu"), torch.int64, 7),
    (lambda out: torch.normal(torch.zeros(4, device="tpu"), 1.0, out=out), torch.float32, 4)],
    ids=["randperm", "normal"])
def test_an_out_resized_by_its_first_run_draws_the_calls_numbers(draw, dtype, n):
    """A random op whose out= is resized runs its program again: it takes one offset, not two, so it draws
    what the same call with a sized out= draws (PyTorch's test_randperm compares the two under fork_rng)."""
    state = torch.tpu.get_rng_state()
    sized = draw(torch.empty(n, dtype=dtype, device="tpu"))
    after_sized = torch.tpu.get_rng_state()
    torch.tpu.set_rng_state(state)
    resized = draw(torch.empty(0, dtype=dtype, device="tpu"))
    assert torch.equal(resized.cpu(), sized.cpu())
    assert torch.equal(torch.tpu.get_rng_state(), after_sized)
