"""The recompilation explainer: why a site compiled again, and what to change.

A *site* is what compiled, where: an op at the user's source line (the first
frame outside torch, torch_tpu and the standard library), a DeferAndFuse
segment at the lines of its first and last ops, or a torch.compile graph. The
executors call the `*_compiled` hooks below on their compile-miss paths only
(a cache hit never reaches this module). When a site compiles again in a
later pass over the code (after a materialization point: the next step of a
loop; any second compile for a torch.compile graph), the difference from the
closest signature it compiled before is recorded: which argument's shape,
dtype, stride, storage offset or device changed, or which static value, old ->
new. Different signatures compiled in one pass (a line looping over parameters
of different shapes) are distinct programs, not recompiles.

- `TORCH_TPU_EXPLAIN_RECOMPILES=1` logs each recompile as it happens (stderr).
- `summary()` (and the metrics report's "recompiles" section) lists the top
  recompiling sites with their counts and last reason.
- After `TORCH_TPU_RECOMPILE_WARN_LIMIT` recompiles of one site (default 8) a
  one-time `RecompileWarning` suggests the fix.

Owns: site identity, signature diffs, the messages and their fixes. Does not
own: the signatures themselves (eager/program.py documents the op key layout)
or when a compile happens (the executors).
"""
from __future__ import annotations

import collections
import linecache
import os
import sys
import threading
import warnings

import torch

from torch_tpu import metrics
from torch_tpu.config import config


class RecompileWarning(UserWarning):
    """A site compiled again and again: its inputs change between calls."""


class Site:
    """One place that compiles: its last signature, how often it recompiled and why."""

    __slots__ = ("kind", "name", "where", "signatures", "first_epoch", "compiles", "recompiles", "reasons",
                 "last_changes", "warned")

    def __init__(self, kind: str, name: str, where, epoch: int):
        self.kind = kind
        self.name = name
        self.where = where  # (filename, line, function) or None
        self.signatures: list = []  # the latest few signatures compiled here
        self.first_epoch = epoch
        self.compiles = 0
        self.recompiles = 0
        self.reasons: collections.Counter = collections.Counter()  # change kind -> count
        self.last_changes: list[Change] = []
        self.warned = False

    @property
    def location(self) -> str:
        return format_where(self.where)


class Change:
    """One difference between two signatures of a site: what, which kind, old and new."""

    __slots__ = ("what", "kind", "old", "new")

    def __init__(self, what: str, kind: str, old, new):
        self.what = what  # e.g. "argument 'self' size[1]"
        self.kind = kind  # shape, dtype, stride, offset, device, static, scalar_type, storage, precision, structure
        self.old = old
        self.new = new

    def __str__(self):
        return f"{self.what}: {self.old} -> {self.new}"

    def as_dict(self) -> dict:
        return {"what": self.what, "kind": self.kind, "old": _plain(self.old), "new": _plain(self.new)}


# What to do about each kind of change (the warning and docs/troubleshooting.md say the same).
FIXES = {
    "shape": "shapes change between calls: pad or bucket them to a few fixed sizes (fixed sequence length, "
             "drop_last=True), or mark the dimension dynamic under torch.compile (torch._dynamo.mark_dynamic)",
    "static": "a static (compile-time) argument changes between calls: keep it fixed, or pass a value that "
              "varies as a tensor (torch.tensor(v, device='tpu')) so it becomes a runtime input",
    "dtype": "an argument's dtype changes between calls: cast to one dtype before the op",
    "stride": "an argument's memory layout changes between calls: call .contiguous() on it first",
    "offset": "an argument is sometimes a view at a nonzero storage offset and sometimes not: this costs one "
              "extra compile per site, no more",
    "device": "the same line runs on several devices: expected once per device",
    "scalar_type": "a Python number changes type between calls (int vs float): use one type",
    "storage": "the storage behind an argument changes size (views of differently sized tensors): "
               "call .contiguous() or keep the base tensors one size",
    "precision": "the float32 matmul precision changes between calls: set it once",
    "structure": "the recorded ops differ between runs (data-dependent Python control flow or a changing "
                 "number of steps between materializations): keep the loop body the same every step",
}

_lock = threading.Lock()
_sites: dict[tuple, Site] = {}
_log: collections.deque = collections.deque(maxlen=256)  # recent recompiles, as dicts
_warned_lines: set = set()  # (filename, line) already warned about


