"""Train with TorchTitan on "tpu": its Trainer from its config registry, `section.key=value` overrides.

    torchrun --nproc-per-node=2 examples/torchtitan_train.py llama3 llama3_debugmodel \\
        parallelism.data_parallel_shard_degree=2 training.steps=10 ...

This is TorchTitan's own `torchtitan.train` main (its config registry, `Trainer.Config.build()`,
`train()`, `close()`) without its command-line parser: TorchTitan 0.3.0 parses with tyro >= 1,
which needs typeguard >= 4, and torch_tpu's `test` extra pins tokamax 0.0.12, which pins
typeguard 2.13.3, so one environment holds only tyro 0.9.1, whose parser rejects TorchTitan's
config unions (docs/torchtitan.md). Overrides are set on the config dataclasses by attribute path;
a value is parsed to the type of the field's current value (`none` sets None). Nothing of
TorchTitan is changed.
"""
from __future__ import annotations

import importlib
import json
import sys


def _parse(text: str, current):
    if text.lower() == "none":
        return None
    if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected a bool, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    if isinstance(current, (list, tuple)):
        return type(current)(json.loads(text)) if text.startswith("[") else type(current)(text.split(","))
    return text


def apply(config, override: str) -> None:
    """`a.b.c=value` on the config (dataclasses): the field must exist."""
    path, sep, text = override.partition("=")
    if not sep:
        raise ValueError(f"override {override!r}: expected section.key=value")
    *parents, name = path.replace("-", "_").split(".")
    target = config
    for part in parents:
        target = getattr(target, part)
    if not hasattr(target, name):
        raise AttributeError(f"override {override!r}: {type(target).__name__} has no field {name!r}")
    setattr(target, name, _parse(text, getattr(target, name)))


def build_config(module: str, name: str, overrides: list[str]):
    registry = importlib.import_module(f"torchtitan.models.{module}")  # model_registry; config_registry below
    config = getattr(importlib.import_module(f"torchtitan.models.{module}.config_registry"), name)()
    for override in overrides:
        if override.startswith("model.attn_backend="):  # the model spec is built from (flavor, attention backend)
            config.model_spec = registry.model_registry(config.model_spec.flavor, attn_backend=override.split("=", 1)[1])
            continue
        if override.startswith("activation_checkpoint="):  # a union of configs: pick the class
            from torchtitan.distributed import activation_checkpoint as ac

            kind = override.split("=", 1)[1]
            config.activation_checkpoint = {"none": None, "full": ac.FullAC.Config, "selective": ac.SelectiveAC.Config}[
                kind]() if kind != "none" else None
            continue
        apply(config, override)
    return config


def main(argv: list[str]) -> None:
    import torch

    from torchtitan.tools.logging import init_logger

    init_logger()
    config = build_config(argv[0], argv[1], argv[2:])
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
