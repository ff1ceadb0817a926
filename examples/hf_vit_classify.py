"""Classify images with a ViT on "tpu" (a tiny random ViT and its image processor, saved locally).

    python examples/hf_vit_classify.py
"""
from __future__ import annotations

import tempfile

import numpy as np
import torch


def main():
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    path = tempfile.mkdtemp(prefix="tiny-vit-")
    torch.manual_seed(0)
    config = ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, num_labels=3, id2label={0: "cat", 1: "dog", 2: "bird"},
                       label2id={"cat": 0, "dog": 1, "bird": 2})
    ViTForImageClassification(config).save_pretrained(path)
    ViTImageProcessor(size={"height": 64, "width": 64}).save_pretrained(path)

    processor = ViTImageProcessor.from_pretrained(path)
    model = ViTForImageClassification.from_pretrained(path, device_map="tpu").eval()
    images = [np.random.default_rng(i).integers(0, 256, (80, 96, 3), dtype=np.uint8) for i in range(4)]
    inputs = processor(images=images, return_tensors="pt").to("tpu")
    with torch.no_grad():
        logits = model(**inputs).logits
    for i, label in enumerate(logits.argmax(-1).tolist()):
        print(f"image {i}: {model.config.id2label[label]}  (p={logits.softmax(-1)[i, label].item():.2f})")
    cpu = ViTForImageClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = cpu(**inputs.to("cpu")).logits
    # tpu multiplies float32 in bf16 by default (precision "medium", docs/precision.md): close, not equal.
    print(f"max |tpu - cpu| logit difference: {(logits.cpu() - expected).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
