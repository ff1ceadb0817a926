"""Sparse COO tensors on "tpu" (eager/sparse.py) against PyTorch's CPU sparse tensors.

Every test runs in Strict and in DeferAndFuse (the `mode` fixture), whatever TORCH_TPU_DEFER_AND_FUSE says.
"""
import warnings

import pytest
import torch

import torch_tpu

# one_mode: the `mode` fixture runs every test in Strict and DeferAndFuse itself; CI's DeferAndFuse pass adds nothing.
pytestmark = [pytest.mark.filterwarnings("ignore:Sparse invariant checks"), pytest.mark.one_mode]


@pytest.fixture(params=["strict", "defer_and_fuse"], autouse=True)
def mode(request):
    with torch_tpu.execution_mode(request.param):
        yield request.param


def _dense(shape, seed=0, density=0.4, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    return x * (torch.rand(shape, generator=g) < density)


def _uncoalesced(seed=0, nnz=12, size=(5, 6), dense=()):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randint(0, n, (nnz,), generator=g) for n in size])
    values = torch.randn((nnz,) + dense, generator=g)
    return torch.sparse_coo_tensor(indices, values, size + dense)


def assert_same_sparse(actual, expected, exact=True):
    """actual (tpu) equals expected (CPU) as PyTorch sees sparse tensors: layout, dims, coalesced flag, entries."""
    assert actual.device.type == "tpu"
    assert actual.layout == expected.layout == torch.sparse_coo
    assert (actual.shape, actual.sparse_dim(), actual.dense_dim(), actual.dtype) == \
           (expected.shape, expected.sparse_dim(), expected.dense_dim(), expected.dtype)
    assert actual.is_coalesced() == expected.is_coalesced()
    assert actual._nnz() == expected._nnz()
    assert actual._indices().device.type == "tpu" and actual._values().device.type == "tpu"
    assert torch.equal(actual._indices().cpu(), expected._indices())
    if exact:
        assert torch.equal(actual._values().cpu(), expected._values())
    else:
        torch.testing.assert_close(actual._values().cpu(), expected._values())


@pytest.mark.parametrize("shape,sparse_dim", [((5, 6), None), ((5, 6), 1), ((3, 4, 2), 2), ((7,), None),
                                              ((4, 0), None), ((), None)])
def test_dense_to_sparse_matches_cpu(shape, sparse_dim):
    x = _dense(shape)
    expected = x.to_sparse() if sparse_dim is None else x.to_sparse(sparse_dim)
    xt = x.to("tpu")
    actual = xt.to_sparse() if sparse_dim is None else xt.to_sparse(sparse_dim)
    assert_same_sparse(actual, expected)
    assert torch.equal(actual.to_dense().cpu(), x)


def test_to_sparse_layout_and_dense_dim_keywords():
    x = _dense((4, 3, 2))
    assert_same_sparse(x.to("tpu").to_sparse(layout=torch.sparse_coo, dense_dim=1),
                       x.to_sparse(layout=torch.sparse_coo, dense_dim=1))


def test_sparse_coo_tensor_factory_and_accessors():
    i = torch.tensor([[0, 1, 0, 2], [1, 2, 1, 0]])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = torch.sparse_coo_tensor(i, v, (3, 4))
    actual = torch.sparse_coo_tensor(i, v, (3, 4), device="tpu")
    assert_same_sparse(actual, expected)
    from_tpu = torch.sparse_coo_tensor(i.to("tpu"), v.to("tpu"), (3, 4))  # device from the tensors
    assert_same_sparse(from_tpu, expected)
    assert actual.is_sparse and not actual.is_coalesced()
    with pytest.raises(RuntimeError, match="coalesced"):  # PyTorch's own check, as on CPU
        actual.indices()
    with pytest.raises(RuntimeError, match="coalesced"):
        expected.indices()
    c = actual.coalesce()
    assert torch.equal(c.indices().cpu(), expected.coalesce().indices())
    assert torch.equal(c.values().cpu(), expected.coalesce().values())
    assert c.indices().device.type == "tpu"