def reset() -> None:
    """Forget every site (tests; metrics.reset does not touch this)."""
    with _lock:
        _sites.clear()
        _log.clear()
        _warned_lines.clear()


# ------------------------------------------------------------------ user frames
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["torch_tpu"]))
_STDLIB_DIR = os.path.dirname(threading.__file__) + os.sep
_is_library: dict = {}


def _library(filename: str) -> bool:
    if filename.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen"):
        return True
    return filename.startswith(_STDLIB_DIR) and "-packages" + os.sep not in filename


def user_code(frame):
    """(code, line) of the innermost frame from `frame` outwards outside torch, torch_tpu and the stdlib, or None.

    DeferAndFuse calls this for every recorded op: codes are classified once and cached.
    """
    while frame is not None:
        code = frame.f_code
        library = _is_library.get(code)
        if library is None:
            library = _is_library[code] = _library(code.co_filename)
        if not library:
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def user_frame(frame=None):
    """(filename, line, function) of the innermost frame outside torch, torch_tpu and the stdlib, or None."""
    found = user_code(sys._getframe(1) if frame is None else frame)
    if found is None:
        return None
    code, line = found
    return code.co_filename, line, code.co_name


def traceback_line(where) -> str:
    """A (code, line) site (`user_code`'s) as a traceback line, with its source text."""
    if where is None:
        return "recorded by the autograd engine or library code (no user frame)"
    code, line = where
    text = linecache.getline(code.co_filename, line).strip()
    out = f'File "{code.co_filename}", line {line}, in {code.co_name}'
    return f"{out}\n    {text}" if text else out


def format_where(where) -> str:
    if where is None:
        return "<no user frame: the autograd engine or library code>"
    filename, line, function = where
    return f"{filename}:{line} ({function})"


# ------------------------------------------------------------------ hooks
def op_compiled(key, spec) -> None:
    """Hook: the strict/defer executors built a new op program for signature `key` (eager/program.py layout)."""
    site_key = ("op", spec.name, user_frame(sys._getframe(1)))
    _seen(site_key, "op", spec.name, site_key[2], key, lambda old: diff_op_keys(spec, old, key))


def segment_compiled(segment, nodes, key) -> None:
    """Hook: DeferAndFuse compiles a fused segment (eager/defer.py Segment._compile)."""
    wheres = [nodes[i].where for i in segment.nodes]
    first = next((w for w in wheres if w is not None), None)
    last = next((w for w in reversed(wheres) if w is not None), None)
    first, last = _code_where(first), _code_where(last)
    name = f"fused segment of {len(segment.nodes)} ops"
    if last is not None and last != first:
        name += f" (to {os.path.basename(last[0])}:{last[1]})"
    steps = tuple((nodes[i].prog, nodes[i].where) for i in segment.nodes)
    signature = (steps, key)
    _seen(("segment", first, last, segment.device), "segment", name, first, signature,
          lambda old: diff_segments(old, signature))


def graph_compiled(name: str, example_inputs, where=None, static: dict | None = None) -> None:
    """Hook for the torch.compile backend: graph `name` is compiled for `example_inputs`.

    `static`: values the graph was specialized on ({label: value}); `where`
    defaults to the first user frame of the caller's stack.
    """
    where = user_frame(sys._getframe(1)) if where is None else where
    signature = describe_inputs(example_inputs, static)
    _seen(("graph", name, where), "graph", name, where, signature, lambda old: diff_described(old, signature),
          every=True)


def describe_inputs(inputs, static: dict | None = None) -> dict:
    """{label: description} of a graph's inputs: tensors by dtype/shape/stride/device, others by value."""
    out = {}
    for i, value in enumerate(inputs):
        label = f"input {i}"
        if isinstance(value, torch.Tensor):
            out[label] = ("T", value.dtype, tuple(value.shape), tuple(value.stride()), str(value.device))
        elif isinstance(value, (torch.SymInt, torch.SymFloat)):
            out[label] = ("dynamic", type(value).__name__)
        else:
            out[label] = ("V", value)
    for label, value in (static or {}).items():
        out[str(label)] = ("V", value)
    return out


def _code_where(where):
    """defer.py's (code, line) as (filename, line, function)."""
    if where is None:
        return None
    code, line = where
    return code.co_filename, line, code.co_name


