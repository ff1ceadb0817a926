"""jax_op: JAX/Pallas functions as PyTorch operators on tpu tensors (Pallas in interpret mode on CPU).

Results are compared with PyTorch on CPU; zero copies and fusion are asserted on counters.
"""
import functools
import logging

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import torch_tpu
from torch_tpu import metrics
from torch_tpu._internal import pallas as internal_pallas
from torch_tpu._internal.pallas import tpu_torch_pallas
from torch_tpu.eager import defer
from torch_tpu.pallas import jax_op

TPU = torch.device("tpu:0")


def add_vectors_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


# The seeds' example, verbatim apart from the namespace prefix of the decorator.
@torch.tpu.pallas.jax_op("pallas::add_vectors")
def add_vectors(x: jax.Array, y: jax.Array) -> jax.Array:
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(add_vectors_kernel, out_shape)(x, y)


def _scale_shift_kernel(x_ref, o_ref, *, scale, shift):
    o_ref[...] = x_ref[...] * scale + shift


@jax_op("tpu_test_pallas::scale_shift")
def scale_shift(x: jax.Array, scale: float, shift: int = 1) -> jax.Array:
    kernel = functools.partial(_scale_shift_kernel, scale=scale, shift=shift)
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@jax_op("tpu_test_pallas::stats")
def stats(x: jax.Array, dims: tuple[int, ...]):
    """A pytree of outputs: a dict with a nested tuple."""
    return {"mean": jnp.mean(x, axis=dims), "extremes": (jnp.min(x, axis=dims), jnp.max(x, axis=dims))}


def _rms_matmul(x, w, g, eps):
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g
    return normed @ w


@jax_op("tpu_test_pallas::rms_matmul", vjp=True)
def rms_matmul(x: jax.Array, w: jax.Array, g: jax.Array, eps: float = 1e-6) -> jax.Array:
    return _rms_matmul(x, w, g, eps)


def _rms_matmul_torch(x, w, g, eps=1e-6):
    return (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * g) @ w


def test_seed_vector_add_matches_cpu():
    """The seeds' vector-add example runs on tpu tensors and matches CPU."""
    x = torch.tensor([1.0, 2.0, 3.0], device="tpu")
    y = torch.tensor([4.0, 5.0, 6.0], device="tpu")
    z = add_vectors(x, y)
    assert z.device.type == "tpu"
    torch.testing.assert_close(z.cpu(), torch.tensor([1.0, 2.0, 3.0]) + torch.tensor([4.0, 5.0, 6.0]))
    same = torch.ops.pallas.add_vectors(x, y)  # the registered operator
    torch.testing.assert_close(same.cpu(), z.cpu())


def test_interpret_mode_is_counted_and_noticed(caplog):
    """On XLA:CPU the Pallas kernel runs interpreted: one notice, a counter per new operator shape."""
    from torch_tpu.pallas import interpret

    assert interpret.mode() == "hlo" and not interpret.native()
    before = metrics.counts.pallas_interpret
    interpret._noticed = False
    with caplog.at_level(logging.WARNING, logger="torch_tpu.pallas"):
        a = torch.randn(5).to(TPU)
        add_vectors(a, a)
        add_vectors(a, a)  # the same shape: not counted again
        b = torch.randn(6).to(TPU)
        add_vectors(b, b)
    assert metrics.counts.pallas_interpret - before == 2
    assert sum("interpret mode" in r.getMessage() for r in caplog.records) == 1
    assert "pallas_interpret" in metrics.counters() and "interpreted" in metrics.report()


def test_static_arguments_and_defaults():
    """Static float/int arguments are part of the program; defaults come from the signature."""
    x = torch.randn(4, 8)
    t = x.to(TPU)
    torch.testing.assert_close(scale_shift(t, 2.5).cpu(), x * 2.5 + 1)
    torch.testing.assert_close(scale_shift(t, 0.5, shift=3).cpu(), x * 0.5 + 3)
    torch.testing.assert_close(torch.ops.tpu_test_pallas.scale_shift(t, 2.0).cpu(), x * 2.0 + 1)
    assert "float scale" in scale_shift.schema and "int shift=1" in scale_shift.schema