@pytest.mark.parametrize("seed,dense", [(0, ()), (1, ()), (2, (3,)), (3, (2, 2))])
def test_coalesce_matches_cpu(seed, dense):
    s = _uncoalesced(seed, dense=dense)
    actual = s.to("tpu").coalesce()
    assert_same_sparse(actual, s.coalesce(), exact=False)  # duplicates summed in another order
    assert actual.coalesce() is actual  # coalesced: coalesce returns self, as on CPU


def test_coalesce_of_small_and_empty():
    for nnz in (0, 1):
        s = _uncoalesced(4, nnz=nnz)
        assert_same_sparse(s.to("tpu").coalesce(), s.coalesce())


def test_to_dense_sums_duplicates():
    s = _uncoalesced(5, nnz=30, size=(3, 4), dense=(2,))
    torch.testing.assert_close(s.to("tpu").to_dense().cpu(), s.to_dense())


def test_transfers_keep_the_sparse_layout():
    s = _uncoalesced(6)
    t = s.to("tpu")
    assert_same_sparse(t, s)
    back = t.cpu()
    assert back.layout == torch.sparse_coo and back.device.type == "cpu"
    assert torch.equal(back._indices(), s._indices()) and torch.equal(back._values(), s._values())
    assert_same_sparse(t.clone(), s.clone())
    d = t.to(torch.float64)
    assert_same_sparse(d, s.to(torch.float64))


def test_printing_a_sparse_tpu_tensor():
    x = _dense((3, 4))
    text = repr(x.to("tpu").to_sparse())
    assert "device='tpu:0'" in text and "layout=torch.sparse_coo" in text
    assert text.replace("device='tpu:0', ", "") == repr(x.to_sparse())


@pytest.mark.parametrize("coalesced", [True, False])
def test_sparse_mm_and_addmm_with_dense_operand(coalesced):
    s = _uncoalesced(7, nnz=15, size=(5, 6))
    if coalesced:
        s = s.coalesce()
    d = torch.randn(6, 3)
    st, dt = s.to("tpu"), d.to("tpu")
    torch.testing.assert_close(torch.sparse.mm(st, dt).cpu(), torch.sparse.mm(s, d))
    torch.testing.assert_close(torch.mm(st, dt).cpu(), torch.mm(s, d))
    a = torch.randn(5, 3)
    torch.testing.assert_close(torch.addmm(a.to("tpu"), st, dt, beta=0.5, alpha=2.0).cpu(),
                               torch.addmm(a, s, d, beta=0.5, alpha=2.0))
    torch.testing.assert_close(torch.sparse.addmm(a.to("tpu"), st, dt).cpu(), torch.sparse.addmm(a, s, d))
    e = torch.randn(4, 5)  # dense @ sparse
    torch.testing.assert_close(torch.mm(e.to("tpu"), st).cpu(), torch.mm(e, s))


def test_sparse_mm_gradient_of_the_dense_operand():
    s = _uncoalesced(8, nnz=10, size=(4, 5))
    d = torch.randn(5, 3, requires_grad=True)
    dt = d.detach().to("tpu").requires_grad_()
    torch.sparse.mm(s, d).pow(2).sum().backward()
    torch.sparse.mm(s.to("tpu"), dt).pow(2).sum().backward()
    torch.testing.assert_close(dt.grad.cpu(), d.grad)


def test_add_dense_and_sparse():
    s = _uncoalesced(9, size=(4, 5))
    d = torch.randn(4, 5)
    st, dt = s.to("tpu"), d.to("tpu")
    torch.testing.assert_close((dt + st).cpu(), d + s)
    torch.testing.assert_close(torch.add(dt, st, alpha=-0.5).cpu(), torch.add(d, s, alpha=-0.5))
    both = (st + st).cpu()
    assert both.layout == torch.sparse_coo
    torch.testing.assert_close(both.to_dense(), (s + s).to_dense())
    dt.add_(st, alpha=2.0)
    torch.testing.assert_close(dt.cpu(), d.add_(s, alpha=2.0))


