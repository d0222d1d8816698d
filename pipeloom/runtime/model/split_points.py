"""Where stages start: the split points (module names) resolved to positions in the traced graph, checked against
names the model does not call (with the name meant), their order, an empty first stage and modules kept whole."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from torch import fx

from pipeloom.runtime.errors import SplitError, SplitOrderError, UnknownSplitPointError
from pipeloom.runtime.model.tracing import module_scopes

__all__ = ["stage_starts"]


def _first_calls(graph: fx.Graph) -> dict[str, int]:
    """Node position of the first node inside each module (its scopes: every enclosing module name)."""
    first: dict[str, int] = {}
    for position, node in enumerate(graph.nodes):
        for name in module_scopes(node):
            first.setdefault(name, position)
    return first


def _spans(graph: fx.Graph, names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """First and last node position inside each of ``names`` (modules kept whole)."""
    spans: dict[str, tuple[int, int]] = {}
    wanted = set(names)
    for position, node in enumerate(graph.nodes):
        for name in wanted.intersection(module_scopes(node)):
            spans[name] = (spans.get(name, (position, position))[0], position)
    return spans


def _nearest(name: str, called: list[str]) -> str:
    """What the model calls nearest ``name``, for its error: the closest spellings of a misspelt name, else the called
    modules of its parent (``model.layers.12`` on an 8-layer model: ``model.layers.0`` ... ``model.layers.7``), or the
    same child of the parent meant (``model.layer.3``: ``model.layers.3``); '' where none."""
    parent, _, last = name.rpartition(".")
    close = [] if last.isdigit() else difflib.get_close_matches(name, called, n=3)
    if close:
        return f" (did you mean {' or '.join(map(repr, close))}?)"
    siblings = [other for other in called if other.rpartition(".")[0] == parent]
    if not siblings and parent:  # the parent misspelt (model.layer.3): the same child of the parent meant
        meant = [f"{other}.{last}" for other in difflib.get_close_matches(parent, called, n=3) if f"{other}.{last}"
                 in called]
        return f" (did you mean {meant[0]!r}?)" if meant else ""
    listed = siblings if len(siblings) <= 4 else [*siblings[:2], "...", siblings[-1]]
    return f" ({parent or 'the model'} calls {len(siblings)}: {', '.join(listed)})" if siblings else ""


def stage_starts(graph: fx.Graph, split_points: Sequence[str], leaf_modules: Sequence[str] = ()) -> list[int]:
    """Node positions where stages 1.. start, checked against unknown names, order, emptiness and
    modules kept whole."""
    if isinstance(split_points, str):
        raise SplitError(f"split_points must be a list of module names, got the string {split_points!r}; "
                         f"write [{split_points!r}]")
    first = _first_calls(graph)
    inside = [name for name in first if any(name.startswith(leaf + ".") for leaf in leaf_modules)]
    for name in inside:
        del first[name]
    targets = list(dict.fromkeys(str(n.target) for n in graph.nodes if n.op == "call_module")) or list(first)
    unknown = [name for name in split_points if name not in first]
    if unknown:
        shown = targets if len(targets) <= 20 else [*targets[:20], f"... {len(targets) - 20} more"]
        child = next((name for name in targets if "." in name), None)  # the example: this model's own names
        parent = f", e.g. {child.rpartition('.')[0]!r} for {child!r}" if child else ""
        raise UnknownSplitPointError(
            f"unknown split point(s) {unknown}{_nearest(unknown[0], list(first))}; valid names are the called "
            f"modules, in call order: {shown} (or any parent of them{parent})"
            + ("; modules inside leaf_modules are kept whole and cannot start a stage"
               if any(name.startswith(leaf + ".") for name in unknown for leaf in leaf_modules) else "")
        )
    duplicated = sorted({name for name in split_points if list(split_points).count(name) > 1})
    if duplicated:
        raise SplitOrderError(f"split point(s) {duplicated} given more than once; give each once")
    starts = [first[name] for name in split_points]
    first_compute = next(i for i, n in enumerate(graph.nodes) if n.op not in ("placeholder", "get_attr"))
    if starts and starts[0] <= first_compute:
        raise SplitOrderError(f"split point {split_points[0]!r} leaves stage 0 empty: it is the model's "
                              "first computation; drop it")
    for s in range(1, len(starts)):
        if starts[s] <= starts[s - 1]:
            in_order = sorted(split_points, key=first.__getitem__)
            raise SplitOrderError(
                f"split point {split_points[s]!r} is first called before or together with "
                f"{split_points[s - 1]!r}, which would leave a stage empty; list split points in call "
                f"order, each calling later than the one before: {in_order}"
            )
    for leaf, (begin, end) in _spans(graph, leaf_modules).items():
        for name, start in zip(split_points, starts):
            if begin < start <= end:
                raise SplitOrderError(f"split point {name!r} would cut {leaf!r}, which leaf_modules keeps whole; "
                                      f"move the split point before or after {leaf!r}")
    return starts
