"""Offline assets for TorchTitan's debug model (docs/torchtitan.md): a tokenizer and a tiny text set.

TorchTitan's llama3 `debugmodel` reads a Hugging Face tokenizer directory (`--model.hf_assets_path`)
and the `c4_test` dataset (`--training.dataset_path`: JSON lines with a "text" field); its wheel
ships neither (they live in its repository's tests/assets). This writes both, deterministic, so
training runs with no network:

    python examples/torchtitan_assets.py /tmp/titan_assets 64
    # -> /tmp/titan_assets/tokenizer/{tokenizer.json,tokenizer_config.json}
    #    /tmp/titan_assets/c4_test/c4.json       documents in order (one process)
    #    /tmp/titan_assets/c4_test_dp2/c4.json   the same documents for 2 data-parallel ranks

The tokenizer is word-level (one token per word) and every document is exactly seq_len + 1
tokens with BOS and EOS, so TorchTitan's packing makes each document one sample. TorchTitan
gives data-parallel rank r the r-th contiguous part of the dataset; `c4_test_dp2` orders the
documents so that step t's global batch (rank 0's samples, then rank 1's) is the same documents
as one process's step t with twice the local batch: the two runs can be compared loss for loss.
"""
from __future__ import annotations

import json
import os
import random
import sys

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|unk|>"
SPECIALS = 2  # BOS and EOS around every document

_WORDS = (
    "the a an one every some small large quick slow bright dark tensor device program compiler kernel "
    "graph shard rank process mesh step loss gradient weight layer token model batch data cache buffer "
    "runs trains reads writes moves sums splits gathers scatters fuses waits starts stops learns keeps "
    "on in over under with through after before across into from to and or but then while because"
).split()


def documents(n: int, seq_len: int, seed: int = 0) -> list[str]:
    """`n` deterministic documents of seq_len + 1 - SPECIALS words each."""
    rng = random.Random(seed)
    # A little structure to learn: each word is often followed by the same next word.
    follow = {w: rng.choice(_WORDS) for w in _WORDS}
    docs = []
    for _ in range(n):
        word, words = rng.choice(_WORDS), []
        for _ in range(seq_len + 1 - SPECIALS):
            words.append(word)
            word = follow[word] if rng.random() < 0.7 else rng.choice(_WORDS)
        docs.append(" ".join(words))
    return docs


def dp_order(docs: list[str], world: int, local_batch: int) -> list[str]:
    """The order whose contiguous parts give rank r the documents [t*W*b + r*b, t*W*b + (r+1)*b) at step t."""
    step = world * local_batch
    parts = [[] for _ in range(world)]
    for t in range(len(docs) // step):
        for r in range(world):
            parts[r].extend(docs[t * step + r * local_batch: t * step + (r + 1) * local_batch])
    return [d for part in parts for d in part]


def _write_jsonl(path: str, docs: list[str]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")


def write(root: str, seq_len: int = 64, n_docs: int = 48, dp_local_batch: int = 2) -> dict:
    """Write the tokenizer and the datasets under `root`; their paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = os.path.join(root, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate([BOS, EOS, UNK] + _WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
                   "add_bos_token": True, "add_eos_token": True}, f)
    docs = documents(n_docs, seq_len)
    paths = {"tokenizer": tok_dir, "data": os.path.join(root, "c4_test"), "data_dp2": os.path.join(root, "c4_test_dp2")}
    _write_jsonl(os.path.join(paths["data"], "c4.json"), docs)
    _write_jsonl(os.path.join(paths["data_dp2"], "c4.json"), dp_order(docs, 2, dp_local_batch))
    return paths


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "titan_assets"
    print(json.dumps(write(root, int(sys.argv[2]) if len(sys.argv) > 2 else 64)))