def test_to_sparse_backward_matches_cpu():
    x = _dense((4, 3), seed=3, density=1.0)
    xt = x.detach().to("tpu").requires_grad_()
    x.requires_grad_()
    x.to_sparse().to_dense().mul(torch.arange(12.0).view(4, 3)).sum().backward()
    xt.to_sparse().to_dense().mul(torch.arange(12.0).view(4, 3).to("tpu")).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


def test_embedding_sparse_gradients_with_sgd():
    torch.manual_seed(0)
    cpu = torch.nn.Embedding(10, 4, sparse=True)
    tpu = torch.nn.Embedding(10, 4, sparse=True)
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    batches = [torch.tensor([[1, 2, 1], [4, 1, 9]]), torch.tensor([[0, 0, 3]])]
    for model, device in ((cpu, "cpu"), (tpu, "tpu")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for idx in batches:
            opt.zero_grad()
            model(idx.to(device)).pow(2).sum().backward()
            opt.step()
    assert tpu.weight.grad.layout == torch.sparse_coo and tpu.weight.grad.device.type == "tpu"
    torch.testing.assert_close(tpu.weight.grad.cpu().to_dense(), cpu.weight.grad.to_dense())
    torch.testing.assert_close(tpu.weight.detach().cpu(), cpu.weight.detach())


def test_sparse_gradients_accumulate_and_sparse_sum():
    """Two backward passes add sparse gradients (sparse += sparse, copy_sparse_to_sparse_); torch.sparse.sum."""
    torch.manual_seed(1)
    cpu = torch.nn.Embedding(10, 3, sparse=True)
    tpu = torch.nn.Embedding(10, 3, sparse=True)
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    for model, device in ((cpu, "cpu"), (tpu, "tpu")):
        for idx in ([1, 2, 1], [2, 3]):
            model(torch.tensor(idx, device=device)).sum().backward()
    torch.testing.assert_close(tpu.weight.grad.cpu().to_dense(), cpu.weight.grad.to_dense())
    s = _uncoalesced(12, size=(3, 4), dense=(2,))
    torch.testing.assert_close(torch.sparse.sum(s.to("tpu")).cpu(), torch.sparse.sum(s))
    torch.testing.assert_close(torch.sparse.sum(s.to("tpu"), 0).cpu().to_dense(), torch.sparse.sum(s, 0).to_dense())


def test_unsupported_sparse_ops_raise_pytorchs_error_not_a_cpu_fallback():
    from torch_tpu import metrics

    before = sum(metrics.fallbacks.values())
    s = _uncoalesced(10).to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU fallback would warn
        with pytest.raises(NotImplementedError, match="Could not run 'aten::sin' with arguments from the 'Sparsetpu'"):
            torch.sin(s)
        with pytest.raises(NotImplementedError, match="sparse @ sparse"):
            torch.mm(s, s.t())
    assert sum(metrics.fallbacks.values()) == before


def test_bad_input_errors_read_like_cpus():
    s, d = _uncoalesced(11, size=(4, 5)), torch.randn(3, 5)
    with pytest.raises(RuntimeError) as cpu_err:
        d + s
    with pytest.raises(RuntimeError) as tpu_err:
        d.to("tpu") + s.to("tpu")
    assert str(tpu_err.value).split(",")[0] == str(cpu_err.value).split(",")[0]
    with pytest.raises(RuntimeError, match="sparse_dim argument must be in"):
        torch.randn(3, 4).to("tpu").to_sparse(0)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.sparse.mm(s.to("tpu"), torch.randn(4, 2).to("tpu"))
    with pytest.raises(NotImplementedError, match="SparseBsr is not supported on the 'tpu' device"):
        torch.randn(4, 4).to("tpu").to_sparse_bsr((2, 2))
    with pytest.raises(NotImplementedError, match="batched or hybrid sparse CSR"):
        torch.randn(2, 3, 4).to_sparse_csr().to("tpu").to_dense()


# ------------------------------------------------------------------ sparse CSR
pytestmark = [*pytestmark, pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]


def assert_same_csr(actual, expected, exact=True):
    assert actual.device.type == "tpu" and actual.layout == expected.layout == torch.sparse_csr
    assert (actual.shape, actual.dtype, actual._nnz()) == (expected.shape, expected.dtype, expected._nnz())
    assert torch.equal(actual.crow_indices().cpu(), expected.crow_indices())
    assert torch.equal(actual.col_indices().cpu(), expected.col_indices())
    if exact:
        assert torch.equal(actual.values().cpu(), expected.values())
    else:
        torch.testing.assert_close(actual.values().cpu(), expected.values())


@pytest.mark.parametrize("shape", [(5, 6), (4, 0), (1, 7)])
def test_dense_to_csr_and_back_matches_cpu(shape):
    x = _dense(shape, seed=12)
    x[0] = 0  # an empty row
    actual = x.to("tpu").to_sparse_csr()
    assert_same_csr(actual, x.to_sparse_csr())
    assert_same_csr(x.to("tpu").to_sparse(layout=torch.sparse_csr), x.to_sparse(layout=torch.sparse_csr))
    assert torch.equal(actual.to_dense().cpu(), x)
    back = actual.cpu()
    assert back.layout == torch.sparse_csr and torch.equal(back.to_dense(), x)
    assert_same_csr(x.to_sparse_csr().to("tpu"), x.to_sparse_csr())


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_sparse_mm_reduce_and_gradients_match_cpu(reduce):
    x = _dense((6, 5), seed=13)
    x[2] = 0
    csr = x.to_sparse_csr().requires_grad_()
    other = torch.randn(5, 4, requires_grad=True)
    csr_t = x.to("tpu").to_sparse_csr().requires_grad_()
    other_t = other.detach().to("tpu").requires_grad_()
    expected = torch.sparse.mm(csr, other, reduce)
    actual = torch.sparse.mm(csr_t, other_t, reduce)
    torch.testing.assert_close(actual.detach().cpu(), expected.detach())
    cotangent = torch.randn(6, 4)
    expected.backward(cotangent)
    actual.backward(cotangent.to("tpu"))
    torch.testing.assert_close(other_t.grad.cpu(), other.grad)
    torch.testing.assert_close(csr_t.grad.cpu().to_dense(), csr.grad.to_dense())


def test_sampled_addmm_matches_cpu():
    x = _dense((5, 6), seed=14)
    m1, m2 = torch.randn(5, 3), torch.randn(3, 6)
    expected = torch.sparse.sampled_addmm(x.to_sparse_csr(), m1, m2, beta=0.2, alpha=0.6)
    actual = torch.sparse.sampled_addmm(x.to("tpu").to_sparse_csr(), m1.to("tpu"), m2.to("tpu"), beta=0.2, alpha=0.6)
    assert_same_csr(actual, expected, exact=False)


def test_csr_mm_with_dense_operands():
    x = _dense((5, 6), seed=15)
    csr, d, e = x.to_sparse_csr(), torch.randn(6, 3), torch.randn(2, 5)
    csr_t = csr.to("tpu")
    torch.testing.assert_close(torch.mm(csr_t, d.to("tpu")).cpu(), torch.mm(csr, d))
    torch.testing.assert_close(torch.mm(e.to("tpu"), csr_t).cpu(), torch.mm(e, csr))
    a = torch.randn(5, 3)
    torch.testing.assert_close(torch.addmm(a.to("tpu"), csr_t, d.to("tpu"), beta=0.5, alpha=2.0).cpu(),
                               torch.addmm(a, csr, d, beta=0.5, alpha=2.0))


def _same_result(fn, *cpu_args):
    """fn on tpu copies of cpu_args gives CPU's result (dense values, dtype, layout) or CPU's error."""
    try:
        expected = fn(*cpu_args)
    except RuntimeError as err:
        with pytest.raises(RuntimeError) as tpu_err:
            fn(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in cpu_args])
        assert str(tpu_err.value) == str(err)
        return
    actual = fn(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in cpu_args])
    assert (actual.layout, actual.dtype, actual.device.type) == (expected.layout, expected.dtype, "tpu")
    to_dense = (lambda t: t.to_dense()) if expected.is_sparse else (lambda t: t)
    torch.testing.assert_close(to_dense(actual).cpu(), to_dense(expected))


