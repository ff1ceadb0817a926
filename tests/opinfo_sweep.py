"""The OpInfo sweep engine: run PyTorch's `op_db` samples on tpu and on CPU, classify each entry.

Used by tests/test_opinfo.py (the sweep tests, the ratchet and docs/op-coverage.md)
and runnable alone for debugging one op:

    python tests/opinfo_sweep.py --mode float32 --op cumprod -v

Each entry of `op_db` is run in each mode on its first `SAMPLES_BY_MODE[mode]` sample inputs
(the heavy sweep splits each mode into `CHUNKS[mode]` chunks, one pytest-xdist work unit each):
  float32           forward, float32 samples
  float32_backward  input gradients of float32 samples (entries that support autograd)
  bfloat16          forward, bfloat16 samples
  float32_variants  in-place (dense and strided self) and out= variants of float32 samples
  complex64         forward, complex64 samples (entries whose CPU kernels take complex64)
  complex64_backward  input gradients of complex64 samples (PyTorch's conjugate-derivative convention)
with TORCH_TPU_FALLBACK=error semantics, so a CPU fallback raises and the entry
is classified "fallback" instead of silently running on the CPU. Results:
  pass      every sample matched CPU within tolerance, natively
  mismatch  a sample's values (or dtype/shape) differ from CPU
  error     the tpu run raised (not a fallback)
  fallback  an ATen op has no lowering and no decomposition
  skip      declared in SKIP (with a reason)
  n/a       PyTorch's CPU rejects every sample: no reference (not counted)
"""
from __future__ import annotations

import fcntl
import functools
import itertools
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

SAMPLES = 3
# The heavy sweep's samples per entry: later samples hold PyTorch's edge cases (0-d and empty tensors,
# broadcasting masks, short padding forms). Variants run one sample: each runs the op three times
# (in-place on a dense and a strided self, out=) and checks aliasing. Backward and bfloat16 at 10 cost about
# 2.2x their 3 (docs/ops.md, "Cost"; "Where CI stands" has the measured CI times).
SAMPLES_BY_MODE = {"float32": 10, "float32_backward": 10, "bfloat16": 10, "float32_variants": 1, "complex64": 3,
                   "complex64_backward": 3}

# The heavy sweep's chunks per mode: chunk k of n runs every n-th eligible entry from the k-th (op_db
# order interleaves op families, so chunks cost about the same). tests/conftest.py makes each chunk its
# own pytest-xdist work unit; sized to about equal cost (a few minutes in CI; measured in docs/ops.md).
CHUNKS = {"float32": 6, "float32_backward": 8, "bfloat16": 5, "float32_variants": 2, "complex64": 1,
          "complex64_backward": 2}

MODES = {  # mode -> (dtype, backward)
    "float32": (torch.float32, False),
    "float32_backward": (torch.float32, True),
    "bfloat16": (torch.bfloat16, False),
    "float32_variants": (torch.float32, False),  # in-place (also on a strided view) and out= variants
    "complex64": (torch.complex64, False),
    "complex64_backward": (torch.complex64, True),
}

DEFAULT_TOL = {
    "float32": (1e-4, 1e-4),
    "float32_variants": (1e-4, 1e-4),
    "float32_backward": (1e-4, 1e-4),
    "complex64": (1e-4, 1e-4),
    "complex64_backward": (1e-4, 1e-4),
    # One bfloat16 ulp is 2**-8 relative (0.39%); rounding order differs from PyTorch's CPU kernels.
    "bfloat16": (1e-2, 1.6e-2),
}

_FALLBACK_RE = re.compile(r"The operator '([^']+)' is not implemented for the 'tpu' device")


@dataclass
class Outcome:
    status: str  # pass / mismatch / error / fallback / skip / n/a
    reason: str = ""
    samples: int = 0
    seconds: float = 0.0
    fallback_ops: list = field(default_factory=list)


def entry_name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def eligible(op, mode: str) -> bool:
    """Whether `op` takes part in `mode` (PyTorch's own CPU dtype support decides)."""
    dtype, backward = MODES[mode]
    if backward:
        return op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
    if mode == "float32_variants" and op.inplace_variant is None and not op.supports_out:
        return False
    return dtype in op.supported_dtypes("cpu")


def _call(op, sample, opmath_reference=False):
    """op on the sample; `opmath_reference`: low-precision float tensors computed in float32, rounded once."""
    if not opmath_reference:
        return op(sample.input, *sample.args, **sample.kwargs)
    low = (torch.bfloat16, torch.float16)
    dtypes = {t.dtype for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor) and t.dtype in low}
    wide = sample.transform(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in low else t)
    out = op(wide.input, *wide.args, **wide.kwargs)
    if len(dtypes) != 1:
        return out
    (dtype,) = dtypes
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t,
                           out)


