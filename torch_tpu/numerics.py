"""Numerics comparison: a model on "tpu" against a CPU reference, layer by layer.

Owns: `compare(model, inputs)`, which runs two copies of a model (a CPU one in
float64, or float32 at full precision, and a "tpu" one at the current
precision, optionally under autocast), records every module's output with
forward hooks, and returns each module's relative error; and `table(...)`,
which renders one or more comparisons. For validating a migration from CUDA:
the errors show which layers are sensitive to "medium" precision or autocast.
Does not own: the precision policy (precision.py). `torch-tpu numerics` is
the command-line front end (cli_numerics.py).
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from torch_tpu import precision as precision_policy


@dataclass
class LayerError:
    """The error of one module's output (one call of it) on tpu against the reference."""

    name: str  # module path; "" is the model itself
    kind: str  # module class name
    shape: tuple  # shape of the first tensor output
    rel_error: float  # ||tpu - ref||_2 / ||ref||_2 over all floating-point outputs, in float64
    max_abs_error: float
    call: int = 0  # a module called several times in one forward has one row per call


@dataclass
class Comparison:
    """Per-module errors of one run; `str()` is the table."""

    layers: list[LayerError]
    precision: str  # the tpu float32 matmul precision the run used
    source: str  # where that level came from (precision.source())
    autocast: torch.dtype | None
    reference: torch.dtype
    device: str = "tpu"

    @property
    def output(self) -> LayerError:
        """The model's own output (its last call)."""
        return [row for row in self.layers if row.name == ""][-1]

    def __getitem__(self, name: str) -> LayerError:
        """The row of a module path (its first call)."""
        for row in self.layers:
            if row.name == name:
                return row
        raise KeyError(name)

    def label(self) -> str:
        amp = f", autocast {str(self.autocast).removeprefix('torch.')}" if self.autocast is not None else ""
        return f"{self.precision}{amp}"

    def __str__(self) -> str:
        return table(self)


def _floating_leaves(tree) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _record(model: torch.nn.Module, records: dict, order: list):
    handles = []
    for name, module in model.named_modules():
        def hook(module, args, output, name=name):
            calls = records.setdefault(name, [])
            order.append((name, len(calls)))
            calls.append(pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, output))

        handles.append(module.register_forward_hook(hook))
    return handles


def _run(model, args, kwargs, contexts) -> tuple[dict, list]:
    records: dict = {}
    order: list = []
    handles = _record(model, records, order)
    try:
        with contextlib.ExitStack() as stack, torch.no_grad():
            for context in contexts:
                stack.enter_context(context)
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return records, order


@contextlib.contextmanager
def _cpu_float32_exact():
    """CPU float32 matmuls/convs at full precision for the block, whatever the user set."""
    settings = (torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv)
    saved = [s.fp32_precision for s in settings]
    try:
        for s in settings:
            s.fp32_precision = "ieee"
        yield
    finally:
        for s, value in zip(settings, saved):
            s.fp32_precision = value


def _error(name: str, actual, expected) -> tuple[tuple, float, float]:
    got, want = _floating_leaves(actual), _floating_leaves(expected)
    if len(got) != len(want):
        raise ValueError(f"module {name or '(model)'}: {len(got)} floating-point outputs on tpu, {len(want)} on CPU")
    diff_sq = ref_sq = 0.0
    max_abs = 0.0
    for a, e in zip(got, want):
        if a.shape != e.shape:
            raise ValueError(f"module {name or '(model)'}: output shape {tuple(a.shape)} on tpu, {tuple(e.shape)} on CPU")
        d = a.cpu().double() - e.double()
        diff_sq += float(d.square().sum())
        ref_sq += float(e.double().square().sum())
        if d.numel():
            max_abs = max(max_abs, float(d.abs().max()))
    if ref_sq == 0.0:
        rel = 0.0 if diff_sq == 0.0 else math.inf
    else:
        rel = math.sqrt(diff_sq / ref_sq)
    shape = tuple(want[0].shape) if want else ()
    return shape, rel, max_abs