@pytest.mark.parametrize("name, fn", [
    ("sparse * sparse", lambda a, b, d: a * b), ("sparse * itself", lambda a, b, d: a * a),
    ("sparse * dense", lambda a, b, d: a * d), ("dense * sparse", lambda a, b, d: d * a),
    ("sparse * broadcast dense", lambda a, b, d: a * d[0]), ("sparse * 2.5", lambda a, b, d: a * 2.5),
    ("sparse * 0-dim", lambda a, b, d: a * d[0, 0]), ("sparse / 2", lambda a, b, d: a / 2),
    ("sparse // 2", lambda a, b, d: torch.div(a, 2, rounding_mode="floor")), ("sparse / dense", lambda a, b, d: a / d),
    ("sparse - sparse", lambda a, b, d: a - b), ("dense - sparse", lambda a, b, d: d - a),
    ("sparse - dense", lambda a, b, d: a - d), ("sparse + 2.0", lambda a, b, d: a + 2.0), ("-sparse", lambda a, b, d: -a),
    ("mul_", lambda a, b, d: a.clone().mul_(b)), ("mul_ 3", lambda a, b, d: a.clone().mul_(3)),
    ("div_", lambda a, b, d: a.clone().div_(4)), ("sub_", lambda a, b, d: a.clone().sub_(b, alpha=2)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_sparse_arithmetic_matches_cpu(name, fn, dtype):
    """sub/mul/div on sparse tpu tensors (PyTorch's test_sparse_{sub,mul,div}, found by running PyTorch's
    test_type_promotion on tpu): sparse * sparse keeps the indices both hold."""
    a = (_uncoalesced(20, dense=(2,)) * 4).to(dtype)
    b = (_uncoalesced(21, dense=(2,)) * 4).to(dtype)
    _same_result(fn, a, b, torch.randn(5, 6, 2).mul(3).to(dtype))


def test_sparse_bool_subtraction_and_uncastable_in_place_raise_pytorchs_error():
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([True, False]), (3,))
    _same_result(lambda a: a - a, s)
    ints = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([3, 4]), (3,))
    _same_result(lambda a: a.clone().div_(2), ints)


_FLOATS = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([2.5, 3.0]), (3,))
_INTS = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([2, 3], dtype=torch.int32), (3,))
_IN_PLACE = {  # case -> (self, the op on a clone of self, other)
    "sparse int += sparse float": (_INTS, lambda a, b: a.clone().add_(b), _FLOATS),
    "sparse int -= sparse float": (_INTS, lambda a, b: a.clone().sub_(b), _FLOATS),
    "sparse int *= sparse float": (_INTS, lambda a, b: a.clone().mul_(b), _FLOATS),
    "sparse int *= 2.5": (_INTS, lambda a, b: a.clone().mul_(2.5), None),
    "sparse int *= 2": (_INTS, lambda a, b: a.clone().mul_(2), None),
    "sparse int /= 2.5": (_INTS, lambda a, b: a.clone().div_(2.5), None),
    "dense int += sparse float": (torch.ones(3, dtype=torch.int32), lambda a, b: a.clone().add_(b), _FLOATS),
    "dense int *= sparse float": (torch.ones(3, dtype=torch.int32), lambda a, b: a.clone().mul_(b), _FLOATS),
    "dense float *= sparse": (torch.ones(3), lambda a, b: a.clone().mul_(b), _FLOATS),
    "dense long += sparse int": (torch.ones(3, dtype=torch.int64), lambda a, b: a.clone().add_(b), _INTS),
}