_KEEP = 16  # signatures kept per site to explain the next compile against


def epoch() -> int:
    """Materialization points so far: compiles between two of them belong to one pass over the code."""
    c = metrics.counts
    return c.materializations + c.flushes


def _seen(site_key, kind, name, where, signature, differ, every: bool = False) -> None:
    """Record one compile at a site; explain it if it is a recompile.

    A site recompiles when it compiles again after a materialization point (a
    later pass over the same code: the next step of a loop), or, with `every`
    (torch.compile graphs), on any second compile. Signatures compiled in the
    first pass (a loop over parameters of different shapes on one line) are
    distinct programs, not recompiles.
    """
    now = epoch()
    with _lock:
        site = _sites.get(site_key)
        if site is None:
            site = _sites[site_key] = Site(kind, name, where, now)
        site.compiles += 1
        previous = site.signatures
        site.signatures = [*previous[-(_KEEP - 1):], signature]
        if not previous or (not every and now == site.first_epoch):
            return
        # Explained against the closest signature compiled here before.
        changes = min((differ(old) for old in reversed(previous)), key=len)
        changes = changes or [Change("signature", "structure", "(other)", "(other)")]
        site.recompiles += 1
        site.last_changes = changes
        for change in changes:
            site.reasons[change.kind] += 1
        entry = {"kind": kind, "name": name, "where": format_where(where), "compile": site.compiles,
                 "changes": [c.as_dict() for c in changes]}
        _log.append(entry)
        # Sites without a user line (backward ops run by the autograd engine) are logged and
        # reported, not warned about: there is no line to fix, their forward sites say it.
        warn = not site.warned and site.recompiles >= config.recompile_warn_limit and where is not None
        if warn:
            site.warned = True
            line = (where[0], where[1])
            warn = line not in _warned_lines  # one warning per line, not per op on it
            _warned_lines.add(line)
    if config.explain_recompiles:
        print(message(site, changes), file=sys.stderr, flush=True)
    if warn:  # attributed to the user's line, where the fix goes
        warnings.warn_explicit(warning_text(site), RecompileWarning, where[0], where[1],
                               module=os.path.splitext(os.path.basename(where[0]))[0])


# ------------------------------------------------------------------ messages
def message(site: Site, changes) -> str:
    """The log line of one recompile."""
    shown = "; ".join(str(c) for c in changes[:6])
    if len(changes) > 6:
        shown += f"; and {len(changes) - 6} more"
    return (f"[torch_tpu recompile] {site.name} at {site.location}: compile #{site.compiles} of this site "
            f"because {shown}")


def warning_text(site: Site) -> str:
    kinds = [k for k, _ in site.reasons.most_common()]
    fixes = " Also: ".join(FIXES[k] for k in kinds[:2] if k in FIXES)
    last = "; ".join(str(c) for c in site.last_changes[:3])
    return (f"{site.name} at {site.location} has compiled {site.compiles} times ({site.recompiles} recompiles; "
            f"last because {last}). Fix: {fixes}. Set TORCH_TPU_EXPLAIN_RECOMPILES=1 to log every recompile; "
            f"docs/troubleshooting.md.")


def summary(limit: int = 10) -> list[dict]:
    """The top recompiling sites, most recompiles first, as dicts (kind, name, where, counts, reasons)."""
    with _lock:
        sites = sorted((s for s in _sites.values() if s.recompiles), key=lambda s: -s.recompiles)[:limit]
        return [{"kind": s.kind, "name": s.name, "where": s.location, "compiles": s.compiles,
                 "recompiles": s.recompiles, "reasons": dict(s.reasons),
                 "last": [c.as_dict() for c in s.last_changes],
                 "fix": FIXES.get(s.reasons.most_common(1)[0][0], "") if s.reasons else ""} for s in sites]


def recent() -> list[dict]:
    """The last recompiles (at most 256), oldest first."""
    with _lock:
        return list(_log)


def total() -> int:
    """Recompiles seen so far, all sites."""
    with _lock:
        return sum(s.recompiles for s in _sites.values())


