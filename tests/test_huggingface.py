"""Hugging Face Transformers on tpu: device_map forms, checkpoint round trips (torch.save,
safetensors, save_pretrained) bit-exact, and generate() (greedy, static cache, compiled decode,
sampling, beam search) against CPU. Tiny models built from configs; nothing is downloaded."""
from __future__ import annotations

import os
import sys

import pytest
import torch

tf = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import torch_tpu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_zoo  # noqa: E402

tf.logging.set_verbosity_error()

# The decoders whose greedy generation is compared token for token (dense, MoE, learned positions).
DECODERS = ["llama", "qwen2", "gpt2", "phi3", "qwen3_moe"]
GREEDY = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)


def _tiny(arch="llama", **overrides):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(hf_zoo.shrink(arch, **overrides)).eval()


def _prompt(batch=2, length=6):
    return torch.randint(4, hf_zoo.VOCAB, (batch, length), generator=torch.Generator().manual_seed(3))


def _assert_state_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        got = actual[name]
        assert got.device.type == "tpu", f"{name} on {got.device}"
        assert got.dtype == value.dtype and torch.equal(got.cpu(), value.cpu()), name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = _tiny(tie_word_embeddings=True)
    model.save_pretrained(path)
    return str(path), model


@pytest.mark.parametrize("device_map", ["tpu", "tpu:0", {"": "tpu"}, {"": 0}], ids=str)
def test_device_map_forms_load_onto_tpu_with_ties(saved, device_map):
    path, model = saved
    loaded = tf.AutoModelForCausalLM.from_pretrained(path, device_map=device_map)
    assert {p.device for p in loaded.parameters()} == {torch.device("tpu", 0)}
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied weights stay tied
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_torch_save_load_map_location_bit_exact(tmp_path):
    state = {k: v.to("tpu") for k, v in _tiny().state_dict().items()}
    state["bf16"] = torch.randn(5, 3).to(torch.bfloat16).to("tpu")
    torch.save(state, tmp_path / "ckpt.pt")
    _assert_state_equal(torch.load(tmp_path / "ckpt.pt", map_location="tpu"), state)
    on_cpu = torch.load(tmp_path / "ckpt.pt", map_location="cpu")
    _assert_state_equal({k: v.to("tpu") for k, v in on_cpu.items()}, state)


def test_safetensors_save_file_load_file_onto_tpu_bit_exact(tmp_path):
    state = {k: v.contiguous().to("tpu") for k, v in _tiny().state_dict().items()}
    state["bf16"] = torch.randn(4, 4).to(torch.bfloat16).to("tpu")
    save_file(state, tmp_path / "model.safetensors")  # from tpu tensors
    # safetensors 0.8 parses device names itself and knows no "tpu"; a device index is the
    # current accelerator's (torch.device(0) is tpu:0), which is how to load straight onto tpu.
    _assert_state_equal(load_file(tmp_path / "model.safetensors", device=0), state)
    with pytest.raises(Exception, match="device tpu is invalid"):
        load_file(tmp_path / "model.safetensors", device="tpu")  # if this passes, safetensors learned "tpu"


def test_save_pretrained_from_pretrained_round_trip_bit_exact(tmp_path):
    model = _tiny(tie_word_embeddings=True).to("tpu")
    model.save_pretrained(tmp_path)  # saved from tpu
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    _assert_state_equal(loaded.state_dict(), model.state_dict())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.heavy  # the first architecture compiles ~170 programs; the others mostly reuse them
@pytest.mark.parametrize("arch", DECODERS)
def test_generate_greedy_20_tokens_matches_cpu(arch):
    model, ids = _tiny(arch), _prompt()
    expected = model.generate(input_ids=ids, **GREEDY)
    model.to("tpu")
    # A static KV cache on tpu: fixed shapes, so each decode step reuses the same programs.
    got = model.generate(input_ids=ids.to("tpu"), cache_implementation="static", disable_compile=True, **GREEDY)
    assert got.device.type == "tpu"
    assert got.cpu().tolist() == expected.tolist()


@pytest.mark.heavy
def test_compiled_static_cache_decode_is_one_program():
    torch_tpu.compile.register()  # an uninstalled checkout has no entry point
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()
    model, ids = _tiny(), _prompt()
    expected = model.generate(input_ids=ids, **GREEDY)
    model.to("tpu")
    config = tf.CompileConfig(backend="tpu", fullgraph=True)
    got = model.generate(input_ids=ids.to("tpu"), cache_implementation="static", compile_config=config, **GREEDY)
    assert got.cpu().tolist() == expected.tolist()
    # Transformers compiles the decode step on tpu; 19 decode steps, one graph, one program.
    assert stats.graphs == 1 and stats.plans == 1 and stats.eager_graphs == 0, stats.as_dict()
    assert stats.calls == GREEDY["max_new_tokens"] - 1, stats.as_dict()
    again = model.generate(input_ids=ids.to("tpu"), cache_implementation="static", compile_config=config, **GREEDY)
    assert again.cpu().tolist() == expected.tolist()
    assert stats.plans == 1, stats.as_dict()  # a second generate plans nothing new
    torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["llama", "bert", "mixtral"])