@pytest.mark.parametrize("case", sorted(_IN_PLACE))
def test_sparse_in_place_results_and_cast_errors_match_cpu(case):
    """In-place sparse arithmetic whose result dtype `self` cannot hold raises CPU's error, in its words (sparse
    int -= sparse float computed; found by PyTorch's test_type_promotion on tpu); dense *= sparse is CPU's dense
    product (it raised a copy_ error)."""
    first, fn, second = _IN_PLACE[case]
    _same_result(fn, first, second)


@pytest.mark.parametrize("op", ["add_", "sub_", "add", "sub"])
def test_sparse_plus_a_number_or_a_dense_tensor_raises_pytorchs_error(op):
    """sparse + 1.5 (a Python number: the .Scalar overloads) and sparse + dense raise CPU's RuntimeError (the in-place
    forms raised an AttributeError of ours; found by PyTorch's test_type_promotion)."""
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([2.0, 3.0]), (3,))
    _same_result(lambda a: getattr(a.clone(), op)(1.5), s)
    _same_result(lambda a, d: getattr(a.clone(), op)(d), s, torch.ones(3))


@pytest.mark.parametrize("coalesced", [False, True])
def test_sparse_mask_and_its_projection_match_cpu(coalesced):
    """sparse_mask (hybrid and zero sparse dims) and _sparse_mask_projection, the op sparse_mask's backward runs."""
    dense = _dense((5, 6, 2), seed=3, density=1.0)
    mask = _uncoalesced(seed=4, nnz=9, dense=(2,))
    mask = mask.coalesce() if coalesced else mask
    assert_same_sparse(dense.to("tpu").sparse_mask(mask.to("tpu")), dense.sparse_mask(mask))
    no_sparse_dims = torch.sparse_coo_tensor(torch.zeros(0, 1, dtype=torch.long), torch.ones(1, 5, 6, 2), (5, 6, 2))
    assert_same_sparse(dense.to("tpu").sparse_mask(no_sparse_dims.to("tpu")), dense.sparse_mask(no_sparse_dims))
    grad = _uncoalesced(seed=5, nnz=14, dense=(2,))
    grad = grad.coalesce() if coalesced else grad
    for accumulate in (False, True):
        assert_same_sparse(grad.to("tpu")._sparse_mask_projection(mask.to("tpu"), accumulate_matches=accumulate),
                           grad._sparse_mask_projection(mask, accumulate_matches=accumulate))
    x = torch.randn(5, 6, 2)
    xt = x.to("tpu").requires_grad_()
    x.requires_grad_()
    x.sparse_mask(mask).to_dense().pow(2).sum().backward()
    xt.sparse_mask(mask.to("tpu")).to_dense().pow(2).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