def test_pytree_outputs():
    """A function returning a pytree gives the same pytree of tpu tensors."""
    x = torch.randn(3, 4, 5)
    out = stats(x.to(TPU), (0, 2))
    assert set(out) == {"mean", "extremes"}
    torch.testing.assert_close(out["mean"].cpu(), x.mean((0, 2)))
    torch.testing.assert_close(out["extremes"][0].cpu(), x.amin((0, 2)))
    torch.testing.assert_close(out["extremes"][1].cpu(), x.amax((0, 2)))
    flat = torch.ops.tpu_test_pallas.stats(x.to(TPU), [0, 2])  # the operator returns the leaves
    assert isinstance(flat, list) and len(flat) == 3


def test_multiple_outputs_and_mixed_dtypes():
    """A tuple-annotated function is a multi-output operator; integer outputs keep their dtype."""

    @jax_op("tpu_test_pallas::split_max")
    def split_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.max(x, axis=-1), jnp.argmax(x, axis=-1)

    x = torch.randn(4, 7)
    values, indices = split_max(x.to(TPU))
    torch.testing.assert_close(values.cpu(), x.max(-1).values)
    assert indices.dtype == torch.int64
    assert torch.equal(indices.cpu(), x.argmax(-1))


def test_zero_copy_tensor_and_strided_view():
    """No host transfer for a jax_op call on a tpu tensor or on a strided view of one."""
    base_cpu = torch.randn(6, 8)
    base = base_cpu.to(TPU)
    a, b = base[:, 1], base.t()[3, ::2]  # non-contiguous views (stride 8, then a column of the transpose)
    b2 = base[::2, 3]
    add_vectors(base[:, 0], base[:, 0])  # compile first: programs are counted separately
    add_vectors(b, b2)
    torch.tpu.synchronize()
    metrics.reset()
    z = add_vectors(base[:, 0], a)
    w = add_vectors(b, b2)
    torch.tpu.synchronize()
    c = metrics.counts
    assert (c.h2d_transfers, c.d2h_transfers, c.d2d_transfers) == (0, 0, 0)
    assert c.ops_executed == 2
    torch.testing.assert_close(z.cpu(), base_cpu[:, 0] + base_cpu[:, 1])
    torch.testing.assert_close(w.cpu(), base_cpu.t()[3, ::2] + base_cpu[::2, 3])


def test_inside_defer_and_fuse_one_program():
    """Under DeferAndFuse a jax_op is recorded and traced into the one fused program."""
    a_cpu, b_cpu = torch.randn(4, 8), torch.randn(4, 8)
    a, b = a_cpu.to(TPU), b_cpu.to(TPU)
    torch.tpu.synchronize()
    metrics.reset()
    before = set(defer._executables)
    with torch_tpu.defer_and_fuse():
        c = (a + 1).relu()
        d = scale_shift(add_vectors(c, b), 3.0)
        e = (d * 2).sum()
        value = e.item()
    counts = metrics.counts
    assert counts.ops_deferred == 6  # add, relu, add_vectors, scale_shift, mul, sum
    assert counts.flushes == 1 and counts.fused_executions == 1
    # One fused program (besides DeferAndFuse's reshape of N-d outputs into flat buffers, a bitcast).
    fused = [k for k in set(defer._executables) - before if not (isinstance(k, tuple) and k[0] == "flatten")]
    assert len(fused) == 1
    expected = (((((a_cpu + 1).relu()) + b_cpu) * 3.0 + 1) * 2).sum()
    assert value == pytest.approx(expected.item(), rel=1e-5)