def compare(model: torch.nn.Module, inputs, kwargs: dict | None = None, *, reference: torch.dtype = torch.float64,
            precision: str | None = None, autocast: torch.dtype | None = None, device="tpu") -> Comparison:
    """Run `model(*inputs, **kwargs)` on CPU in `reference` dtype and on `device`; return per-module errors.

    `model` and `inputs` may live anywhere; they are copied, never changed.
    Both copies run in eval mode (dropout off) under torch.no_grad(). The
    tpu copy runs at `precision` ("medium", "high", "highest"; default: the
    current level, see torch_tpu.precision) and, if `autocast` is a dtype,
    under torch.autocast(device.type, dtype=autocast). The reference is
    float64 (default) or float32 with full-precision CPU matmuls.
    """
    if reference not in (torch.float64, torch.float32):
        raise ValueError(f"reference must be torch.float64 or torch.float32, got {reference}")
    device = torch.device(device)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    kwargs = dict(kwargs or {})

    base = copy.deepcopy(model).to("cpu").eval()
    ref_model = copy.deepcopy(base).to(reference)
    test_model = base.to(device)

    def ref_input(x):
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach().cpu()
        return x.to(reference) if x.is_floating_point() else x

    def test_input(x):
        return x.detach().to(device) if isinstance(x, torch.Tensor) else x

    ref_args, ref_kwargs = pytree.tree_map(ref_input, (args, kwargs))
    test_args, test_kwargs = pytree.tree_map(test_input, (args, kwargs))

    ref_contexts = [_cpu_float32_exact()] if reference == torch.float32 else []
    expected, order = _run(ref_model, ref_args, ref_kwargs, ref_contexts)

    test_contexts = []
    if precision is not None:
        test_contexts.append(precision_policy.use(precision))
    if autocast is not None:
        test_contexts.append(torch.autocast(device.type, dtype=autocast))
    level_seen = []
    test_contexts.append(_capture_level(level_seen))
    actual, _ = _run(test_model, test_args, test_kwargs, test_contexts)

    kinds = {name: type(module).__name__ for name, module in ref_model.named_modules()}
    rows = []
    for name, call in order:
        if name not in actual or call >= len(actual[name]):
            raise ValueError(f"module {name or '(model)'} ran on CPU but not (or fewer times) on tpu")
        shape, rel, max_abs = _error(name, actual[name][call], expected[name][call])
        if _floating_leaves(expected[name][call]):
            rows.append(LayerError(name, kinds[name], shape, rel, max_abs, call))
    level, source = level_seen[0]
    return Comparison(rows, level, source, autocast, reference, str(device))


@contextlib.contextmanager
def _capture_level(out: list):
    out.append((precision_policy.matmul_precision(), precision_policy.source()))
    yield


def table(*comparisons: Comparison, max_depth: int | None = None) -> str:
    """One or more comparisons of the same model as a text table (one error column per comparison).

    `max_depth` keeps modules at most that many levels deep ("" is 0, "blocks.0" is 2).
    """
    if not comparisons:
        raise ValueError("table() needs at least one comparison")
    first = comparisons[0]
    reference = f"CPU {str(first.reference).removeprefix('torch.')}"
    header = ["layer", "type", "shape"] + [f"rel err {c.label()}" for c in comparisons]
    if len(comparisons) == 1:
        header.append("max abs err")
    body = []
    columns = [{(r.name, r.call): r for r in c.layers} for c in comparisons]
    for row in first.layers:
        depth = 0 if row.name == "" else row.name.count(".") + 1
        if max_depth is not None and depth > max_depth:
            continue
        name = (row.name or "(model)") + (f" #{row.call}" if row.call else "")
        cells = [name, row.kind, "x".join(map(str, row.shape)) or "scalar"]
        for column in columns:
            other = column.get((row.name, row.call))
            cells.append("-" if other is None else f"{other.rel_error:.2e}")
        if len(comparisons) == 1:
            cells.append(f"{row.max_abs_error:.2e}")
        body.append(cells)
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    title = f"{first.device} vs {reference} reference"
    if len(comparisons) == 1:
        title += f", precision {first.label()} (level set by {first.source})"
    lines = [
        title,
        "  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))),
    ]
    lines.append("  ".join("-" * w for w in widths))
    for cells in body:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    return "\n".join(lines)
