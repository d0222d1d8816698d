"""Print the import graph between pipeloom's packages as a mermaid diagram (read from the code).

Each node is a top-level package or module of ``pipeloom`` (``plan``, ``ir``, ``sim``...); an edge
``a --> b`` means some module of ``a`` imports one of ``b`` at import time, ``a -.-> b`` only inside
a function (loaded on first use). Edges that close a cycle between packages are listed after the
diagram. Run: ``python benchmarks/import_graph.py`` (``--lazy`` to draw the function-level edges too).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pipeloom"
LEAVES = {"errors", "__init__", "__main__"}  # imported by everything or by nothing: left out of the picture


def _unit(module: str) -> str | None:
    """``pipeloom.plan.costs`` -> ``plan``; None outside pipeloom."""
    parts = module.split(".")
    if parts[0] != "pipeloom":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(relative.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether ``name`` (``pipeloom.graph``) is a module or package of pipeloom."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported module, at import time?)`` for every import in ``path`` (TYPE_CHECKING ones left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.extend((f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base, top)
                             for alias in child.names)
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return found


def package_edges() -> dict[tuple[str, str], bool]:
    """``(importer, imported) -> at import time?`` between pipeloom's top-level units."""
    edges: dict[tuple[str, str], bool] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = _unit(_module_name(path)) if path != ROOT / "__init__.py" else "__init__"
        for module, top in _imports(path):
            target = _unit(module)
            if target is None or source is None or target == source or {source, target} & LEAVES:
                continue
            edges[(source, target)] = edges.get((source, target), False) or top
    return edges


def cycles(edges: dict[tuple[str, str], bool]) -> list[tuple[str, str]]:
    """Import-time edges ``a -> b`` where ``b`` also reaches ``a`` at import time."""
    strong = {edge for edge, top in edges.items() if top}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            node = todo.pop()
            for a, b in strong:
                if a == node and b not in seen:
                    if b == goal:
                        return True
                    seen.add(b)
                    todo.append(b)
        return False

    return sorted((a, b) for a, b in strong if reaches(b, a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lazy", action="store_true", help="also draw imports made inside functions")
    args = parser.parse_args()
    edges = package_edges()
    print("```mermaid")
    print("graph TD")
    for (a, b), top in sorted(edges.items()):
        if top or args.lazy:
            print(f"  {a} {'-->' if top else '-.->'} {b}")
    print("```")
    loops = cycles(edges)
    print("import-time cycles between packages:", ", ".join(f"{a} -> {b}" for a, b in loops) or "none")


if __name__ == "__main__":
    main()
