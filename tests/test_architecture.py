"""The package's import structure, read from the source with ``ast`` (nothing is imported): no
import cycle anywhere in the package, imports that go the one way docs/architecture.md says, and the
few names looked up on first use (``importlib.import_module``) exactly the documented ones. Compared
against: the import graph itself and the layer table of docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pipeloom"

CHECKED = ("pipeloom",)
"""Modules (and packages, with everything under them) that must lie on no import cycle: all of them."""

LOOKED_UP_ON_USE = {
    ("pipeloom.ir.core", "pipeloom.viz.html"): "Schedule._repr_html_, the notebook view",
    ("pipeloom.sim", "pipeloom.viz.html"): "Timeline._repr_html_, the notebook view",
}
"""The only places a module names one above it, by ``importlib.import_module("...")`` when the name is
first used, so that importing it never imports the layer above (docs/architecture.md, "Looked up on
use"). They are no import edges: left out of the cycle and direction checks, and each must be listed."""

LAYERS = ("errors", "arithmetic", "formatting", "graph", "remote", "problem", "stages", "ir", "lowering", "sim_pricing",
          "sim_compile", "sim_replay", "sim", "validate", "schedules", "search", "trace", "viz", "plan", "runtime",
          "profile", "serve", "cli")
"""The top-level units of ``pipeloom`` from the bottom up (docs/architecture.md's table): each imports only
units listed before it, at any depth and inside functions too. The package's own ``__init__`` and
``__main__`` stand above them all."""

CORE = LAYERS[: LAYERS.index("search") + 1]
"""The model, the IR and what works on them alone."""
NO_HEAVY = {unit: {"torch", "matplotlib"} for unit in (*CORE, "trace", "plan")}
"""Units that import neither torch nor matplotlib, at any depth (docs/design.md, "Layering")."""
TORCH_FREE = {"plan": {"torch", "transformers"}}
"""The planner never imports torch, not even inside a function: it plans clusters it does not run on."""
MOST_MODULES = 20
"""No package folder holds more plain modules than this (its ``__init__`` not counted)."""


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


def _imports(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path],
             lookups: set[str] | None = None, external: set[str] | None = None) -> set[str]:
    """The package modules ``tree`` imports, at any depth (a function's lazy import counts: it
    still runs), leaving out ``if TYPE_CHECKING:`` blocks. ``from a import b`` names ``a.b`` when
    that is a module, else ``a``. ``lookups`` collects the modules named by
    ``import_module("pipeloom...")``; ``external`` the top-level names of other packages imported."""
    lookups = set() if lookups is None else lookups
    external = set() if external is None else external
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
            external.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node):
            lookups.add(node.args[0].value)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if not node.level:
                external.add(base.partition(".")[0])
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
    external.discard("pipeloom")
    return found


def _is_import_module(node: ast.Call) -> bool:
    """``import_module("pipeloom...")`` or ``importlib.import_module("pipeloom...")``."""
    func = node.func
    named = (isinstance(func, ast.Name) and func.id == "import_module") or (
        isinstance(func, ast.Attribute) and func.attr == "import_module")
    return (named and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str) and node.args[0].value.startswith("pipeloom"))


def _scan() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """Per package module: the package modules it imports, those it looks up on use, and the other
    packages it imports (top-level names)."""
    modules = _modules()
    graph, lookups, external = {}, {}, {}
    for name, path in modules.items():
        lookups[name], external[name] = set(), set()
        graph[name] = _imports(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py",
                               modules, lookups[name], external[name])
    return graph, lookups, external


def import_graph() -> dict[str, set[str]]:
    """Per package module: the package modules it imports."""
    return _scan()[0]


def _unit(module: str) -> str:
    """``pipeloom.plan.costs`` -> ``plan``; ``pipeloom`` itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


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


def test_the_scan_sees_lookups_and_other_packages():
    _, lookups, external = _scan()
    assert lookups["pipeloom.ir.core"] == {"pipeloom.viz.html"}
    assert "torch" in external["pipeloom.runtime.engine"] and "torch" not in external["pipeloom.sim"]
    assert "torch" in external["pipeloom.runtime.parallel.tp"]  # a function-level import counts


def test_units_import_only_the_units_below_them():
    wrong = sorted(f"{name} imports {target}" for name, targets in import_graph().items() for target in targets
                   if _unit(name) in LAYERS and _unit(target) in LAYERS
                   and LAYERS.index(_unit(target)) > LAYERS.index(_unit(name)))
    assert wrong == [], "imports against docs/architecture.md's layers:\n" + "\n".join(wrong)


def test_every_unit_has_a_layer():
    units = {_unit(name) for name in _modules()} - {"", "__main__"}
    assert units == set(LAYERS)


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between rooms: a package without subpackages is one room; in a package with
    subpackages each plain module is a room of its own (``runtime.engine``), and so is its ``__init__``."""
    modules = _modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    parents = {name.rpartition(".")[0] for name in packages if name != "pipeloom"}

    def room(name: str) -> str:
        if name in packages:
            return f"{name}.__init__" if name in parents else name
        parent = name.rpartition(".")[0]
        return name if parent in parents else parent

    found: dict[str, set[str]] = {}
    for name, targets in graph.items():
        found.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    return found


def test_no_cycle_between_rooms_counting_imports_inside_functions():
    assert cycles(rooms(import_graph())) == []
    assert "pipeloom.runtime.step" in rooms(import_graph())["pipeloom.runtime.engine"]


def test_outside_init_files_a_module_exports_only_what_it_defines():
    found = []
    for name, path in _modules().items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {name.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    for name in ast.walk(target) if isinstance(name, ast.Name)}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                found += [f"{name}: {elt.value}" for elt in node.value.elts if elt.value not in defined]
    assert found == [], "names exported but not defined here (import them from their home):\n" + "\n".join(found)


def test_no_package_folder_has_more_than_twenty_plain_modules():
    crowded = {}
    for folder in {path.parent for path in ROOT.rglob("*.py")}:
        plain = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(plain) > MOST_MODULES:
            crowded[str(folder.relative_to(ROOT.parent))] = len(plain)
    assert crowded == {}


def test_the_architecture_doc_names_every_module():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = sorted(name for name, path in _modules().items()
                     if path.name not in ("__init__.py", "__main__.py")
                     and f"`{path.relative_to(ROOT.parent).as_posix()}`" not in doc)
    assert missing == [], "docs/architecture.md does not name these modules (as `pipeloom/...py`):\n" + "\n".join(
        missing)


def test_the_planner_never_imports_torch_even_inside_functions():
    _, _, external = _scan()
    heavy = sorted(f"{name} imports {package}" for name, packages in external.items()
                   for package in packages & TORCH_FREE.get(_unit(name), set()))
    assert heavy == []


def test_the_model_and_the_trace_load_neither_torch_nor_matplotlib():
    _, _, external = _scan()
    heavy = sorted(f"{name} imports {package}" for name, packages in external.items()
                   for package in packages & NO_HEAVY.get(_unit(name), set()))
    assert heavy == []


def test_only_the_documented_names_are_looked_up_on_use():
    _, lookups, _ = _scan()
    found = {(name, target) for name, targets in lookups.items() for target in targets}
    assert found == set(LOOKED_UP_ON_USE)
    assert all(target in import_graph() for _, target in found)  # each names a module that exists
