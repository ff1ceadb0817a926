"""TorchTitan's `--compile.enable` path compiles fully on "tpu" (docs/torchtitan.md).

In one process, without its trainer: the llama3 debug model (TorchTitan's own classes and
`llama3_args["debugmodel"]`), each TransformerBlock compiled with backend "tpu" and fullgraph
as TorchTitan's `apply_compile` does, and its compiled loss. One forward and backward: no graph
runs op by op in eager (`torch_tpu.compile.stats.eager_graphs`), and the loss and every gradient
match the same model's PyTorch CPU eager run (RoPE's complex multiply: its backward takes `_conj`).
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan", reason="TorchTitan is the `titan` extra (make install installs it)")

import torch_tpu.compile  # noqa: E402
from torch_tpu.compile.graph import stats  # noqa: E402


@pytest.mark.heavy
def test_torchtitan_compiled_blocks_and_loss_run_without_eager_graphs():
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.llama3.infra.parallelize import apply_compile
    from torchtitan.config.job_config import Compile

    torch_tpu.compile.register()  # an uninstalled checkout has no entry point
    torch.manual_seed(0)
    args = copy.deepcopy(llama3_args["debugmodel"])
    args.max_seq_len = 32
    ref = Transformer(args)
    with torch.no_grad():
        ref.init_weights()
    model = copy.deepcopy(ref).to("tpu")
    apply_compile(model, Compile(enable=True, backend="tpu"))
    loss_fn = torch.compile(cross_entropy_loss, backend="tpu")

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 32), generator=g)

    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # compared with CPU float32
    try:
        before = stats.as_dict()
        loss = loss_fn(model(tokens.to("tpu")), labels.to("tpu"))
        loss.backward()
        got = {n.replace("._orig_mod", ""): p.grad.cpu() for n, p in model.named_parameters()}
        after = stats.as_dict()
    finally:
        torch.set_float32_matmul_precision(prec)
    want = cross_entropy_loss(ref(tokens), labels)
    want.backward()

    assert after["eager_graphs"] == before["eager_graphs"], "a compiled TorchTitan graph ran op by op in eager"
    # forward and backward of the blocks and of the loss, each a planned program
    assert after["plans"] - before["plans"] >= 4 and after["calls"] - before["calls"] >= 2 * args.n_layers + 2
    torch.testing.assert_close(loss.detach().cpu(), want.detach(), rtol=1e-4, atol=1e-3)
    # every parameter's gradient, the attention's wq/wk through RoPE's complex multiply included
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