def _section() -> dict:
    rows = {}
    for s in summary(5):
        reasons = ", ".join(f"{k} {n}" for k, n in s["reasons"].items())
        last = s["last"][0] if s["last"] else None
        detail = f"; last: {last['what']} {last['old']} -> {last['new']}" if last else ""
        rows[f"{s['name']} at {s['where']}"] = f"{s['recompiles']} recompiles ({reasons}{detail})"
    if not rows:
        rows["sites"] = "none recompiled"
    return rows


metrics.add_section("recompiles", _section)


def _plain(value):
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return str(value)


# ------------------------------------------------------------------ diffs
_ENTRY_KINDS = {"T", "C", "S", "L", "V"}


def diff_op_keys(spec, old: tuple, new: tuple) -> list[Change]:
    """What differs between two op-program keys of one op (layout in eager/program.py)."""
    n = spec.n_args
    changes = []
    if old[1] != new[1]:
        changes.append(Change("device", "device", f"tpu:{old[1]}", f"tpu:{new[1]}"))
    for i in range(n):
        changes.extend(_diff_entry(f"argument '{spec.names[i]}'", old[2 + i], new[2 + i]))
    old_slots, new_slots = old[2 + n], new[2 + n]
    shapes_changed = any(c.kind == "shape" for c in changes)  # then storage sizes change too: not news
    if len(old_slots) == len(new_slots):
        for s, (a, b) in enumerate(zip(old_slots, new_slots)):
            if a[1] != b[1] and not shapes_changed:
                changes.append(Change(f"storage of {_slot_owner(spec, new, s)} (bytes)", "storage", a[1], b[1]))
            elif a[1] != b[1]:
                pass
            elif a[0] != b[0] and (a[0] is None or b[0] is None):
                written = "never written" if a[0] is None else str(a[0])
                changes.append(Change(f"storage of {_slot_owner(spec, new, s)}", "storage", written,
                                      "never written" if b[0] is None else str(b[0])))
            elif a[0] != b[0]:
                changes.append(Change(f"storage dtype of {_slot_owner(spec, new, s)}", "dtype", a[0], b[0]))
    if len(old) > 3 + n and len(new) > 3 + n and old[-1] != new[-1]:
        changes.append(Change("float32 matmul precision", "precision", old[-1], new[-1]))
    return changes


def _slot_owner(spec, key, slot) -> str:
    from torch_tpu.eager.keys import tensor_entries  # a function of the key layout, not the executor

    names = [f"'{spec.names[i]}'" for i in range(spec.n_args)
             if any(e[5] == slot for e in tensor_entries(spec.kinds[i], key[2 + i]))]
    return "argument " + "/".join(names) if names else f"slot {slot}"


def _diff_entry(what: str, a, b) -> list[Change]:
    if a == b:
        return []
    if a is None or b is None:
        return [Change(what, "static", "None" if a is None else "given", "None" if b is None else "given")]
    tagged_a = type(a) is tuple and a and a[0] in _ENTRY_KINDS and type(a[0]) is str
    tagged_b = type(b) is tuple and b and b[0] in _ENTRY_KINDS and type(b[0]) is str
    if tagged_a and tagged_b and a[0] == b[0]:
        tag = a[0]
        if tag == "T":
            return _diff_tensor(what, a, b)
        if tag == "C":
            return [Change(f"{what} (CPU scalar tensor) dtype", "dtype", a[1], b[1])]
        if tag == "S":
            return [Change(f"{what} (runtime scalar) type", "scalar_type", a[1].__name__, b[1].__name__)]
        if tag == "L":
            return [Change(f"{what} (runtime scalar list) types", "scalar_type", _names(a[1]), _names(b[1]))]
        if tag == "V":  # a scalar this op compiles in (Lowering.static_scalars)
            return [Change(f"{what} (a scalar compiled into the program)", "static", a[1], b[1])]
    if type(a) is tuple and type(b) is tuple and all(e is None or _is_tensor_entry(e) for e in a + b):
        if len(a) != len(b):
            return [Change(f"{what} (tensor list) length", "shape", len(a), len(b))]
        out = []
        for j, (x, y) in enumerate(zip(a, b)):
            out.extend(_diff_entry(f"{what}[{j}]", x, y))
        return out
    if tagged_a and tagged_b:
        return [Change(f"{what} kind", "static", _kind_name(a), _kind_name(b))]
    return [Change(f"static {what}", "static", a, b)]


