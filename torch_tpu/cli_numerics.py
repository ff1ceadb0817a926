"""Compare a model's per-layer numerics on tpu against a CPU float64 reference.

`torch-tpu numerics` runs the demo GPT (examples/gpt.py of the source tree);
`torch-tpu numerics FILE.py:FACTORY` runs your model: FACTORY() returns
(model, inputs) or (model, inputs, kwargs). `--precision all` puts the three
float32 matmul precisions side by side; `--autocast bfloat16` adds a run
under torch.autocast("tpu").
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

_LEVELS = ("medium", "high", "highest")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="gpt",
                        help='"gpt" (the demo GPT, default) or FILE.py:FACTORY returning (model, inputs[, kwargs])')
    parser.add_argument("--precision", default="current",
                        help='comma-separated levels (medium,high,highest), "all", or "current" (default)')
    parser.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                        help="add a run under torch.autocast('tpu', dtype=...)")
    parser.add_argument("--reference", choices=("float64", "float32"), default="float64",
                        help="dtype of the CPU reference (float32 runs at full precision)")
    parser.add_argument("--depth", type=int, default=None, help="show modules at most this deep (model = 0)")
    parser.add_argument("--seed", type=int, default=0)
    gpt = parser.add_argument_group("demo GPT")
    gpt.add_argument("--layers", type=int, default=2)
    gpt.add_argument("--embd", type=int, default=128)
    gpt.add_argument("--heads", type=int, default=4)
    gpt.add_argument("--seq", type=int, default=64)
    gpt.add_argument("--batch", type=int, default=2)


def _load_file(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"_torch_tpu_numerics_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"torch-tpu numerics: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _demo_gpt(args):
    import torch

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
    if not path.exists():
        raise SystemExit(f"torch-tpu numerics: the demo GPT ships with the source tree ({path} not found); "
                         "pass FILE.py:FACTORY for your own model")
    gpt = _load_file(path)
    config = gpt.GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq)
    model = gpt.GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    return model, (idx,), {}


def _user_model(spec: str):
    file, _, factory = spec.rpartition(":")
    if not file or not factory:
        raise SystemExit(f"torch-tpu numerics: expected 'gpt' or FILE.py:FACTORY, got {spec!r}")
    made = getattr(_load_file(pathlib.Path(file)), factory)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise SystemExit(f"torch-tpu numerics: {spec}() must return (model, inputs) or (model, inputs, kwargs)")
    model, inputs = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else {}
    return model, inputs, kwargs


def _levels(text: str) -> list:
    if text == "current":
        return [None]
    if text == "all":
        return list(_LEVELS)
    levels = [level.strip() for level in text.split(",") if level.strip()]
    for level in levels:
        if level not in _LEVELS:
            raise SystemExit(f"torch-tpu numerics: unknown precision {level!r} (expected {', '.join(_LEVELS)})")
    return levels


def run(args: argparse.Namespace) -> int:
    import torch

    from torch_tpu import numerics

    levels = _levels(args.precision)
    torch.manual_seed(args.seed)
    model, inputs, kwargs = _demo_gpt(args) if args.model == "gpt" else _user_model(args.model)
    reference = getattr(torch, args.reference)
    comparisons = [numerics.compare(model, inputs, kwargs, reference=reference, precision=level) for level in levels]
    if args.autocast:  # at the one level asked for, else at the current level
        level = levels[0] if len(levels) == 1 else None
        comparisons.append(numerics.compare(model, inputs, kwargs, reference=reference, precision=level,
                                            autocast=getattr(torch, args.autocast)))
    print(numerics.table(*comparisons, max_depth=args.depth))
    return 0