@pytest.mark.parametrize("coalesced", [True, False])
def test_coo_csr_conversions_match_cpu(coalesced):
    """COO -> CSR (`to_sparse_csr`, `to_sparse(layout=...)`; an uncoalesced tensor is coalesced first) and
    CSR -> COO (`to_sparse()`, `to_sparse(2)`), against CPU."""
    x = _dense((5, 6), seed=13)
    x[1] = 0
    coo = _uncoalesced(9, size=(5, 6)) if not coalesced else x.to_sparse()
    assert_same_csr(coo.to("tpu").to_sparse_csr(), coo.to_sparse_csr(), exact=False)
    assert_same_csr(coo.to("tpu").to_sparse(layout=torch.sparse_csr), coo.to_sparse(layout=torch.sparse_csr), exact=False)
    csr = x.to_sparse_csr()
    for got, expected in ((csr.to("tpu").to_sparse(), csr.to_sparse()), (csr.to("tpu").to_sparse(2), csr.to_sparse(2))):
        assert got.layout == torch.sparse_coo and got.is_coalesced() == expected.is_coalesced()
        assert torch.equal(got._indices().cpu(), expected._indices()) and torch.equal(got._values().cpu(), expected._values())
    with pytest.raises(RuntimeError, match="sparse_dim argument !=2"):
        csr.to("tpu").to_sparse(1)