def test_vjp_gradients_match_torch_autograd():
    """vjp=True: gradients of a fused RMSNorm+matmul op match PyTorch autograd of the same function."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    g = torch.randn(8, requires_grad=True)
    xt, wt, gt = (p.detach().to(TPU).requires_grad_() for p in (x, w, g))
    out = rms_matmul(xt, wt, gt)
    (out * torch.arange(3.0, device="tpu")).sum().backward()
    ref = _rms_matmul_torch(x, w, g)
    (ref * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    for p, q in ((xt, x), (wt, w), (gt, g)):
        assert p.grad.device.type == "tpu"
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5)


def test_vjp_only_for_inputs_that_need_it():
    """Only inputs requiring grad get one (the backward operator takes a mask)."""
    x = torch.randn(4, 8, requires_grad=True)
    w, g = torch.randn(8, 3), torch.randn(8)
    xt = x.detach().to(TPU).requires_grad_()
    wt, gt = w.to(TPU), g.to(TPU)
    rms_matmul(xt, wt, gt).sum().backward()
    _rms_matmul_torch(x, w, g).sum().backward()
    assert wt.grad is None and gt.grad is None
    torch.testing.assert_close(xt.grad.cpu(), x.grad, atol=1e-5, rtol=1e-5)


def test_user_backward():
    """backward=: a JAX function (args..., cotangent) -> one gradient per array argument."""

    def square_bwd(x, k, grad):
        return (2 * k * x * grad,)

    @jax_op("tpu_test_pallas::scaled_square", backward=square_bwd)
    def scaled_square(x: jax.Array, k: float) -> jax.Array:
        return k * x * x

    x = torch.randn(5, requires_grad=True)
    xt = x.detach().to(TPU).requires_grad_()
    scaled_square(xt, 3.0).sum().backward()
    (3.0 * x * x).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


def test_autograd_inside_defer_and_fuse():
    """The forward and backward operators of a vjp op are recorded like any op."""
    x = torch.randn(4, 8, requires_grad=True)
    w, g = torch.randn(8, 3, requires_grad=True), torch.randn(8, requires_grad=True)
    params = [p.detach().to(TPU).requires_grad_() for p in (x, w, g)]
    with torch_tpu.defer_and_fuse():
        rms_matmul(*params).square().sum().backward()
        grads = [p.grad.cpu() for p in params]
    _rms_matmul_torch(x, w, g).square().sum().backward()
    for got, p in zip(grads, (x, w, g)):
        torch.testing.assert_close(got, p.grad, atol=1e-4, rtol=1e-4)


def test_torch_compile_traces_through_fake():
    """Dynamo/AOTAutograd trace the op through its fake implementation (jax.eval_shape)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, y):
        return add_vectors(x * 2, y) + 1

    x, y = torch.randn(6), torch.randn(6)
    out = f(x.to(TPU), y.to(TPU))
    torch.testing.assert_close(out.cpu(), x * 2 + y + 1)
    assert any("add_vectors" in s for s in seen)


