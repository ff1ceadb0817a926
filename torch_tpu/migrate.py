"""Find PyTorch/XLA and CUDA-specific code and rewrite what is mechanical for the tpu device.

Python files are parsed with libcst (a concrete syntax tree: rewriting it keeps
formatting and comments); names are resolved through the file's imports
(`import torch_xla.core.xla_model as xm` makes `xm.mark_step` the name
`torch_xla.core.xla_model.mark_step`). Each finding has a file, line, what it
is, the tpu replacement and whether the rewrite is mechanical (safe to apply
unattended). `rewrite` applies the mechanical ones; an import of torch_xla is
removed only when every use of it in the file was rewritten.

`torch-tpu migrate PATH [--apply] [--check] [--json]` (cli_migrate.py) is the
command; docs/migration.md lists every rule.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re

import libcst as cst
from libcst.metadata import ParentNodeProvider, PositionProvider

XLA, CUDA = "pytorch/xla", "cuda"


@dataclasses.dataclass
class Finding:
    path: str
    line: int
    column: int
    category: str  # XLA or CUDA
    what: str  # the code found, e.g. "xm.mark_step()"
    replacement: str  # what to use on tpu
    mechanical: bool  # --apply rewrites it

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self):
        tag = "mechanical" if self.mechanical else "manual"
        return f"{self.path}:{self.line}: [{self.category}, {tag}] {self.what} -> {self.replacement}"


def _tpu_names() -> frozenset:
    from torch_tpu import device

    return frozenset(device.__all__)


# Fully qualified torch_xla names: (replacement code or None for "delete the statement", tpu advice, mechanical).
_DELETE = None
XLA_CALLS = {
    "torch_xla.core.xla_model.xla_device": ('torch.device("tpu")', 'torch.device("tpu")', True),
    "torch_xla.device": ('torch.device("tpu")', 'torch.device("tpu")', True),
    "torch_xla.core.xla_model.mark_step": (_DELETE, "nothing: tpu ops run eagerly; delete the call", True),
    "torch_xla.sync": (_DELETE, "nothing: tpu ops run eagerly; delete the call", True),
    "torch_xla.core.xla_model.wait_device_ops": ("torch.tpu.synchronize()", "torch.tpu.synchronize()", True),
    "torch_xla.core.xla_model.optimizer_step": (
        None, "optimizer.step(); reduce gradients across processes with DistributedDataParallel", False),
    "torch_xla.core.xla_model.get_ordinal": (None, "torch.distributed.get_rank()", False),
    "torch_xla.runtime.global_ordinal": (None, "torch.distributed.get_rank()", False),
    "torch_xla.core.xla_model.get_local_ordinal": (None, 'int(os.environ["LOCAL_RANK"]) (torchrun sets it)', False),
    "torch_xla.runtime.local_ordinal": (None, 'int(os.environ["LOCAL_RANK"]) (torchrun sets it)', False),
    "torch_xla.core.xla_model.xrt_world_size": (None, "torch.distributed.get_world_size()", False),
    "torch_xla.runtime.world_size": (None, "torch.distributed.get_world_size()", False),
    "torch_xla.core.xla_model.is_master_ordinal": (None, "torch.distributed.get_rank() == 0", False),
    "torch_xla.core.xla_model.master_print": (None, "print(...) under `if torch.distributed.get_rank() == 0`", False),
    "torch_xla.core.xla_model.save": (None, "torch.save(...) of CPU copies (state_dict moved with .cpu())", False),
    "torch_xla.core.xla_model.all_reduce": (None, "torch.distributed.all_reduce (backend tpu_dist)", False),
    "torch_xla.core.xla_model.all_gather": (None, "torch.distributed.all_gather_into_tensor", False),
    "torch_xla.core.xla_model.reduce_scatter": (None, "torch.distributed.reduce_scatter_tensor", False),
    "torch_xla.core.xla_model.rendezvous": (None, "torch.distributed.barrier()", False),
    "torch_xla.distributed.xla_multiprocessing.spawn": (
        None, "launch with torchrun --nproc-per-node=N and call the function once per process", False),
    "torch_xla.distributed.parallel_loader.MpDeviceLoader": (
        None, "the DataLoader itself; move each batch with .to(device)", False),
    "torch_xla.distributed.parallel_loader.ParallelLoader": (
        None, "the DataLoader itself; move each batch with .to(device)", False),
    "torch_xla.amp.autocast": (None, 'torch.autocast("tpu", dtype=torch.bfloat16)', False),
    "torch_xla.amp.syncfree": (None, "the torch.optim optimizer", False),
}
_IMPORT_ADVICE = {
    True: "remove the import (torch_tpu registers the tpu device on `import torch`)",
    False: "remove the import once the uses of it reported here are rewritten",
}
_DEVICE = re.compile(r"(cuda|xla)(:\d+)?")


def _dotted(node) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def _module_name(node) -> str:
    return _dotted(node) or ""


class _Rules(cst.CSTTransformer):
    """Collects findings; when `apply` is set, also rewrites the mechanical ones."""

    METADATA_DEPENDENCIES = (PositionProvider, ParentNodeProvider)

    def __init__(self, path: str, apply: bool, removable: frozenset = frozenset()):
        super().__init__()
        self.path = path
        self.apply = apply
        self.removable = removable  # torch_xla aliases whose import goes (every use rewritten)
        self.findings: list[Finding] = []
        self.aliases: dict[str, str] = {}  # local name -> module or object it names
        self.xla_aliases: set[str] = set()
        self.alias_uses: dict[str, int] = {}  # every Name use of a torch_xla alias
        self.alias_rewritten: dict[str, int] = {}  # uses inside mechanical rewrites
        self.has_torch = False
        self.tpu_names = _tpu_names()
        self._in_import = 0
        self._orphans: dict[int, list] = {}  # id(deleted statement line) -> its comment lines
        self._fstring_quotes: list[str] = []  # quotes of the f-strings around the current node

    # ------------------------------------------------------------ helpers
    def _q(self, code: str) -> str:
        """`code` with quotes that can stand inside the enclosing f-strings (before Python 3.12)."""
        if any('"' in q for q in self._fstring_quotes):
            return code.replace('"', "'")
        return code

    def visit_FormattedString(self, node) -> None:
        self._fstring_quotes.append(node.start[-1])

    def leave_FormattedString(self, original, updated):
        self._fstring_quotes.pop()
        return updated

    def _line(self, node) -> tuple[int, int]:
        pos = self.get_metadata(PositionProvider, node).start
        return pos.line, pos.column + 1

    def _add(self, node, category, what, replacement, mechanical) -> None:
        line, column = self._line(node)
        self.findings.append(Finding(self.path, line, column, category, what, replacement, mechanical))

    def _code(self, node) -> str:
        text = cst.Module(body=[]).code_for_node(node)
        text = " ".join(text.split())
        return text if len(text) <= 70 else text[:67] + "..."

    def _resolve(self, node) -> str | None:
        name = _dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        target = self.aliases.get(head)
        if target is None:
            return name
        return f"{target}.{rest}" if rest else target

    def _count_rewritten(self, node) -> None:
        """The torch_xla alias a mechanical rewrite of `node` removes."""
        name = _dotted(node.func if isinstance(node, cst.Call) else node)
        if name:
            head = name.split(".")[0]
            if head in self.xla_aliases:
                self.alias_rewritten[head] = self.alias_rewritten.get(head, 0) + 1

    # ------------------------------------------------------------ imports
    def visit_Import(self, node: cst.Import) -> None:
        self._in_import += 1
        for alias in node.names:
            module = _module_name(alias.name)
            local = alias.asname.name.value if alias.asname else module.split(".")[0]
            target = module if alias.asname else local
            self.aliases[local] = target
            if local == "torch":
                self.has_torch = True
            if module.split(".")[0] == "torch_xla":
                self.xla_aliases.add(local)

    def leave_Import(self, original: cst.Import, updated: cst.Import):
        self._in_import -= 1
        xla = [a for a in original.names if _module_name(a.name).split(".")[0] == "torch_xla"]
        if not xla:
            return updated
        names = ", ".join(_module_name(a.name) for a in xla)
        locals_ = [a.asname.name.value if a.asname else _module_name(a.name).split(".")[0] for a in xla]
        mechanical = all(name in self.removable for name in locals_) and len(xla) == len(original.names)
        self._add(original, XLA, f"import {names}", _IMPORT_ADVICE[mechanical], mechanical)
        if self.apply and mechanical:
            return cst.RemovalSentinel.REMOVE
        return updated

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self._in_import += 1
        module = _module_name(node.module) if node.module else ""
        if isinstance(node.names, cst.ImportStar):
            return
        for alias in node.names:
            name = _module_name(alias.name)
            local = alias.asname.name.value if alias.asname else name
            self.aliases[local] = f"{module}.{name}"
            if module.split(".")[0] == "torch_xla":
                self.xla_aliases.add(local)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom):
        self._in_import -= 1
        module = _module_name(original.module) if original.module else ""
        root = module.split(".")[0]
        if root == "torch_xla":
            names = [] if isinstance(original.names, cst.ImportStar) else [
                a.asname.name.value if a.asname else _module_name(a.name) for a in original.names]
            mechanical = bool(names) and all(n in self.removable for n in names)
            self._add(original, XLA, f"from {module} import ...", _IMPORT_ADVICE[mechanical], mechanical)
            if self.apply and mechanical:
                return cst.RemovalSentinel.REMOVE
        elif module.startswith("torch.cuda"):
            self._add(original, CUDA, f"from {module} import ...",
                      "import from torch.amp / torch.tpu instead (torch.autocast('tpu'), torch.amp.GradScaler)",
                      False)
        return updated

    def visit_Name(self, node: cst.Name) -> None:
        if not self._in_import and node.value in self.xla_aliases:
            self.alias_uses[node.value] = self.alias_uses.get(node.value, 0) + 1

    # ------------------------------------------------------------ calls
    def _deletable(self, stmt) -> bool:
        """`xm.mark_step()` as a statement: deleted by --apply."""
        call = stmt.value if isinstance(stmt, cst.Expr) else None
        if isinstance(call, cst.Call) and not call.args:
            rule = XLA_CALLS.get(self._resolve(call.func) or "")
            return rule is not None and rule[0] is _DELETE and rule[2]
        return False

    def leave_Expr(self, original: cst.Expr, updated: cst.Expr):
        if self._deletable(original):
            self._count_rewritten(original.value)
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        if not self.apply:
            return updated
        kept = [new for new in updated.body if not self._deletable(new)]
        if kept and len(kept) == len(original.body):
            return updated
        if kept:
            kept[-1] = kept[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(body=kept)
        # A deleted line's comments move to the next statement of its block (or its footer).
        self._orphans[id(original)] = [line for line in original.leading_lines if line.comment is not None]
        return cst.RemovalSentinel.REMOVE

    def _rehome_comments(self, original_body, updated_body):
        body, pending, rest = [], [], iter(updated_body)
        for stmt in original_body:
            if id(stmt) in self._orphans:
                pending.extend(self._orphans[id(stmt)])
                continue
            new = next(rest, None)
            if new is None:
                break
            if pending:
                new = new.with_changes(leading_lines=[*pending, *new.leading_lines])
                pending = []
            body.append(new)
        body.extend(rest)
        return body, pending

    def leave_IndentedBlock(self, original, updated):
        if not self.apply:
            return updated
        body, footer = self._rehome_comments(original.body, updated.body)
        if not body:
            body = [cst.SimpleStatementLine([cst.Pass()], leading_lines=footer)]
            footer = []
        return updated.with_changes(body=body, footer=[*footer, *updated.footer])

    def leave_Module(self, original, updated):
        if not self.apply:
            return updated
        body, footer = self._rehome_comments(original.body, updated.body)
        return updated.with_changes(body=body, footer=[*footer, *updated.footer])

    def leave_SimpleStatementSuite(self, original, updated):
        if not self.apply:
            return updated
        kept = [new for new in updated.body if not self._deletable(new)]
        if len(kept) == len(updated.body):
            return updated
        return updated.with_changes(body=kept or [cst.Pass()])

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        func = original.func
        name = self._resolve(func)
        if name is not None and name.split(".")[0] == "torch_xla":
            return self._xla_call(original, updated, name)
        if name is not None and name.startswith("torch.cuda."):
            return self._cuda_call(original, updated, name)
        if isinstance(func, cst.Attribute) and func.attr.value == "cuda" and name != "torch.cuda":
            return self._dot_cuda(original, updated)
        return updated

    def _xla_call(self, original, updated, name):
        rule = XLA_CALLS.get(name)
        what = self._code(original)
        if rule is None:
            self._add(original, XLA, what, "no direct equivalent: see docs/migration.md (PyTorch/XLA)", False)
            return updated
        code, advice, mechanical = rule
        if code is _DELETE:
            parent = self.get_metadata(ParentNodeProvider, original)
            mechanical = mechanical and isinstance(parent, cst.Expr) and not original.args
            self._add(original, XLA, what, advice, mechanical)
            return updated  # leave_Expr deletes the statement
        if not mechanical:
            self._add(original, XLA, what, advice, False)
            return updated
        if name.endswith("xla_device") or name == "torch_xla.device":
            args = [a for a in original.args]
            if len(args) > 1 or any(a.keyword is not None and a.keyword.value != "n" for a in args):
                self._add(original, XLA, what, advice, False)
                return updated
            if args:
                code = f'torch.device("tpu", {cst.Module(body=[]).code_for_node(args[0].value)})'
        mechanical = self.has_torch
        self._add(original, XLA, what, code if mechanical else f"{code} (after `import torch`)", mechanical)
        if not mechanical:
            return updated
        self._count_rewritten(original)
        return cst.parse_expression(self._q(code)) if self.apply else updated

    def _cuda_call(self, original, updated, name):
        rest = name[len("torch.cuda."):]
        what = self._code(original)
        if rest == "amp.autocast":
            mechanical = all(a.keyword is not None for a in original.args)
            self._add(original, CUDA, what, 'torch.autocast("tpu", ...) (bfloat16 by default on tpu)', mechanical)
            if self.apply and mechanical:
                return updated.with_changes(func=cst.parse_expression("torch.autocast"),
                                            args=[cst.Arg(cst.SimpleString(self._q('"tpu"'))), *updated.args])
            return updated
        if rest == "amp.GradScaler":
            self._add(original, CUDA, what, "bfloat16 needs no loss scaling: drop the scaler, or "
                      'torch.amp.GradScaler("tpu") for float16', False)
            return updated
        return updated  # torch.cuda.<fn>(...): the attribute rule rewrites the name

    def _dot_cuda(self, original, updated):
        what = self._code(original)
        args = list(updated.args)
        positional = [a for a in args if a.keyword is None]
        keywords = [a for a in args if a.keyword is not None]
        if any(a.keyword.value not in ("non_blocking", "device") for a in keywords) or len(positional) > 1:
            self._add(original, CUDA, what, '.to("tpu")', False)
            return updated
        device = positional[0].value if positional else next(
            (a.value for a in keywords if a.keyword.value == "device"), None)
        if device is None:
            target = '"tpu"'
        elif not self.has_torch:
            self._add(original, CUDA, what, '.to(torch.device("tpu", i))', False)
            return updated
        else:
            target = f'torch.device("tpu", {cst.Module(body=[]).code_for_node(device)})'
        self._add(original, CUDA, what, f".to({target})", True)
        if not self.apply:
            return updated
        rest = [a for a in keywords if a.keyword.value == "non_blocking"]
        return updated.with_changes(
            func=updated.func.with_changes(attr=cst.Name("to")),
            args=[cst.Arg(cst.parse_expression(self._q(target))), *rest])

    # ------------------------------------------------------------ attributes
    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        name = self._resolve(original)
        if name is None:
            return updated
        parent = self.get_metadata(ParentNodeProvider, original)
        if isinstance(parent, cst.Attribute) and parent.value is original:
            return updated  # only the longest chain
        if name.startswith("torch.cuda.") and not name.startswith("torch.cuda.amp"):
            rest = name[len("torch.cuda."):]
            top = rest.split(".")[0]
            source = _dotted(original)
            what = self._code(parent) if isinstance(parent, cst.Call) and parent.func is original else source
            if top in self.tpu_names and source is not None and source.startswith("torch.cuda."):
                self._add(original, CUDA, what, f"torch.tpu.{rest}", True)
                if self.apply:
                    return cst.parse_expression(f"torch.tpu.{rest}")
            else:
                self._add(original, CUDA, what, f"no torch.tpu.{top}: see docs/migration.md (CUDA)", False)
        elif name.startswith("torch.backends.cudnn"):
            self._add(original, CUDA, _dotted(original) or name,
                      "cuDNN settings do nothing on tpu: remove them", False)
        elif name.split(".")[0] == "torch_xla" and not isinstance(parent, cst.Call) and not self._in_import:
            self._add(original, XLA, _dotted(original) or name,
                      "no direct equivalent: see docs/migration.md (PyTorch/XLA)", False)
        return updated

    # ------------------------------------------------------------ strings
    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString):
        try:
            value = original.evaluated_value
        except Exception:
            return updated
        if not isinstance(value, str):
            return updated
        quote = original.quote
        prefix = original.prefix
        new = None
        if _DEVICE.fullmatch(value):
            kind = value.split(":")[0]
            if kind == "xla" and self._is_backend_arg(original):
                new, category = "tpu_dist", XLA
            else:
                new, category = "tpu" + value[len(kind):], (CUDA if kind == "cuda" else XLA)
        elif value == "nccl":
            new, category = "tpu_dist", CUDA
        elif value == "PJRT_DEVICE":
            new, category = "TORCH_TPU_PLATFORM", XLA
        elif value.startswith("xla://"):
            self._add(original, XLA, original.value, '"env://" (torchrun sets the rendezvous) or "tcp://HOST:PORT"',
                      False)
            return updated
        if new is None:
            return updated
        self._add(original, category, original.value, f"{quote}{new}{quote}", True)
        return updated.with_changes(value=f"{prefix}{quote}{new}{quote}") if self.apply else updated

    def leave_FormattedStringText(self, original, updated):
        parent = self.get_metadata(ParentNodeProvider, original)
        if not isinstance(parent, cst.FormattedString) or parent.parts[0] is not original:
            return updated
        match = re.match(r"(cuda|xla)(:|$)", original.value)
        if match is None or (match.group(2) == "" and len(parent.parts) > 1 and original.value != match.group(1)):
            return updated
        kind = match.group(1)
        self._add(original, CUDA if kind == "cuda" else XLA, self._code(parent), "f\"tpu" +
                  original.value[len(kind):] + '..."', True)
        return updated.with_changes(value="tpu" + original.value[len(kind):]) if self.apply else updated

    def _is_backend_arg(self, node) -> bool:
        arg = self.get_metadata(ParentNodeProvider, node)
        if not isinstance(arg, cst.Arg):
            return False
        call = self.get_metadata(ParentNodeProvider, arg)
        if not isinstance(call, cst.Call):
            return False
        name = _dotted(call.func) or ""
        return name.endswith("init_process_group") and (
            (arg.keyword is not None and arg.keyword.value == "backend") or call.args[0] is arg)


def _parse(text: str, path: str):
    try:
        return cst.MetadataWrapper(cst.parse_module(text))
    except cst.ParserSyntaxError as err:
        raise SyntaxError(f"{path}: cannot parse: {err}") from None


def scan_source(text: str, path: str = "<string>") -> list[Finding]:
    """Every finding in one file's source."""
    wrapper = _parse(text, path)
    rules = _Rules(path, apply=False)
    wrapper.visit(rules)
    return _with_imports(text, path, rules)[1]