def test_compiled_forward_with_attention_mask_is_whole_graphs(arch):
    """torch.compile(model) with a padding mask: Transformers' mask code (a boolean padding mask indexed
    with integer index tensors) plans into the program; no graph runs op by op (it did before). Mixtral's
    experts call torch._grouped_mm in float32, which PyTorch's meta kernel refuses (compile/fake.py)."""
    torch_tpu.compile.register()
    torch._dynamo.reset()
    stats = torch_tpu.compile.stats
    stats.reset()
    auto = tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(hf_zoo.shrink(arch)).eval()
    ids = _prompt()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in the first row
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask)
        got = torch.compile(model.to("tpu"), backend="tpu")(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"))
    hf_zoo._compare(got, expected, 2e-4, 2e-4)
    assert stats.plans >= 1 and stats.eager_graphs == 0, stats.as_dict()
    torch._dynamo.reset()


@pytest.mark.heavy
def test_sampling_and_beam_search_on_tpu():
    model, ids = _tiny(), _prompt()
    beams = dict(max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = model.generate(input_ids=ids, **beams)
    model.to("tpu")
    tpu_ids = ids.to("tpu")
    got = model.generate(input_ids=tpu_ids, cache_implementation="static", disable_compile=True, **beams)
    assert got.cpu().tolist() == expected.tolist()  # beam search is deterministic: CPU's beams
    sample = dict(max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, temperature=0.8, eos_token_id=None,
                  pad_token_id=0, cache_implementation="static", disable_compile=True)
    torch.manual_seed(7)
    first = model.generate(input_ids=tpu_ids, **sample)
    torch.manual_seed(7)
    second = model.generate(input_ids=tpu_ids, **sample)
    assert first.device.type == "tpu" and first.shape == (2, 12)
    assert torch.equal(first[:, :6].cpu(), ids)
    assert torch.equal(first.cpu(), second.cpu())  # the tpu generator: same seed, same samples
    new = first[:, 6:].cpu()
    assert ((new >= 0) & (new < hf_zoo.VOCAB)).all()


def test_device_map_auto_with_max_memory_places_on_tpu(saved):
    # Accelerate 1.15's get_max_memory enumerates CUDA/XPU/NPU/... only, so "auto" alone sees just
    # the CPU; giving device 0's budget (torch.device(0) is the accelerator, tpu:0) places it there.
    path, model = saved
    loaded = tf.AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory={0: "1GiB", "cpu": "1GiB"})
    assert {p.device for p in loaded.parameters()} == {torch.device("tpu", 0)}
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_grouped_mm_float32_matches_cpu():
    # Transformers' MoE experts on tpu call grouped_mm in the model's dtype; PyTorch's meta kernel
    # allows bf16 only (CUDA's limit), the CPU kernel and ours take float32.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g), torch.randn(4, 16, 32, generator=g)
    offs, grad = torch.tensor([2, 3, 6, 8], dtype=torch.int32), torch.randn(8, 32, generator=g)
    ta, tb = (t.to("tpu").requires_grad_() for t in (a, b))
    a.requires_grad_(), b.requires_grad_()
    out, tout = torch.nn.functional.grouped_mm(a, b, offs=offs), torch.nn.functional.grouped_mm(ta, tb, offs=offs.to("tpu"))
    assert tout.dtype == torch.float32
    torch.testing.assert_close(tout.cpu(), out.detach(), atol=1e-5, rtol=1e-5)
    (out * grad).sum().backward()
    (tout * grad.to("tpu")).sum().backward()
    torch.testing.assert_close(ta.grad.cpu(), a.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tb.grad.cpu(), b.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="same dtype"):  # PyTorch CPU's message
        torch._grouped_mm(ta.detach().to(torch.bfloat16), tb.detach(), offs=offs.to("tpu"))


def test_compiled_dtype_casts_are_one_program():
    # _to_copy decomposes to prims.convert_element_type inside torch.compile graphs.
    torch_tpu.compile.register()
    torch._dynamo.reset()
    torch_tpu.compile.stats.reset()
    fn = torch.compile(lambda x: (x.to(torch.bfloat16) * 3).to(torch.float32) + x.to(torch.int32), backend="tpu")
    x = torch.randn(5, 3) * 4
    got = fn(x.to("tpu"))
    assert torch_tpu.compile.stats.eager_graphs == 0 and torch_tpu.compile.stats.plans == 1
    assert torch.equal(got.cpu(), (x.to(torch.bfloat16) * 3).to(torch.float32) + x.to(torch.int32))
    torch._dynamo.reset()
