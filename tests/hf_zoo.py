"""The Hugging Face model zoo: tiny random models of many Transformers architectures, each saved
to a directory, loaded onto tpu with device_map="tpu" and with .to("tpu"), and its forward compared
with the same model on CPU.

Run as a script (tests/test_huggingface_zoo.py does, in one fresh process with
TORCH_TPU_FALLBACK=error) it prints one JSON line per architecture:
{"arch", "status": "pass"|"fail", "stage", "error", "max_abs_err", "seconds"}. With `--compile`, each
model's forward also runs under torch.compile(backend="tpu") (docs/huggingface.md).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import torch

VOCAB = 256
SEQ = 8
BATCH = 2
IMAGE = 32

# Generic sizes for every (sub-)config field of these names that the config has.
_SMALL = {
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "dim": 32, "n_embed": 32,
    "num_hidden_layers": 1, "n_layer": 1, "num_layers": 1, "n_layers": 1, "encoder_layers": 1,
    "decoder_layers": 1, "num_decoder_layers": 1,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "num_heads": 2,
    "num_key_value_heads": 1, "num_kv_heads": 1, "multi_query_group_num": 1,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "d_ff": 64, "hidden_dim": 64,
    "head_dim": 16, "d_kv": 16, "kv_channels": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_source_positions": 16,
    "max_target_positions": 64,
    "image_size": IMAGE, "patch_size": 8,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "embedding_size": 32, "projection_dim": 32, "text_embed_dim": 32, "projection_size": 32,
}
_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                 "cls_token_id", "mask_token_id", "unk_token_id")


# Derived from the sizes above: the config recomputes them.
_DERIVED = ("layer_types", "out_features", "out_indices", "stage_names", "mlp_layer_types")


def _shrink_dict(d):
    for key, value in list(d.items()):
        if isinstance(value, dict) and "model_type" in value:
            _shrink_dict(value)
        elif key in _DERIVED:
            del d[key]
        elif key in _SMALL and isinstance(value, int) and not isinstance(value, bool):
            d[key] = _SMALL[key]
        elif key in _TOKEN_FIELDS:
            ids = value if isinstance(value, list) else [value]
            if any(isinstance(i, int) and i >= VOCAB for i in ids):
                d[key] = [i % 16 for i in ids] if isinstance(value, list) else 1
    return d


def shrink(model_type, **overrides):
    """The architecture's default config with small values for every size field it has
    (sub-configs too), then the overrides ("text_config.hidden_size" reaches into a sub-config)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    d = _shrink_dict(cls().to_dict())
    for key, value in overrides.items():
        target = d
        *path, leaf = key.split(".")
        for part in path:
            target = target[part]
        if hasattr(value, "to_dict"):
            value = value.to_dict()
        target[leaf] = value
    return cls.from_dict(d)


def _text(gen, seq=SEQ):
    ids = torch.randint(4, VOCAB, (BATCH, seq), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _seq2seq(gen):
    inputs = _text(gen)
    inputs["decoder_input_ids"] = torch.randint(4, VOCAB, (BATCH, 5), generator=gen)
    return inputs


def _pixels(gen, size=IMAGE):
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=gen)}


def _text_image(gen):
    return {**_text(gen), **_pixels(gen)}


def _whisper(gen):
    return {"input_features": torch.randn(BATCH, 16, 32, generator=gen),
            "decoder_input_ids": torch.randint(4, VOCAB, (BATCH, 5), generator=gen)}


def _audio(gen):
    return {"input_values": torch.randn(BATCH, 1600, generator=gen)}


def _llava(gen):
    # 16 image tokens (a 32x32 image in 8x8 patches), then text.
    ids = torch.randint(4, 200, (BATCH, 20), generator=gen)
    ids[:, 1:17] = 200
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)}