def _is_tensor_entry(e) -> bool:
    return type(e) is tuple and len(e) == 6 and e[0] == "T"


def _names(types) -> str:
    return "(" + ", ".join(t.__name__ for t in types) + ")"


def _kind_name(entry) -> str:
    return {"T": "tpu tensor", "C": "CPU scalar tensor", "S": "runtime scalar", "L": "scalar list",
            "V": "static scalar"}[entry[0]]


def _diff_tensor(what: str, a, b) -> list[Change]:
    _, dtype_a, sizes_a, strides_a, offset_a, slot_a = a
    _, dtype_b, sizes_b, strides_b, offset_b, slot_b = b
    out = []
    if dtype_a != dtype_b:
        out.append(Change(f"{what} dtype", "dtype", dtype_a, dtype_b))
    if len(sizes_a) != len(sizes_b):
        out.append(Change(f"{what} shape (rank)", "shape", list(sizes_a), list(sizes_b)))
    else:
        for d, (x, y) in enumerate(zip(sizes_a, sizes_b)):
            if x != y:
                out.append(Change(f"{what} size[{d}]", "shape", x, y))
        if sizes_a == sizes_b and strides_a != strides_b:
            out.append(Change(f"{what} stride", "stride", list(strides_a), list(strides_b)))
    if offset_a != offset_b:
        def show(o):
            return "nonzero (runtime)" if o < 0 else "0"
        out.append(Change(f"{what} storage offset", "offset", show(offset_a), show(offset_b)))
    if slot_a != slot_b:
        out.append(Change(f"{what} storage sharing (slot)", "storage", slot_a, slot_b))
    return out


def diff_segments(old, new) -> list[Change]:
    """What differs between two compiles of one DeferAndFuse segment site."""
    (old_steps, old_key), (new_steps, new_key) = old, new
    if len(old_steps) != len(new_steps) or any(
            a[0].spec.name != b[0].spec.name for a, b in zip(old_steps, new_steps)):
        return [Change("recorded ops", "structure", f"{len(old_steps)} ops", f"{len(new_steps)} ops")]
    changes = []
    for (prog_a, _), (prog_b, where) in zip(old_steps, new_steps):
        if prog_a is prog_b:
            continue
        where = _code_where(where)
        at = f" (at {os.path.basename(where[0])}:{where[1]})" if where else ""
        for c in diff_op_keys(prog_b.spec, prog_a.key, prog_b.key):
            changes.append(Change(f"{prog_b.spec.name}{at} {c.what}", c.kind, c.old, c.new))
    if not changes and old_key != new_key:
        if type(new_key) is tuple and len(new_key) == 2 and type(new_key[1]) is tuple:
            changes.append(Change("view offsets compiled as constants", "offset", "other offsets",
                                  "runtime offsets from now on"))
        else:
            changes.append(Change("wiring, outputs or donated inputs", "structure", "(previous)", "(other)"))
    return changes


def diff_described(old: dict, new: dict) -> list[Change]:
    """What differs between two `describe_inputs` results (torch.compile graphs)."""
    changes = []
    for label in list(old) + [k for k in new if k not in old]:
        a, b = old.get(label), new.get(label)
        if a == b:
            continue
        if a is None or b is None:
            changes.append(Change(label, "structure", "absent" if a is None else "present",
                                  "absent" if b is None else "present"))
        elif a[0] == "T" and b[0] == "T":
            if a[1] != b[1]:
                changes.append(Change(f"{label} dtype", "dtype", a[1], b[1]))
            if len(a[2]) != len(b[2]):
                changes.append(Change(f"{label} shape (rank)", "shape", list(a[2]), list(b[2])))
            else:
                changes.extend(Change(f"{label} size[{d}]", "shape", x, y)
                               for d, (x, y) in enumerate(zip(a[2], b[2])) if x != y)
                if a[2] == b[2] and a[3] != b[3]:
                    changes.append(Change(f"{label} stride", "stride", list(a[3]), list(b[3])))
            if a[4] != b[4]:
                changes.append(Change(f"{label} device", "device", a[4], b[4]))
        else:
            changes.append(Change(f"static {label}", "static", a[-1], b[-1]))
    return changes


def source_line(where) -> str:
    """The text of a site's user line ('' if unknown)."""
    if where is None:
        return ""
    return linecache.getline(where[0], where[1]).strip()