def _default_device(sample):
    """A sample with no tensors (a factory call without device=) makes its result on tpu."""
    import contextlib

    has_tensor = any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs)))
    return contextlib.nullcontext() if has_tensor or "device" in sample.kwargs else torch.device("tpu")


def _inputs_requiring_grad(sample):
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _differentiable(out):
    return [
        t for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]


def _grads(op, sample, cotangents_cpu):
    """Input gradients of the sample's differentiable outputs against fixed cotangents."""
    out = sample.output_process_fn_grad(_call(op, sample))
    outs = _differentiable(out)
    inputs = _inputs_requiring_grad(sample)
    if not outs or not inputs:
        return None
    device = outs[0].device
    cotangents = [c.to(device) for c in cotangents_cpu(outs)]
    return list(torch.autograd.grad(outs, inputs, cotangents, allow_unused=True))


def _make_cotangents(seed):
    cache = {}

    def make(outs):
        if "values" not in cache:
            g = torch.Generator().manual_seed(seed)
            cache["values"] = [
                torch.randn(o.shape, dtype=o.dtype, generator=g) if o.numel() else torch.empty(o.shape, dtype=o.dtype)
                for o in outs
            ]
        return cache["values"]

    return make


class Mismatch(AssertionError):
    pass


def compare(actual, expected, atol, rtol, metadata_only=False):
    """Raise Mismatch unless `actual` (from tpu) equals `expected` (from CPU)."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec:
        raise Mismatch(f"result structure differs: {a_spec} vs {e_spec}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"result {i}" if len(e_leaves) > 1 else "result"
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"{where}: got {type(a).__name__}, expected a Tensor")
            if a.device.type != "tpu" and e.device.type == "cpu":
                raise Mismatch(f"{where}: on {a.device}, expected tpu")
            if a.dtype != e.dtype:
                raise Mismatch(f"{where}: dtype {a.dtype}, expected {e.dtype}")
            if a.shape != e.shape:
                raise Mismatch(f"{where}: shape {tuple(a.shape)}, expected {tuple(e.shape)}")
            if a.layout != e.layout:
                raise Mismatch(f"{where}: layout {a.layout}, expected {e.layout}")
            if metadata_only:
                continue
            a_cpu = a.detach().cpu()
            e = e.detach()
            if e.layout == torch.sparse_coo:  # as PyTorch compares sparse tensors: coalesced indices, then values
                if (a_cpu.sparse_dim(), a_cpu.dense_dim()) != (e.sparse_dim(), e.dense_dim()):
                    raise Mismatch(f"{where}: sparse/dense dims {(a_cpu.sparse_dim(), a_cpu.dense_dim())}, "
                                   f"expected {(e.sparse_dim(), e.dense_dim())}")
                a_cpu, e = a_cpu.coalesce(), e.coalesce()
                if not torch.equal(a_cpu._indices(), e._indices()):
                    raise Mismatch(f"{where}: sparse indices differ (nnz {a_cpu._nnz()}, expected {e._nnz()})")
                a_cpu, e = a_cpu._values(), e._values()
            elif e.layout != torch.strided:
                a_cpu, e = a_cpu.to_dense(), e.to_dense()
            if e.dtype == torch.bool or not (e.is_floating_point() or e.is_complex()):
                if not torch.equal(a_cpu, e):
                    bad = (a_cpu != e).sum().item()
                    raise Mismatch(f"{where}: {bad} of {e.numel()} elements differ (exact dtype {e.dtype})")
                continue
            try:
                torch.testing.assert_close(a_cpu, e, atol=atol, rtol=rtol, equal_nan=True, check_device=False)
            except AssertionError as err:
                raise Mismatch(f"{where}: " + _short(str(err))) from None
        elif isinstance(e, float) and isinstance(a, float):
            if not (math.isclose(a, e, rel_tol=rtol, abs_tol=atol) or (math.isnan(a) and math.isnan(e))):
                raise Mismatch(f"{where}: {a} != {e}")
        elif a != e and not metadata_only:
            raise Mismatch(f"{where}: {a!r} != {e!r}")


def _short(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    keep = [line for line in lines if line.startswith(("Mismatched", "Greatest absolute", "Greatest relative"))]
    return "; ".join(keep or lines[:2])[:300]


def _error_reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first}"[:300]


def _failure(err: Exception, index: int, ran: int, verbose: bool) -> Outcome:
    """A tpu run that raised: a CPU fallback (named) or an error."""
    match = _FALLBACK_RE.search(str(err))
    if isinstance(err, NotImplementedError) and match:
        return Outcome("fallback", f"no lowering: {match.group(1)}", ran, fallback_ops=[match.group(1)])
    if verbose:
        traceback.print_exc()
    return Outcome("error", f"sample {index}: {_error_reason(err)}", ran)


def run_entry(op, mode: str, samples: int = SAMPLES, tol=None, metadata_only=False, samples_on_tpu=False,
              canonical=None, opmath_reference=False, verbose=False) -> Outcome:
    """Run one op_db entry in one mode on tpu and CPU; classify it.

    Samples are made on the CPU (fast) and copied to tpu, with a `device=`
    argument turned into "tpu" (factories). With `samples_on_tpu` they are
    made on tpu and copied to the CPU instead, like PyTorch's own
    `test_compare_cpu` does with CUDA (for ops that take CPU tensor arguments).
    `canonical(sample, result)`, if given, maps both results to a form that is
    defined uniquely (e.g. sort indices -> the values they select) before comparing.
    `metadata_only` (a bool, or a predicate of the sample) compares only dtype, shape
    and device (random or uninitialised values). `opmath_reference` (bfloat16 forward): the CPU
    reference computes the sample upcast to float32 and rounds its result once, for ops whose
    CPU kernel rounds intermediates to bfloat16 where we (and PyTorch's CUDA kernels) round once.
    """
    from torch_tpu.config import config

    dtype, backward = MODES[mode]
    atol, rtol = tol or DEFAULT_TOL[mode]
    start = time.perf_counter()
    torch.manual_seed(0)
    where = "tpu" if samples_on_tpu else "cpu"
    try:
        sample_list = list(itertools.islice(op.sample_inputs(where, dtype, requires_grad=backward), samples or None))
    except Exception as err:
        if verbose:
            traceback.print_exc()
        return _done(start, Outcome("error" if samples_on_tpu else "n/a", f"making samples on {where}: {_error_reason(err)}"))
    previous = config.fallback
    config.fallback = "error"
    ran = 0
    try:
        for index, sample in enumerate(sample_list):
            if verbose:
                print(f"  sample {index}: {_describe(sample)}")
            cotangents = _make_cotangents(index)
            random_values = metadata_only(sample) if callable(metadata_only) else metadata_only
            try:
                cpu_sample = _copied(sample, "cpu", where)
                if backward:
                    expected = _grads(op, cpu_sample, cotangents)
                    if expected is None:
                        continue
                else:
                    expected = sample.output_process_fn_grad(_call(op, cpu_sample, opmath_reference))
                    if canonical is not None:
                        expected = canonical(cpu_sample, expected)
            except Exception as err:  # CPU rejects this sample: it does not count
                if verbose:
                    print(f"    CPU raised {_error_reason(err)}")
                continue
            if mode == "float32_variants":
                try:
                    _check_variants(op, sample, cpu_sample, _copied(sample, "tpu", where), atol, rtol, random_values,
                                    canonical)
                except Mismatch as err:
                    return _done(start, Outcome("mismatch", f"sample {index}: {err}", ran))
                except _CpuRejects:
                    continue
                except Exception as err:
                    return _done(start, _failure(err, index, ran, verbose))
                ran += 1
                continue
            try:
                tpu_sample = _copied(sample, "tpu", where)
                if backward:
                    actual = _grads(op, tpu_sample, cotangents)
                    if actual is None:
                        return _done(start, Outcome("error", f"sample {index}: no differentiable tpu outputs", ran))
                else:
                    with _default_device(tpu_sample):
                        actual = sample.output_process_fn_grad(_call(op, tpu_sample))
                    if canonical is not None:
                        actual = canonical(tpu_sample, actual)
                compare(actual, expected, atol, rtol, random_values)
            except Mismatch as err:
                return _done(start, Outcome("mismatch", f"sample {index}: {err}", ran))
            except Exception as err:
                return _done(start, _failure(err, index, ran, verbose))
            ran += 1
    finally:
        config.fallback = previous
    if ran == 0:
        return _done(start, Outcome("n/a", "CPU rejects every sample (or no sample has differentiable outputs)", 0))
    return _done(start, Outcome("pass", "", ran))


class _CpuRejects(Exception):
    pass


def _strided_copy(t: torch.Tensor, device) -> torch.Tensor:
    """t's value on `device` in a transposed layout (a view with non-contiguous strides), if t has 2+ dims."""
    if t.dim() < 2:
        return t.detach().clone().to(device)
    return t.detach().transpose(0, 1).contiguous().to(device).transpose(0, 1)


def _check_variants(op, sample, cpu_sample, tpu_sample, atol, rtol, metadata_only=False, canonical=None):
    """In-place (dense and strided self) and out= variants on tpu match CPU and alias like CPU's."""
    checked = False
    post = sample.output_process_fn_grad
    inplace = op.inplace_variant
    if inplace is not None and not sample.broadcasts_input and isinstance(sample.input, torch.Tensor):
        for layout in ("dense", "strided"):
            make = (lambda t, device: t.detach().clone().to(device)) if layout == "dense" else _strided_copy
            try:
                expected = make(cpu_sample.input, "cpu")
                inplace(expected, *cpu_sample.args, **cpu_sample.kwargs)
            except Exception:
                continue
            self = make(cpu_sample.input, "tpu")
            returned = inplace(self, *tpu_sample.args, **tpu_sample.kwargs)
            if returned is not self:
                raise Mismatch(f"in-place ({layout}) returned a new tensor, not self")
            try:
                compare(self, expected, atol, rtol, metadata_only)
            except Mismatch as err:
                raise Mismatch(f"in-place ({layout} self): {err}") from None
            checked = True
    if op.supports_out:
        try:
            expected = op(cpu_sample.input, *cpu_sample.args, **cpu_sample.kwargs)
            leaves = pytree.tree_leaves(expected)
            if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
                raise _CpuRejects
            cpu_outs = [torch.empty(0, dtype=t.dtype) for t in leaves]
            cpu_returned = op(cpu_sample.input, *cpu_sample.args,
                              out=cpu_outs[0] if len(cpu_outs) == 1 else tuple(cpu_outs), **cpu_sample.kwargs)
            aliases = [r is o for r, o in zip(pytree.tree_leaves(cpu_returned), cpu_outs)]
        except Exception:
            expected = None
        if expected is not None:
            outs = [torch.empty(0, dtype=t.dtype, device="tpu") for t in leaves]
            out = outs[0] if len(outs) == 1 else tuple(outs)
            returned = op(tpu_sample.input, *tpu_sample.args, out=out, **tpu_sample.kwargs)
            for r, o, alias in zip(pytree.tree_leaves(returned), outs, aliases):
                if alias and r is not o:
                    raise Mismatch("out= returned a tensor that is not the out argument")
            got = outs[0] if len(outs) == 1 else type(expected)(outs) if isinstance(expected, tuple) else outs
            got, expected = post(got), post(expected)
            if canonical is not None:
                got, expected = canonical(tpu_sample, got), canonical(cpu_sample, expected)
            try:
                compare(got, expected, atol, rtol, metadata_only)
            except Mismatch as err:
                raise Mismatch(f"out=: {err}") from None
            checked = True
    if not checked:
        raise _CpuRejects


def _describe(sample) -> str:
    def d(x):
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                return f"T{tuple(x.shape)}:{str(x.dtype)[6:]}:{str(x.layout)[6:]}@{x.device.type}"
            return f"T{tuple(x.shape)}:{str(x.dtype)[6:]}{'' if x.is_contiguous() else ':nc'}@{x.device.type}"
        return repr(x)

    leaves = pytree.tree_map(d, (sample.input, sample.args, sample.kwargs))
    return str(leaves)[:300]


def _done(start, outcome: Outcome) -> Outcome:
    outcome.seconds = time.perf_counter() - start
    return outcome


def _copied(sample, device: str, made_on: str):
    """The sample with its tensors copied, those on `made_on` to `device` (requires_grad kept).

    Tensors on another device stay there (a CPU index tensor in a tpu sample); `device=` arguments follow.
    """

    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach().to(device) if x.device.type == made_on and device != made_on else x.detach().clone()
        return y.requires_grad_(x.requires_grad) if x.requires_grad else y

    out = sample.transform(copy)
    if device != made_on:
        if "device" in out.kwargs and _names_device(out.kwargs["device"], made_on):
            out.kwargs["device"] = device
        out.args = tuple(device if _names_device(a, made_on) else a for a in out.args)  # x.to("cpu", ...)
    return out


def _names_device(value, device_type: str) -> bool:
    """Whether a sample argument is a device (torch.device or string) of `device_type`."""
    if isinstance(value, torch.device):
        return value.type == device_type
    if isinstance(value, str):
        try:
            return torch.device(value).type == device_type
        except RuntimeError:
            return False
    return False


_pytorchs_extract_test_fn = None  # PyTorch's own, kept for the test that compares the two


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    global _pytorchs_extract_test_fn
    if _pytorchs_extract_test_fn is None:
        _pytorchs_extract_test_fn = common_utils.extract_test_fn
    common_utils.extract_test_fn = core.extract_test_fn = _extract_test_fn
    return db


def _extract_test_fn():
    """PyTorch's `extract_test_fn` (the unittest test method on the stack, for its sample skips) without
    `inspect.stack()`, which reads every frame's source lines: 90 ms per `sample_inputs` call (and one more
    per sample iterator), about a tenth of the sweep's time. Same walk over the frames, same answer (None in
    the sweep, which is no TestCase; tests/test_opinfo.py compares the two)."""
    import unittest

    frame = sys._getframe(1)
    while frame is not None:
        self_val = frame.f_locals.get("self")
        if isinstance(self_val, unittest.TestCase):
            *_, cls_name, test_name = self_val.id().rsplit(".", 2)
            if cls_name == type(self_val).__name__ and test_name.startswith("test"):
                return getattr(self_val, test_name).__func__
        frame = frame.f_back
    return None


# ---------------------------------------------------------------- whole-mode runs
def _tol_for(tol: dict, name: str, mode: str):
    return tol.get((name, mode)) or tol.get(name)


@functools.lru_cache(maxsize=None)
def _eligible_entries(mode: str) -> list:
    return [(entry_name(op), op) for op in op_db() if eligible(op, mode)]


def mode_entries(mode: str, chunk: tuple | None = None) -> list:
    """[(entry name, op)] of the op_db entries eligible in `mode`, in op_db order; `chunk` (k, n): every
    n-th from the k-th."""
    entries = _eligible_entries(mode)
    if chunk is None:
        return list(entries)
    k, n = chunk
    if not 0 <= k < n:
        raise ValueError(f"chunk {k} of {n}: expected 0 <= k < n")
    return entries[k::n]


def run_mode(mode: str, samples: int = SAMPLES, skip=None, xfail=None, tol=None, metadata_only=None,
             samples_on_tpu=(), canonical=None, opmath_reference=(), names=None, verbose=False,
             progress=None, chunk=None) -> dict:
    """{entry name: Outcome} for every op_db entry eligible in `mode` (`chunk` (k, n): that chunk's).

    Tables (name -> value; xfail and tol also take (name, mode) keys): skip and xfail
    reasons, tol (atol, rtol), metadata_only reasons (or (reason, predicate of a sample): only
    the samples it picks), samples_on_tpu names, canonical
    (reason, fn(sample, result)).
    """
    import torch_tpu  # noqa: F401  (registers the device)

    skip, xfail, tol, metadata_only = skip or {}, xfail or {}, tol or {}, metadata_only or {}
    canonical = canonical or {}
    results = {}
    for name, op in mode_entries(mode, chunk):
        if names and name not in names and op.name not in names:
            continue
        if name in skip:
            results[name] = Outcome("skip", skip[name])
            continue
        outcome = run_entry(op, mode, samples, tol=_tol_for(tol, name, mode),
                            metadata_only=_metadata_rule(metadata_only.get(name)),
                            samples_on_tpu=name in samples_on_tpu,
                            canonical=canonical[name][1] if name in canonical else None,
                            opmath_reference=mode == "bfloat16" and name in opmath_reference, verbose=verbose)
        expected_failure = _tol_for(xfail, name, mode)
        if outcome.status == "pass" and name in metadata_only:
            rule = metadata_only[name]
            outcome.reason = rule if isinstance(rule, str) else rule[0]
        elif outcome.status == "pass" and name in canonical:
            outcome.reason = canonical[name][0]
        elif outcome.status == "pass" and mode == "bfloat16" and name in opmath_reference:
            outcome.reason = f"compared with CPU's float32 result rounded once: {opmath_reference[name]}"
        elif outcome.status != "pass" and expected_failure:
            outcome.reason = f"XFAIL ({expected_failure}): {outcome.reason}"
        results[name] = outcome
        if progress:
            progress(name, outcome)
    return results


def _metadata_rule(rule):
    """A metadata_only table value (a reason, or (reason, predicate of a sample)) as run_entry takes it."""
    if rule is None or isinstance(rule, str):
        return rule is not None
    return rule[1]


STATUSES = ("pass", "mismatch", "error", "fallback", "skip", "n/a")


def stats(results: dict) -> dict:
    counts = {status: 0 for status in STATUSES}
    for outcome in results.values():
        counts[outcome.status] += 1
    counts["eligible"] = sum(counts[s] for s in STATUSES if s != "n/a")
    counts["seconds"] = sum(o.seconds for o in results.values())
    return counts


TARGETS = {"float32": 0.995, "float32_backward": 0.99, "bfloat16": 0.99, "float32_variants": 0.90,
           "complex64": 0.99, "complex64_backward": 0.99}  # issue 22's targets (complex64: as float32_backward)


def summary_line(mode: str, results: dict) -> str:
    c = stats(results)
    share = c["pass"] / c["eligible"] if c["eligible"] else 0.0
    return (f"OpInfo {mode}: {c['pass']} of {c['eligible']} entries pass natively ({100 * share:.1f}%); "
            f"mismatch {c['mismatch']}, error {c['error']}, fallback {c['fallback']}, skip {c['skip']}, "
            f"n/a {c['n/a']} ({c['seconds']:.0f} s)")


# ---------------------------------------------------------------- docs and ratchet

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "op-coverage.md"
DOC_JSON = ROOT / "docs" / "op-coverage.json"
BASELINE = ROOT / "tests" / "op_coverage_baseline.json"


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def write_docs(mode: str, results: dict, samples: int = SAMPLES) -> None:
    """Record `mode`'s results in docs/op-coverage.json and regenerate docs/op-coverage.md."""
    import jax

    data = _load(DOC_JSON)
    data.setdefault("modes", {})[mode] = {
        "samples": samples,
        "results": {name: [o.status, o.reason] for name, o in sorted(results.items())},
    }
    data["versions"] = {"torch": torch.__version__, "jax": jax.__version__,
                        "platform": __import__("torch_tpu").runtime.platform.get().platform}
    DOC_JSON.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    DOC.write_text(render(data))


# ---------------------------------------------------------------- chunks across processes
RUNS = pathlib.Path(tempfile.gettempdir()) / "torch_tpu-opinfo"


def record_chunk(run_id: str, mode: str, chunk: int, chunks: int, samples: int, results: dict) -> dict | None:
    """Store chunk `chunk` of `chunks` of `mode` for test run `run_id` (xdist's testrun_uid: every worker of one
    run shares it). The chunk that completes the mode merges all of them (merge_chunks: a missing or foreign
    entry raises), rewrites the mode's docs and returns the merged results; otherwise None."""
    run_dir = RUNS / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    part = {"mode": mode, "chunk": chunk, "chunks": chunks, "samples": samples,
            "results": {name: [o.status, o.reason, o.seconds] for name, o in sorted(results.items())}}
    tmp = run_dir / f".{mode}.{chunk}of{chunks}.{os.getpid()}"
    tmp.write_text(json.dumps(part, sort_keys=True))
    tmp.replace(run_dir / f"{mode}.{chunk}of{chunks}.json")  # atomic: a reader sees a whole chunk or none
    with open(run_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer of docs/op-coverage.* at a time, one merge per mode
        done = run_dir / f"{mode}.done"
        paths = [run_dir / f"{mode}.{k}of{chunks}.json" for k in range(chunks)]
        if done.exists() or not all(p.exists() for p in paths):
            return None
        merged = merge_chunks(mode, [json.loads(p.read_text()) for p in paths])
        write_docs(mode, merged, samples)
        done.touch()
        for p in paths:
            p.unlink()
    return merged


def merge_chunks(mode: str, parts: list) -> dict:
    """One mode's results from its chunks' records: raises unless they are chunks 0..n-1 of one run
    configuration and hold every entry eligible in `mode` exactly once (never a partial doc)."""
    if not parts:
        raise AssertionError(f"OpInfo {mode}: no chunks to merge")
    chunks, samples = parts[0]["chunks"], parts[0]["samples"]
    got = sorted(p["chunk"] for p in parts)
    if got != list(range(chunks)) or {(p["mode"], p["chunks"], p["samples"]) for p in parts} != {(mode, chunks, samples)}:
        raise AssertionError(f"OpInfo {mode}: chunks {got} of {chunks} at {samples} samples do not make one sweep")
    merged = {}
    for p in parts:
        for name, (status, reason, seconds) in p["results"].items():
            if name in merged:
                raise AssertionError(f"OpInfo {mode}: entry {name} in two chunks")
            merged[name] = Outcome(status, reason, seconds=seconds)
    _check_entries(mode, merged, f"OpInfo {mode}: merged chunks")
    return merged


def _check_entries(mode: str, names, what: str) -> None:
    """Raise unless `names` are exactly the entries eligible in `mode`."""
    expected, names = {name for name, _ in mode_entries(mode)}, set(names)
    if names != expected:
        raise AssertionError(f"{what} miss {sorted(expected - names)[:20]} and hold foreign entries "
                             f"{sorted(names - expected)[:20]}")


def check_docs_complete() -> None:
    """docs/op-coverage.json holds every mode at its heavy sample count, each with exactly its eligible
    entries, and docs/op-coverage.md is its rendering (no partial or hand-edited doc gets committed)."""
    data = _load(DOC_JSON)
    modes = data.get("modes", {})
    assert sorted(modes) == sorted(MODES), f"docs/op-coverage.json holds modes {sorted(modes)}"
    for mode, section in modes.items():
        assert section["samples"] == SAMPLES_BY_MODE[mode], (
            f"{mode}: docs/op-coverage.json is from a sweep at {section['samples']} samples, the heavy sweep runs "
            f"{SAMPLES_BY_MODE[mode]}")
        _check_entries(mode, section["results"], f"{mode}: docs/op-coverage.json")
    assert DOC.read_text() == render(data), "docs/op-coverage.md is not the rendering of docs/op-coverage.json"


def render(data: dict) -> str:
    modes = [m for m in MODES if m in data.get("modes", {})]
    v = data.get("versions", {})
    lines = [
        "# Operator coverage (generated)",
        "",
        "Generated by `tests/test_opinfo.py` (`make test-heavy`) from PyTorch's OpInfo `op_db`; do not edit.",
        f"torch {v.get('torch')}, jax {v.get('jax')}, XLA platform `{v.get('platform')}`; the first samples of "
        "each entry (count per mode below); every run uses `TORCH_TPU_FALLBACK=error` semantics, so an op",
        "that would fall back to the CPU is counted as `fallback`, never as a pass. How the sweep works and how to",
        "raise the ratchet: [ops.md](ops.md).",
        "",
        "- **pass**: every sample matches PyTorch's CPU result natively (float32 atol=rtol=1e-4; "
        "bfloat16 atol=1e-2, rtol=1.6e-2; per-entry `TOL` in the test). `float32_variants`: the in-place variant "
        "(on a dense and on a transposed-strided self) and the `out=` variant match and alias like CPU's.",
        "- **mismatch**: a result differs in value, dtype or shape. **error**: the tpu run raised. "
        "**fallback**: an ATen op has no lowering and no decomposition (named).",
        "- **skip**: declared in the test's `SKIP` table with a reason. **n/a**: PyTorch's CPU rejects every sample "
        "(no reference); not counted.",
        "- Entries with random or uninitialised values compare dtype, shape and device only (marked in the reason).",
        "",
        "## Summary",
        "",
        "| mode | samples | eligible | native pass | % | target | mismatch | error | fallback | skip | n/a |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    per_mode = {}
    for mode in modes:
        results = {n: Outcome(s, r) for n, (s, r) in data["modes"][mode]["results"].items()}
        per_mode[mode] = results
        c = stats(results)
        share = 100 * c["pass"] / c["eligible"] if c["eligible"] else 0
        lines.append(f"| {mode} | {data['modes'][mode]['samples']} | {c['eligible']} | {c['pass']} | {share:.1f}% | "
                     f"{100 * TARGETS[mode]:g}% | "
                     f"{c['mismatch']} | {c['error']} | {c['fallback']} | {c['skip']} | {c['n/a']} |")
    fallback_ops: dict = {}
    for mode, results in per_mode.items():
        for name, o in results.items():
            if o.status == "fallback":
                fallback_ops.setdefault(o.reason.split(": ", 1)[-1], set()).add(name)
    lines += ["", "## ATen ops still falling back", ""]
    if fallback_ops:
        lines += ["| ATen op | entries |", "| --- | --- |"]
        for aten_op, names in sorted(fallback_ops.items()):
            lines.append(f"| `{aten_op}` | {', '.join(sorted(names))} |")
    else:
        lines.append("None.")
    lines += ["", "## Per entry", "", "| entry | " + " | ".join(modes) + " | reason |",
              "| --- | " + " | ".join("---" for _ in modes) + " | --- |"]
    names = sorted({n for r in per_mode.values() for n in r})
    for name in names:
        cells, reasons = [], []
        for mode in modes:
            o = per_mode[mode].get(name)
            cells.append("" if o is None else o.status)
            if o is not None and o.reason:
                reasons.append(f"{mode}: {o.reason}")
        reason = "; ".join(reasons).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {reason} |")
    return "\n".join(lines) + "\n"


def passes(results: dict) -> set:
    return {name for name, o in results.items() if o.status == "pass"}


def check_ratchet(mode: str, results: dict, quick: bool = False, samples: int | None = None,
                  entries=None) -> None:
    """Fail if an entry in the committed baseline's pass set no longer passes, or the count drops.

    `samples`: the run's samples per entry, which must be the count the baseline was accepted at.
    `entries` (one chunk's names): only the baseline entries among them are checked, not the count.
    """
    committed = _load(BASELINE)
    if samples is not None and committed.get("samples", {}).get(mode) != samples:
        raise AssertionError(f"OpInfo {mode}: the baseline was accepted at {committed.get('samples', {}).get(mode)} "
                             f"samples per entry, this sweep runs {samples}: `python tests/opinfo_sweep.py --accept` "
                             "after a full sweep at the new count")
    baseline = set(committed.get(mode, []))
    if entries is not None:
        baseline &= set(entries)
        quick = True
    now = passes(results)
    lost = sorted(n for n in baseline - now if not (quick and results.get(n, Outcome("n/a")).status == "n/a"))
    if lost:
        details = "; ".join(f"{n} -> {results[n].status}: {results[n].reason}" if n in results else f"{n} (gone)"
                            for n in lost)
        raise AssertionError(f"OpInfo {mode}: {len(lost)} entries regressed below the baseline: {details}")
    if not quick and len(now) < len(baseline):
        raise AssertionError(f"OpInfo {mode}: {len(now)} passes < baseline {len(baseline)}")
    gained = len(now - baseline)
    if gained and not quick:
        print(f"OpInfo {mode}: {gained} entries pass beyond the baseline; "
              "raise it with `python tests/opinfo_sweep.py --accept`")


def table_entries(tables: dict) -> dict:
    """{table name: sorted entry names} of the exemption tables (keys may be name or (name, mode))."""
    return {table: sorted({k if isinstance(k, str) else "/".join(k) for k in entries})
            for table, entries in tables.items()}


def check_tables(tables: dict) -> None:
    """Fail if an entry moved into an exemption table (SKIP, XFAIL, TOL, METADATA_ONLY, CANONICAL,
    OPMATH_REFERENCE) beyond the committed baseline: a weaker check must be reviewed, then accepted."""
    committed = _load(BASELINE).get("tables", {})
    added = {table: sorted(set(names) - set(committed.get(table, [])))
             for table, names in table_entries(tables).items()}
    added = {t: n for t, n in added.items() if n}
    if added:
        raise AssertionError(f"entries moved into exemption tables beyond the baseline: {added}; review them, "
                             "then `python tests/opinfo_sweep.py --accept`")


def check_xfail(mode: str, results: dict, xfail: dict) -> None:
    unexpected = sorted(n for n, o in results.items() if o.status == "pass" and _tol_for(xfail, n, mode))
    if unexpected:
        raise AssertionError(f"XFAIL entries now pass (remove them from XFAIL): {', '.join(unexpected)}")


def accept(tables: dict | None = None) -> None:
    """Raise the baseline to the pass sets recorded in docs/op-coverage.json (never lowers it), and record
    the exemption tables' current entries."""
    data = _load(DOC_JSON)
    baseline = _load(BASELINE)
    if tables is not None:
        baseline["tables"] = table_entries(tables)
    counts = baseline.setdefault("samples", {})
    for mode, section in data.get("modes", {}).items():
        now = {n for n, (status, _) in section["results"].items() if status == "pass"}
        old = set(baseline.get(mode, []))
        # A new sample count is a new ratchet: the entries its later samples fail leave the pass set (listed).
        if old - now and counts.get(mode) == section["samples"]:
            raise SystemExit(f"{mode}: refusing to drop {sorted(old - now)} from the baseline")
        if old - now:
            print(f"{mode}: {counts.get(mode)} -> {section['samples']} samples per entry drops {sorted(old - now)}")
        baseline[mode] = sorted(now)
        counts[mode] = section["samples"]
        print(f"{mode}: baseline {len(old)} -> {len(now)} passes")
    BASELINE.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="float32", choices=list(MODES))
    parser.add_argument("--op", action="append", help="entry or op name (repeatable); default: all")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per entry (0: all); default: the heavy sweep's count for the mode")
    parser.add_argument("--chunk", default=None, metavar="K/N",
                        help="only chunk K (1-based) of N, as the heavy sweep's test_opinfo_sweep[MODE-KofN] runs it")
    parser.add_argument("--only", default=None, help="print only entries with this status")
    parser.add_argument("--accept", action="store_true", help="raise the baseline to docs/op-coverage.json")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    import test_opinfo as t

    if args.accept:
        accept(t.TABLES)
        return

    torch.set_float32_matmul_precision("highest")  # as the tests run (conftest): compared with CPU's float32

    def progress(name, o):
        if args.only is None or o.status == args.only:
            print(f"{o.status:9s} {o.seconds:6.2f}s {name:45s} {o.reason}", flush=True)

    samples = SAMPLES_BY_MODE[args.mode] if args.samples is None else args.samples
    chunk = None
    if args.chunk:
        k, n = (int(x) for x in args.chunk.split("/"))
        chunk = (k - 1, n)
    results = run_mode(args.mode, samples, t.SKIP, t.XFAIL, t.TOL, t.METADATA_ONLY, t.SAMPLES_ON_TPU, t.CANONICAL,
                       t.OPMATH_REFERENCE, names=args.op, verbose=args.verbose, progress=progress, chunk=chunk)
    print(summary_line(args.mode, results))


if __name__ == "__main__":
    main()
