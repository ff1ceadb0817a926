"""Offline assets for TorchTitan's debug model (docs/torchtitan.md): a tokenizer and a tiny text set.

TorchTitan's `llama3_debugmodel` reads a Hugging Face tokenizer directory (`--hf_assets_path`)
and the `c4_test` dataset (`--dataloader.dataset_path`, JSON lines with a "text" field); its
wheel ships neither (they live in its repository's tests/assets). This writes both, made here
and deterministic, so training runs with no network:

    python examples/torchtitan_assets.py /tmp/titan_assets
    # -> /tmp/titan_assets/tokenizer/{tokenizer.json,tokenizer_config.json}
    #    /tmp/titan_assets/c4_test/c4.json
"""
from __future__ import annotations

import json
import os
import random
import sys

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB = 2048  # the debug model's vocabulary (its embedding has 2048 rows)

_WORDS = (
    "the a an one every some small large quick slow bright dark tensor device program compiler kernel "
    "graph shard rank process mesh step loss gradient weight layer token model batch data cache buffer "
    "runs trains reads writes moves sums splits gathers scatters fuses waits starts stops learns keeps "
    "on in over under with through after before across into from to and or but then while because"
).split()


def texts(n: int = 400, seed: int = 0) -> list[str]:
    """`n` deterministic pseudo-sentences (a few hundred words each)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(8, 20)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
        out.append(" ".join(sentences))
    return out


def write(root: str) -> tuple[str, str]:
    """Write the tokenizer and the dataset under `root`; (tokenizer dir, dataset dir)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "c4_test")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    corpus = texts()
    with open(os.path.join(data_dir, "c4.json"), "w") as f:
        for text in corpus:
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, f)
    return tok_dir, data_dir


if __name__ == "__main__":
    print(*write(sys.argv[1] if len(sys.argv) > 1 else "titan_assets"))