def test_inside_torch_compile_one_program():
    """Under torch.compile(backend="tpu") a jax_op is part of the graph's one XLA program."""
    import torch_tpu.compile
    from torch_tpu.compile import graph

    torch_tpu.compile.register()

    @torch.compile(backend="tpu", fullgraph=True)
    def f(x, y):
        return scale_shift(add_vectors((x * 2).relu(), y), 3.0).sum(-1)

    x_cpu, y_cpu = torch.randn(4, 8), torch.randn(4, 8)
    x, y = x_cpu.to(TPU), y_cpu.to(TPU)
    torch.tpu.synchronize()
    graph.stats.reset()
    metrics.reset()
    out = f(x, y).cpu()
    expected = (((x_cpu * 2).relu() + y_cpu) * 3.0 + 1).sum(-1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert graph.stats.graphs == 1 and graph.stats.plans == 1 and graph.stats.eager_graphs == 0
    assert metrics.counts.ops_executed == 0  # nothing ran op by op: the graph is one program


def test_fake_tensor_shapes():
    """The fake implementation gives shapes and dtypes without running anything."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 4, 5, device="tpu")
        out = torch.ops.tpu_test_pallas.stats(x, [1])
    assert [tuple(o.shape) for o in out] == [(3, 5)] * 3


def test_errors_cpu_mixed_value_dependent_and_names():
    """Clear errors: CPU tensors, mixed devices, value-dependent shapes, bad names and signatures."""
    with pytest.raises(RuntimeError, match="runs on 'tpu' tensors"):
        add_vectors(torch.ones(3), torch.ones(3))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        add_vectors(torch.ones(3, device="tpu"), torch.ones(3))

    @jax_op("tpu_test_pallas::nonzero")
    def nonzero(x: jax.Array) -> jax.Array:
        return jnp.nonzero(x)[0]

    with pytest.raises(RuntimeError, match="depends on the values"):
        nonzero(torch.ones(3, device="tpu"))
    with pytest.raises(ValueError, match="exactly one '::'"):
        jax_op("no_namespace")(lambda x: x)
    with pytest.raises(RuntimeError, match="already defined"):
        jax_op("pallas::add_vectors")(lambda x: x)
    with pytest.raises(TypeError, match="parameters are not supported"):
        jax_op("tpu_test_pallas::varargs")(lambda *xs: xs[0])
    with pytest.raises(TypeError, match="must return arrays"):
        bad = jax_op("tpu_test_pallas::returns_int")(lambda x: 3)
        bad(torch.ones(2, device="tpu"))


def test_tensor_list_and_optional_arguments():
    """Sequence[jax.Array] and Optional[jax.Array] parameters."""
    from typing import Optional, Sequence

    @jax_op("tpu_test_pallas::weighted_sum")
    def weighted_sum(xs: Sequence[jax.Array], bias: Optional[jax.Array] = None) -> jax.Array:
        total = sum(xs)
        return total if bias is None else total + bias

    parts = [torch.randn(3) for _ in range(3)]
    bias = torch.randn(3)
    tpu_parts = [p.to(TPU) for p in parts]
    torch.testing.assert_close(weighted_sum(tpu_parts).cpu(), sum(parts))
    torch.testing.assert_close(weighted_sum(tpu_parts, bias.to(TPU)).cpu(), sum(parts) + bias)


# ------------------------------------------------------------------ the TorchTPU faces
def test_internal_jax_op_face_with_mesh_and_donation():
    """torch_tpu._internal.pallas.jax_op: donate_argnums checked, mesh + partition specs via shard_map."""
    from jax.sharding import PartitionSpec as P

    mesh = torch.tpu.pallas.get_pallas_mesh(("x",))
    assert mesh.shape == {"x": 1}

    @internal_pallas.jax_op("tpu_test_pallas::sharded_add", mesh=mesh, input_partition_specs=(P("x"), P("x")),
                            output_partition_specs=P("x"), donate_argnums=(0,))
    def sharded_add(x: jax.Array, y: jax.Array) -> jax.Array:
        return x + 2 * y

    x, y = torch.randn(8), torch.randn(8)
    xt = x.to(TPU)
    torch.testing.assert_close(sharded_add(xt, y.to(TPU)).cpu(), x + 2 * y)
    torch.testing.assert_close(xt.cpu(), x)  # a donated argument stays valid here
    with pytest.raises(ValueError, match="donate_argnums"):
        internal_pallas.jax_op("tpu_test_pallas::bad_donation", lambda x, k=2: x * k, donate_argnums=(1,))


def test_custom_jax_kernel_static_argnums():
    """The deprecated custom_jax_kernel: unannotated functions, static arguments by position."""

    def ragged_scale(x, y, k):
        return x * k + y

    with pytest.warns(DeprecationWarning):
        kernel = internal_pallas.custom_jax_kernel(ragged_scale, static_argnums=(2,))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(kernel(x.to(TPU), y.to(TPU), 3).cpu(), x * 3 + y)
    torch.testing.assert_close(kernel(x.to(TPU), y.to(TPU), 0.5).cpu(), x * 0.5 + y)  # float: another operator


@pytest.mark.parametrize("donation", ["none", "donate_argnums", "input_output_aliases"])
def test_tpu_torch_pallas_contract(donation):
    """Inductor's contract: a jax.export module registered, looked up and called on tpu tensors matches CPU."""
    S = jax.ShapeDtypeStruct

    def kernel(a, b):
        return a * 2 + b, jnp.sum(a, axis=0)

    exported = jax.export.export(jax.jit(kernel), platforms=["tpu"])(S((3, 4), jnp.float32), S((3, 4), jnp.float32))
    name, key = "test_kernel", "out_3_4x4_in_3_4x3_4"
    if not tpu_torch_pallas.lookup_custom_kernel(name, key):
        tpu_torch_pallas.register_custom_kernel(name, key, serialized_mlir_module=exported.mlir_module_serialized)
    assert tpu_torch_pallas.lookup_custom_kernel(name, key)
    assert not tpu_torch_pallas.lookup_custom_kernel(name, "other")
    a, b = torch.randn(3, 4), torch.randn(6, 4)
    at, bt = a.to(TPU), b.to(TPU)
    outs = [torch.empty(3, 4, device="tpu"), torch.empty(4, device="tpu")]
    options = {"none": {}, "donate_argnums": {"donate_argnums": [0]},
               "input_output_aliases": {"input_output_aliases": {0: 0}}}[donation]
    metrics.reset()
    results = tpu_torch_pallas.call_custom_kernel(name, key, inputs=[at, bt[::2]], output_shapes=outs, **options)
    torch.tpu.synchronize()
    assert (metrics.counts.h2d_transfers, metrics.counts.d2h_transfers) == (0, 0)
    assert all(r.device.type == "tpu" for r in results)
    torch.testing.assert_close(results[0].cpu(), a * 2 + b[::2])
    torch.testing.assert_close(results[1].cpu(), a.sum(0))
    with pytest.raises(KeyError, match="no kernel registered"):
        tpu_torch_pallas.call_custom_kernel(name, "missing", inputs=[at, at], output_shapes=outs)
    with pytest.raises(ValueError, match="out of range"):
        tpu_torch_pallas.call_custom_kernel(name, key, inputs=[at, at], output_shapes=outs, donate_argnums=[5])


def test_docs_examples_run():
    """Every Python block of docs/kernels.md runs (each checks its results against PyTorch on CPU)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "kernels.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3
    namespace = {}
    for block in blocks:
        exec(compile(block, "docs/kernels.md", "exec"), namespace)


@pytest.mark.heavy
def test_inductor_pallas_codegen_reaches_tpu_torch_pallas():
    """Inductor itself on tpu tensors (the default backend's routing to "tpu" switched off): its Pallas code
    registers, looks up and calls its kernel through tpu_torch_pallas; on XLA:CPU its Mosaic TPU kernel gets
    a clear error (it runs on a TPU)."""
    import torch._dynamo

    from torch_tpu.compile import routing

    torch._dynamo.reset()

    @torch.compile
    def f(x, y):
        return (x * 2 + y).relu()

    x = torch.randn(8, 128).to(TPU)
    before = set(tpu_torch_pallas._modules)
    routed = routing.installed()
    routing.uninstall()
    try:
        with pytest.raises(Exception, match="compiled Mosaic TPU kernel"):
            f(x, x)
    finally:
        if routed:
            routing.install()
    assert len(set(tpu_torch_pallas._modules) - before) == 1  # register_custom_kernel was called
    torch._dynamo.reset()
    # Inductor's code turned jax_enable_x64 off for the process; tpu_torch_pallas turned it back on.
    assert jax.config.jax_enable_x64
    big = torch.tensor([2**40, 3], dtype=torch.int64)
    assert (big.to(TPU) * 2).cpu().tolist() == [2**41, 6]


def test_env_vars_pallas_interpret_and_kernels(monkeypatch):
    """TORCH_TPU_PALLAS_INTERPRET and TORCH_TPU_KERNELS are read and validated."""
    from torch_tpu.config import reload
    from torch_tpu.kernels import routing
    from torch_tpu.pallas import interpret

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 3

    @jax_op("tpu_test_pallas::never_interpreted")
    def triple(x: jax.Array) -> jax.Array:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    try:
        monkeypatch.setenv("TORCH_TPU_PALLAS_INTERPRET", "0")
        reload()
        assert interpret.mode() is None
        with pytest.raises(Exception, match="interpret mode"):  # Pallas's own error: XLA:CPU cannot compile it
            triple(torch.ones(4).to(TPU)).cpu()  # .cpu(): under DeferAndFuse the program runs (and fails) here
        monkeypatch.setenv("TORCH_TPU_PALLAS_INTERPRET", "tpu")
        reload()
        assert interpret.mode() == "tpu"
        # A new shape: the mode is read when a program is traced (it is fixed per process outside tests).
        torch.testing.assert_close(triple(torch.ones(5).to(TPU)).cpu(), torch.full((5,), 3.0))
        monkeypatch.setenv("TORCH_TPU_KERNELS", "always")
        reload()
        assert routing.policy() == "always" and routing.use_kernels()
        monkeypatch.setenv("TORCH_TPU_KERNELS", "sometimes")
        with pytest.raises(ValueError, match="TORCH_TPU_KERNELS"):
            reload()
    finally:
        monkeypatch.delenv("TORCH_TPU_PALLAS_INTERPRET", raising=False)
        monkeypatch.delenv("TORCH_TPU_KERNELS", raising=False)
        reload()
    assert interpret.mode() == "hlo" and not routing.use_kernels()


def test_symbolic_sizes_are_refused():
    """Dynamic shapes (SymInt sizes) get a clear error: a kernel's shapes are static."""
    import torch._dynamo

    torch._dynamo.reset()

    @torch.compile(backend=lambda gm, inputs: gm.forward, dynamic=True, fullgraph=True)
    def f(x):
        return add_vectors(x, x)

    with pytest.raises(Exception, match="needs static shapes"):
        f(torch.ones(7).to(TPU))
    torch._dynamo.reset()