@pytest.mark.parametrize("case", range(5))
def test_sparse_broadcast_to_matches_cpu(case):
    """torch._sparse_broadcast_to (masked ops broadcast sparse masks with it): new and size-1 sparse dims,
    dense dims, entry order and the coalesced flag as on CPU."""
    bool_mask = torch.tensor([[True, False, True]]).to_sparse()
    s, size = [
        (torch.sparse_coo_tensor(torch.tensor([[0, 0, 0], [0, 2, 1]]), torch.tensor([1.0, 2, 3]), (1, 3)), (2, 2, 3)),
        (torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([[1.0, 2], [3, 4]]), (2, 2)), (3, 2, 2)),
        (torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([[1.0], [3]]), (2, 1)), (2, 4)),
        (bool_mask, (2, 3)),
        (bool_mask, (1, 3)),
    ][case]
    expected, got = torch._sparse_broadcast_to(s, size), torch._sparse_broadcast_to(s.to("tpu"), size)
    assert (got.shape, got.sparse_dim(), got.is_coalesced()) == (expected.shape, expected.sparse_dim(), expected.is_coalesced())
    assert torch.equal(got._indices().cpu(), expected._indices()) and torch.equal(got._values().cpu(), expected._values())
    with pytest.raises(RuntimeError, match="does not broadcast over the requested shape"):
        torch._sparse_broadcast_to(bool_mask.to("tpu"), (2, 4))


def test_csr_sum_prod_and_masked_reductions_with_sparse_masks_match_cpu():
    """`_sparse_csr_sum`/`_sparse_csr_prod` and `torch.sum(csr, dim, keepdim=True)` (over stored entries),
    and torch.masked reductions whose mask is sparse COO or CSR, against CPU."""
    x = torch.tensor([[0.0, 2, 0, 0], [0, 0, 0, 0], [1, 0, 5, 3]])
    for dims in ([0], [1], [0, 1], [-1]):
        for op in (torch.ops.aten._sparse_csr_sum.dim_dtype, torch.ops.aten._sparse_csr_prod.dim_dtype):
            assert_same_csr(op(x.to("tpu").to_sparse_csr(), dims, True), op(x.to_sparse_csr(), dims, True))
        assert_same_csr(torch.sum(x.to("tpu").to_sparse_csr(), dims, keepdim=True),
                        torch.sum(x.to_sparse_csr(), dims, keepdim=True))
    with pytest.raises(RuntimeError, match="keepdim=False is unsupported"):
        torch.ops.aten._sparse_csr_sum.dim_dtype(x.to("tpu").to_sparse_csr(), [0], False)
    for whole in (x, x.to(torch.int32), torch.zeros(0, 3)):  # torch.sum of all entries: a dense 0-d tensor
        for dtype in (None, torch.float64):
            got, expected = whole.to("tpu").to_sparse_csr().sum(dtype=dtype), whole.to_sparse_csr().sum(dtype=dtype)
            assert got.layout == torch.strided and got.dtype == expected.dtype
            torch.testing.assert_close(got.cpu(), expected)
    data = _dense((3, 4), seed=14)
    dense_mask = torch.tensor([[True, False, True, True], [False, False, True, False], [True, True, False, True]])
    for mask in (dense_mask.to_sparse(), dense_mask.to_sparse_csr()):
        for name in ("sum", "prod", "amax", "amin", "mean"):
            fn = getattr(torch.masked, name)
            expected = fn(data, 1, keepdim=True, mask=mask)
            got = fn(data.to("tpu"), 1, keepdim=True, mask=mask.to("tpu"))
            torch.testing.assert_close(got.cpu(), expected, msg=f"{name} {mask.layout}")


@pytest.mark.parametrize("coalesced", [True, False])
def test_conj_of_a_complex_sparse_tensor_matches_cpu(coalesced):
    """`conj()` (ATen's conj_physical for sparse tensors) conjugates the values and keeps the indices."""
    s = _uncoalesced(15, dense=(2,)) * (1 + 2j) if not coalesced else (_dense((4, 5), seed=15) * (1 - 3j)).to_sparse()
    got, expected = s.to("tpu").conj(), s.conj()
    assert got.is_coalesced() == expected.is_coalesced()
    assert torch.equal(got._indices().cpu(), expected._indices()) and torch.equal(got._values().cpu(), expected._values())
