"""PyTorch's bad-input corpus: every OpInfo `error_inputs` sample, run on tpu, classified.

Each op_db entry with an `error_inputs_func` yields ErrorInputs: a sample plus
the exception type PyTorch raises for it. A sample run on tpu (and its results
read back, so that errors found at the next materialization point count) is
  same     raised the expected type (or a subclass)
  other    raised another type
  silent   returned without an error
The same run on CPU is the reference (a few samples are meant for other devices).

Used by tests/test_error_corpus.py, one subprocess per chunk of entries (a crash is
reported, not fatal). Runnable alone:

    python tests/error_corpus.py --device tpu --chunk 0 --chunks 1 [-v]

prints one JSON line per sample: {"op", "index", "expected", "got", "status", "message"}.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch
from torch.utils import _pytree as pytree


def entries():
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if op.error_inputs_func is not None]


def _materialize(result):
    for leaf in pytree.tree_leaves(result):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
            leaf.cpu()
    if hasattr(torch, "tpu"):
        torch.tpu.synchronize()


def run_entry(op, device: str):
    """(index, expected type, raised type or None, message) per error input of one entry."""
    out = []
    try:
        samples = list(op.error_inputs(device))
    except Exception as err:  # the generator itself failed on this device
        return [(-1, "generator", type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")]
    for index, error_input in enumerate(samples):
        sample = error_input.sample_input
        got, message = None, ""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = op(sample.input, *sample.args, **sample.kwargs)
                _materialize(result)
        except Exception as err:
            got, message = type(err), (str(err).splitlines() or [""])[0][:200]
        if got is None:  # a check found later still belongs to this sample
            try:
                _materialize(None)
            except Exception as err:
                got, message = type(err), (str(err).splitlines() or [""])[0][:200]
        expected = error_input.error_type
        status = "silent" if got is None else ("same" if issubclass(got, expected) else "other")
        out.append((index, expected.__name__, None if got is None else got.__name__, status, message))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--op", default=None)
    args = parser.parse_args(argv)
    if args.device != "cpu":
        import torch_tpu  # noqa: F401
    selected = entries()
    if args.op:
        selected = [op for op in selected if op.name == args.op]
    selected = selected[args.chunk::args.chunks]
    for op in selected:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        for row in run_entry(op, args.device):
            if len(row) == 4:  # the generator failed
                print(json.dumps({"op": name, "index": -1, "expected": None, "got": row[2], "status": "generator",
                                  "message": row[3]}), flush=True)
                continue
            index, expected, got, status, message = row
            print(json.dumps({"op": name, "index": index, "expected": expected, "got": got, "status": status,
                              "message": message}), flush=True)
    print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
