"""The import graph of torch_tpu's sources (docs/architecture.md, "Layers").

Pure AST, no torch_tpu import: every `import` statement counts, at module level or
inside a function (a lazy import is still a dependency, and a cycle of lazy imports
still decides which module can be loaded first).

- The layers under the executors (runtime/, cache/, ops/ with the lowerings, and
  precision.py, which the lowerings use) import no executor module (eager/, compile/,
  distributed/).
- No two torch_tpu modules import each other.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "torch_tpu"

LOWER = ("torch_tpu.runtime", "torch_tpu.cache", "torch_tpu.ops", "torch_tpu.precision")
EXECUTORS = ("torch_tpu.eager", "torch_tpu.compile", "torch_tpu.distributed")

# Pairs of modules that still import each other, each with its reason: none.
MUTUAL: dict = {}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules(root: pathlib.Path) -> dict:
    """module name -> (path, is a package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts.pop()
        found[".".join(parts)] = (path, package)
    return found


def _extensions(package: str, tree: ast.Module, modules: dict) -> set:
    """Submodules of `package` that are not Python files: what its __init__ imports from itself that
    `modules` lacks (the native extension `_native`, built by `make`)."""
    return {a.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == package
            and not node.level for a in node.names if f"{package}.{a.name}" not in modules}


def import_graph(root: pathlib.Path = ROOT) -> dict:
    """module -> {imported module: line of its first import}, over every import statement."""
    modules = _modules(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in modules.items()}
    top = root.name
    extensions = {name: _extensions(name, trees[name], modules) for name, (_, package) in modules.items() if package}

    def resolve(target: str):
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph = {}
    for name, (path, package) in modules.items():
        edges = graph[name] = {}
        for node in ast.walk(trees[name]):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = name.split(".")[: len(name.split(".")) - (node.level - (1 if package else 0))]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif base in extensions and alias.name in extensions[base]:
                        continue  # a native extension: no Python module, no cycle
                    else:
                        targets.append(base)
            for target in targets:
                if target != top and not target.startswith(top + "."):
                    continue
                found = resolve(target)
                if found is not None and found != name:
                    edges.setdefault(found, node.lineno)
    return graph


def mutual_pairs(graph: dict) -> dict:
    """{frozenset({a, b}): (line in a, line in b)} for modules that import each other."""
    pairs = {}
    for a, edges in graph.items():
        for b, line in edges.items():
            if a < b and a in graph.get(b, {}):
                pairs[frozenset({a, b})] = (f"{a}:{line}", f"{b}:{graph[b][a]}")
    return pairs


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_lower_layers_import_no_executor(graph):
    bad = [f"{a} imports {b} (line {line})" for a, edges in sorted(graph.items()) if _within(a, LOWER)
           for b, line in sorted(edges.items()) if _within(b, EXECUTORS)]
    assert not bad, "runtime/, cache/, ops/ and precision.py must import no executor:\n" + "\n".join(bad)


def test_no_two_modules_import_each_other(graph):
    pairs = mutual_pairs(graph)
    new = {pair: where for pair, where in pairs.items() if pair not in MUTUAL}
    assert not new, "modules that import each other:\n" + "\n".join(" <-> ".join(w) for w in new.values())
    stale = [" <-> ".join(sorted(pair)) for pair in MUTUAL if pair not in pairs]
    assert not stale, "no longer import each other (remove them from MUTUAL):\n" + "\n".join(stale)


def test_graph_sees_known_edges(graph):
    # Module-level, lazy (function-level) and `from package import submodule` imports all count.
    assert "torch_tpu.eager.executor" in graph["torch_tpu.eager.defer"]
    assert "torch_tpu.runtime.strided" in graph["torch_tpu.precision"]  # inside a function
    assert "torch_tpu.runtime.strided" in graph["torch_tpu.runtime.transfer"]
    assert "torch_tpu.eager.defer" in graph["torch_tpu.eager.kernels"]  # inside register_all
    assert "torch_tpu" not in graph["torch_tpu.device"]  # `from torch_tpu import _native`: the extension


def test_detects_lazy_cycles_and_layer_breaks(tmp_path):
    pkg = tmp_path / "torch_tpu"
    for sub in ("eager", "runtime"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from torch_tpu import _native\n")
    (pkg / "eager" / "a.py").write_text("from torch_tpu.eager import b\n")
    (pkg / "eager" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "runtime" / "r.py").write_text("def g():\n    import torch_tpu.eager.a\n")
    g = import_graph(pkg)
    assert mutual_pairs(g).keys() == {frozenset({"torch_tpu.eager.a", "torch_tpu.eager.b"})}
    assert g["torch_tpu.runtime.r"] == {"torch_tpu.eager.a": 2}
    assert g["torch_tpu"] == {}
