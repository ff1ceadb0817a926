"""torch_tpu.numerics.compare and `torch-tpu numerics`: per-layer error of a model on tpu against CPU."""
from __future__ import annotations

import textwrap

import pytest
import torch

from torch_tpu import cli, numerics, precision
from examples.gpt import GPT, GPTConfig


def small_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    return model, torch.randint(0, 96, (2, 16))


def test_gpt_table_per_layer():
    """The demo GPT gives one row per module that ran, in run order, with bf16-level error at "medium"."""
    model, idx = small_gpt()
    result = numerics.compare(model, idx, precision="medium")
    names = [row.name for row in result.layers]
    assert names[0] == "tok_emb" and names[-1] == ""  # run order: the model itself finishes last
    for name in ("blocks.0.attn.qkv", "blocks.0.mlp.0", "blocks.1.ln2", "head"):
        assert name in names
    assert result["blocks.0.attn.qkv"].kind == "Linear"
    assert result["blocks.0.attn.qkv"].shape == (2, 16, 96)
    assert result["tok_emb"].rel_error == 0.0  # a gather is exact
    assert 1e-4 < result.output.rel_error < 3e-2
    text = str(result)
    assert "rel err medium" in text and "blocks.0.attn.qkv" in text and "(model)" in text
    assert len(text.splitlines()) == len(result.layers) + 3  # title, header, rule, one line per row


def test_levels_order_errors():
    """The model's error falls from "medium" to "high" to "highest" (float32-level)."""
    model, idx = small_gpt()
    errors = {level: numerics.compare(model, idx, precision=level).output.rel_error
              for level in ("medium", "high", "highest")}
    assert errors["highest"] < 1e-5
    assert errors["highest"] < errors["high"] < errors["medium"]
    assert errors["high"] < errors["medium"] / 20


def test_current_level_and_reference_float32():
    """precision=None uses the current level; a float32 reference runs CPU matmuls at full precision."""
    model, idx = small_gpt()
    torch.set_float32_matmul_precision("medium")  # CPU float32 would run bf16 matmuls too, but not the reference
    with precision.use("highest"):
        result = numerics.compare(model, idx, reference=torch.float32)
    assert (result.precision, result.source, result.reference) == ("highest", "torch_tpu.precision.use", torch.float32)
    assert result.output.rel_error < 1e-5
    assert torch.get_float32_matmul_precision() == "medium"


def test_autocast_run():
    """autocast= runs the tpu copy under torch.autocast: bfloat16-level errors."""
    model, idx = small_gpt()
    result = numerics.compare(model, idx, autocast=torch.bfloat16)
    assert result.autocast == torch.bfloat16
    assert "autocast bfloat16" in str(result)
    assert 1e-3 < result["blocks.0.attn.qkv"].rel_error < 3e-2


def test_model_is_not_changed():
    """compare copies the model: parameters stay where they were, in training mode."""
    model, idx = small_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    numerics.compare(model, idx)
    assert model.training
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, before[k])


def test_table_side_by_side_and_depth():
    """table() puts comparisons side by side; max_depth keeps the top modules."""
    model, idx = small_gpt()
    runs = [numerics.compare(model, idx, precision=level) for level in ("medium", "highest")]
    text = numerics.table(*runs, max_depth=1)
    assert "rel err medium" in text and "rel err highest" in text
    assert "blocks.0.attn" not in text and "head" in text and "(model)" in text


def test_bad_reference():
    """Only float64 and float32 references exist."""
    model, idx = small_gpt()
    with pytest.raises(ValueError, match="reference"):
        numerics.compare(model, idx, reference=torch.float16)


@pytest.mark.one_mode
def test_cli_runs_demo_gpt(capsys):
    """`torch-tpu numerics` prints the per-layer table of the demo GPT, one column per precision."""
    code = cli.main(["numerics", "--layers", "1", "--embd", "32", "--heads", "2", "--seq", "16",
                     "--precision", "medium,highest", "--autocast", "bfloat16", "--depth", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "rel err medium" in out and "rel err highest" in out and "autocast bfloat16" in out
    assert "tok_emb" in out and "(model)" in out


@pytest.mark.one_mode
def test_cli_runs_user_factory(tmp_path, capsys):
    """`torch-tpu numerics FILE.py:FACTORY` compares the user's model."""
    script = tmp_path / "mlp.py"
    script.write_text(textwrap.dedent("""
        import torch

        def make():
            torch.manual_seed(1)
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
            return model, (torch.randn(4, 64),)
    """))
    assert cli.main(["numerics", f"{script}:make"]) == 0
    out = capsys.readouterr().out
    assert "Linear" in out and "Tanh" in out and "(model)" in out