def _with_imports(text, path, rules):
    """Second pass knowing which torch_xla imports can go; returns (rules, findings)."""
    removable = frozenset(a for a in rules.xla_aliases
                          if rules.alias_uses.get(a, 0) == rules.alias_rewritten.get(a, 0))
    wrapper = _parse(text, path)
    second = _Rules(path, apply=False, removable=removable)
    wrapper.visit(second)
    second.findings.sort(key=lambda f: (f.line, f.column))
    return removable, second.findings


def rewrite_source(text: str, path: str = "<string>") -> tuple[str, list[Finding]]:
    """(the source with every mechanical finding rewritten, the findings of the original)."""
    wrapper = _parse(text, path)
    first = _Rules(path, apply=False)
    wrapper.visit(first)
    removable, findings = _with_imports(text, path, first)
    if not any(f.mechanical for f in findings):
        return text, findings
    applier = _Rules(path, apply=True, removable=removable)
    new = _parse(text, path).visit(applier)
    return new.code, findings


_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "site-packages", "node_modules", ".tox", ".nox", ".mypy_cache",
              ".pytest_cache"}


def python_files(root: str) -> list[str]:
    """The .py files under `root` (or `root` itself), never following links out of it."""
    root_real = os.path.realpath(root)
    if os.path.isfile(root):
        return [root] if root.endswith(".py") else []
    out = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not os.path.islink(os.path.join(directory, d))
                         and not os.path.exists(os.path.join(directory, d, "pyvenv.cfg")))  # a virtualenv
        for name in sorted(files):
            path = os.path.join(directory, name)
            if name.endswith(".py") and not os.path.islink(path) and _inside(path, root_real):
                out.append(path)
    return out


