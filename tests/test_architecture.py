"""The package's import structure, read from the source with ``ast`` (nothing is imported): no
import cycle among the checked modules. Compared against: the import graph itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pipeloom"

CHECKED = ("pipeloom.graph", "pipeloom.problem", "pipeloom.search", "pipeloom.plan.dag")
"""Modules (and packages, with everything under them) that must lie on no import cycle; extend
this to ``("pipeloom",)`` once the rest of the package is free of cycles."""


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package modules ``tree`` imports, at any depth (a function's lazy import counts: it
    still runs), leaving out ``if TYPE_CHECKING:`` blocks. ``from a import b`` names ``a.b`` when
    that is a module, else ``a``."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    found.add(target)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Per package module: the package modules it imports."""
    modules = _modules()
    return {
        name: _imports(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _checked(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in CHECKED)


def test_the_import_graph_is_read_from_the_source():
    graph = import_graph()
    assert "pipeloom.graph" in graph["pipeloom.problem"]
    assert {"pipeloom.search.common", "pipeloom.search.steady"} <= graph["pipeloom.search.exact"]
    assert graph["pipeloom.graph"] == set()  # the graph module stands alone


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("prefix", CHECKED)
def test_no_import_cycle_reaches_the_checked_modules(prefix):
    on_cycles = [component for component in cycles(import_graph())
                 if any(_checked(name) and (name == prefix or name.startswith(prefix + "."))
                        for name in component)]
    assert on_cycles == [], f"import cycles through {prefix}: {on_cycles}"