def _configs():
    """(arch, auto class name, config factory, inputs factory), spanning the families."""
    import transformers as tf

    def c(name, **kw):
        return lambda: shrink(name, **kw)

    causal, base = "AutoModelForCausalLM", "AutoModel"
    seq2seq = "AutoModelForSeq2SeqLM"
    img = "AutoModelForImageClassification"
    zoo = [
        # dense decoders
        ("llama", causal, c("llama"), _text),
        ("mistral", causal, c("mistral"), _text),
        ("qwen2", causal, c("qwen2"), _text),
        ("qwen3", causal, c("qwen3"), _text),
        ("gemma", causal, c("gemma"), _text),
        ("gemma2", causal, c("gemma2"), _text),
        ("gemma3_text", causal, c("gemma3_text"), _text),
        ("phi", causal, c("phi"), _text),
        ("phi3", causal, c("phi3"), _text),
        ("gpt2", causal, c("gpt2"), _text),
        ("gpt_neox", causal, c("gpt_neox"), _text),
        ("gptj", causal, c("gptj", rotary_dim=8), _text),
        ("olmo", causal, c("olmo"), _text),
        ("olmo2", causal, c("olmo2"), _text),
        ("falcon", causal, c("falcon"), _text),
        ("starcoder2", causal, c("starcoder2"), _text),
        ("stablelm", causal, c("stablelm"), _text),
        ("cohere", causal, c("cohere"), _text),
        ("opt", causal, c("opt", word_embed_proj_dim=32), _text),
        ("bloom", causal, c("bloom"), _text),
        ("granite", causal, c("granite"), _text),
        # mixture-of-experts decoders
        ("mixtral", causal, c("mixtral"), _text),
        ("qwen2_moe", causal, c("qwen2_moe"), _text),
        ("qwen3_moe", causal, c("qwen3_moe"), _text),
        ("olmoe", causal, c("olmoe"), _text),
        ("deepseek_v3", causal, c("deepseek_v3", first_k_dense_replace=0, n_group=1, topk_group=1,
                                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=16), _text),
        # encoders
        ("bert", base, c("bert"), _text),
        ("roberta", base, c("roberta"), _text),
        ("distilbert", base, c("distilbert"), _text),
        ("albert", base, c("albert"), _text),
        ("electra", base, c("electra"), _text),
        ("deberta_v2", base, c("deberta-v2"), _text),
        ("modernbert", base, c("modernbert"), _text),
        # encoder-decoders
        ("t5", seq2seq, c("t5"), _seq2seq),
        ("bart", seq2seq, c("bart"), _seq2seq),
        ("mbart", seq2seq, c("mbart"), _seq2seq),
        ("pegasus", seq2seq, c("pegasus"), _seq2seq),
        ("whisper", "AutoModelForSpeechSeq2Seq", c("whisper", num_mel_bins=16), _whisper),
        # vision
        ("vit", img, c("vit"), _pixels),
        ("deit", img, c("deit", architectures=["DeiTForImageClassification"]), _pixels),
        ("beit", img, c("beit"), _pixels),
        ("dinov2", base, c("dinov2"), _pixels),
        ("convnext", img, c("convnext", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2), _pixels),
        ("resnet", img, c("resnet", hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16), _pixels),
        ("swin", img, c("swin", embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4,
                        patch_size=4), _pixels),
        ("detr", base, c("detr", use_timm_backbone=False, use_pretrained_backbone=False, num_queries=8,
                         backbone_config=tf.ResNetConfig(hidden_sizes=[16, 32], depths=[1, 1],
                                                         embedding_size=16, out_features=["stage2"])),
         _pixels),
        # audio
        ("wav2vec2", base, c("wav2vec2", conv_dim=[16, 16], conv_stride=[5, 4], conv_kernel=[10, 8], num_feat_extract_layers=2,
                             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2), _audio),
        # multimodal
        ("clip", base, c("clip"), _text_image),
        ("siglip", base, c("siglip"), _text_image),
        ("llava", "AutoModelForImageTextToText",
         c("llava", image_token_index=200, **{"vision_config.hidden_size": 32}), _llava),
    ]
    return zoo


def _tensors(out):
    """Every tensor of a model output, in order (nested tuples and ModelOutputs flattened)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _compare(actual, expected, atol, rtol):
    a, e = _tensors(actual), _tensors(expected)
    assert len(a) == len(e) and e, f"{len(a)} outputs on tpu, {len(e)} on CPU"
    worst = 0.0
    for x, y in zip(a, e):
        assert x.device.type == "tpu", f"an output on {x.device}"
        x = x.cpu()
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)
        if y.is_floating_point() and y.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def run_one(arch, auto_name, make_config, make_inputs, root, atol=2e-4, rtol=2e-4, compiled=False):
    import transformers as tf

    started = time.perf_counter()
    stage = "config"
    try:
        config = make_config()
        auto = getattr(tf, auto_name)
        stage = "build"
        torch.manual_seed(0)
        model = auto.from_config(config).eval()
        path = os.path.join(root, arch)
        model.save_pretrained(path)
        inputs = make_inputs(torch.Generator().manual_seed(1))
        kwargs = {"use_cache": False} if auto_name == "AutoModelForCausalLM" else {}
        stage = "cpu forward"
        with torch.no_grad():
            expected = model(**inputs, **kwargs)
        tpu_inputs = {k: v.to("tpu") for k, v in inputs.items()}
        stage = 'device_map="tpu"'
        loaded = auto.from_pretrained(path, device_map="tpu").eval()
        devices = {p.device.type for p in loaded.parameters()} | {b.device.type for b in loaded.buffers()}
        assert devices == {"tpu"}, f"parameters/buffers on {devices}"
        with torch.no_grad():
            err = _compare(loaded(**tpu_inputs, **kwargs), expected, atol, rtol)
        del loaded
        stage = '.to("tpu")'
        model = model.to("tpu")
        with torch.no_grad():
            err = max(err, _compare(model(**tpu_inputs, **kwargs), expected, atol, rtol))
        if compiled:  # torch.compile(model, backend="tpu"): every graph one program, no graph op by op
            import torch_tpu.compile

            stage = "torch.compile"
            torch_tpu.compile.register()
            torch._dynamo.reset()
            eager_graphs = torch_tpu.compile.stats.eager_graphs
            with torch.no_grad():
                err = max(err, _compare(torch.compile(model, backend="tpu")(**tpu_inputs, **kwargs), expected, atol, rtol))
            assert torch_tpu.compile.stats.eager_graphs == eager_graphs, "a graph ran op by op (see the warning)"
        return {"arch": arch, "status": "pass", "stage": None, "error": None, "max_abs_err": err,
                "seconds": round(time.perf_counter() - started, 2)}
    except Exception as exc:  # a failure is a row of the table, with where and why
        tb = traceback.format_exc(limit=-3)
        return {"arch": arch, "status": "fail", "stage": stage,
                "error": f"{type(exc).__name__}: {str(exc)[:400]}", "traceback": tb[-1500:],
                "max_abs_err": None, "seconds": round(time.perf_counter() - started, 2)}


def main(argv):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_float32_matmul_precision("highest")
    compiled = "--compile" in argv
    only = set(argv) - {"--compile"}
    with tempfile.TemporaryDirectory() as root:
        for arch, auto_name, make_config, make_inputs in _configs():
            if only and arch not in only:
                continue
            print(json.dumps(run_one(arch, auto_name, make_config, make_inputs, root, compiled=compiled)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