def _inside(path: str, root_real: str) -> bool:
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def scan(root: str) -> tuple[list[Finding], list[str]]:
    """(findings in every Python file under root, files that could not be parsed)."""
    findings, errors = [], []
    for path in python_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                findings.extend(scan_source(f.read(), path))
        except (SyntaxError, UnicodeDecodeError) as err:
            errors.append(f"{path}: {err}")
    return findings, errors


def apply(root: str) -> tuple[list[Finding], str, list[str]]:
    """Rewrite every mechanical finding under root in place: (findings before, unified diff, errors)."""
    root_real = os.path.realpath(root)
    findings, diffs, errors = [], [], []
    for path in python_files(root):
        if not _inside(path, root_real):  # python_files checks too: never write outside PATH
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            new, found = rewrite_source(text, path)
        except (SyntaxError, UnicodeDecodeError) as err:
            errors.append(f"{path}: {err}")
            continue
        findings.extend(found)
        if new != text:
            try:
                compile(new, path, "exec")
            except SyntaxError as err:  # never write a file that does not parse: report it instead
                errors.append(f"{path}: the rewrite would not parse ({err}); file left unchanged")
                continue
            label = os.path.relpath(path)
            label = path if label.startswith("..") else label
            diffs.append("".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                      f"a/{label}", f"b/{label}")))
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    return findings, "".join(diffs), errors
