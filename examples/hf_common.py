"""Tiny random Hugging Face models for the examples: built from a config and saved locally
(no downloads), so every example runs on a laptop CPU in minutes."""
from __future__ import annotations

import os
import tempfile

import torch


def tiny_llama_dir(root: str | None = None, vocab: int = 256) -> str:
    """A 2-layer Llama (hidden 64) saved with save_pretrained; returns its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(root or tempfile.mkdtemp(prefix="tiny-llama-"), "tiny-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
        LlamaForCausalLM(config).save_pretrained(path)
    return path
