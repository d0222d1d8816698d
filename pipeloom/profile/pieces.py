"""The pieces a model is profiled in: by default its top-level children in call order (a ModuleList expanded into its
elements), traced as the runtime traces it, and the model cut into them as the runtime cuts it (or pieces given as
modules)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipeloom.plan.errors import PlanError
from pipeloom.runtime import ModelTraceError, StagedModel, split_model, stages_from_modules
from pipeloom.runtime.model.tracing import TracedModel, module_scopes, trace_model

__all__ = ["Model", "cut_into_pieces", "default_pieces", "pieces_in_trace", "trace_for_pieces"]

Model = nn.Module | StagedModel | Sequence[nn.Module]
"""What :func:`~pipeloom.profile.model.profile_model` profiles: a model the runtime traces, or its pieces as modules
(manual mode)."""


def default_pieces(model: nn.Module, example_inputs: object = None, *, tracer: str = "auto",
                   leaf_modules: Sequence[str] = ()) -> list[str]:
    """The model's pieces, in the order the traced model first calls them (children never called are
    left out): its top-level children, where a ModuleList or Sequential is expanded into its elements
    (``blocks.0``, ``blocks.1``...) and a child holding a ModuleList somewhere inside (a Hugging Face
    ``transformer`` or ``model`` around its ``h``/``layers``) into its own children by the same rule.
    ``leaf_modules`` stay whole. The model is traced as the runtime traces it (``tracer``: torch.fx,
    falling back to torch.export on ``example_inputs``)."""
    traced = trace_for_pieces(model, example_inputs, tracer=tracer, leaf_modules=leaf_modules)
    return pieces_in_trace(model, traced, leaf_modules)


def pieces_in_trace(model: nn.Module, traced: TracedModel, leaf_modules: Sequence[str]) -> list[str]:
    """:func:`default_pieces` of ``model`` read off its trace ``traced`` (traced once for several uses)."""
    return _call_order(traced, _expand(model, "", set(leaf_modules)))


def _holds_list(module: nn.Module) -> bool:
    return any(isinstance(inner, nn.ModuleList) for inner in module.modules())


def _expand(module: nn.Module, prefix: str, leaves: set[str]) -> list[str]:
    """Piece names under ``module`` by the rule of :func:`default_pieces`."""
    names: list[str] = []
    for name, child in module.named_children():
        full = prefix + name
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and full not in leaves:
            for sub, element in child.named_children():
                element_name = f"{full}.{sub}"
                expand = _holds_list(element) and element_name not in leaves
                names.extend(_expand(element, element_name + ".", leaves) if expand else [element_name])
        elif _holds_list(child) and full not in leaves:
            names.extend(_expand(child, full + ".", leaves))
        else:
            names.append(full)
    return names


def _call_order(traced: TracedModel, names: Sequence[str]) -> list[str]:
    """``names`` the traced graph calls, sorted by their first node; of names starting at one node
    only the first is kept (each must start a piece of its own)."""
    wanted = set(names)
    first: dict[str, int] = {}
    for position, node in enumerate(traced.graph.nodes):
        for scope in module_scopes(node):
            if scope in wanted:
                first.setdefault(scope, position)
    order = sorted(first, key=first.__getitem__)
    return [name for k, name in enumerate(order) if k == 0 or first[name] != first[order[k - 1]]]


def trace_for_pieces(model: nn.Module, inputs: object, *, tracer: str, leaf_modules: Sequence[str]) -> TracedModel:
    """The runtime's trace of ``model``; PlanError with a fix the profiler offers when it cannot trace."""
    if inputs is not None and not isinstance(inputs, tuple):
        inputs = (inputs,)
    try:
        return trace_model(model, tracer=tracer, leaf_modules=leaf_modules, example_inputs=inputs)
    except ModelTraceError as error:
        reason = str(error).split(". Split it by hand")[0].split(". Or give example_inputs")[0]
        raise PlanError(
            f"{reason}; profile its pieces as modules instead: profile_model([module0, module1, ...], inputs), "
            "each taking the one before's output (`pipeloom profile`: return an nn.ModuleList from FUNCTION)"
        ) from error


def cut_into_pieces(model: Model, inputs: tuple, pieces: Sequence[str] | None, *, tracer: str,
                    leaf_modules: Sequence[str]) -> tuple[StagedModel, list[str]]:
    """The model cut into its pieces as the runtime cuts it, and the pieces' names."""
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        traced = trace_for_pieces(model, inputs, tracer=tracer, leaf_modules=leaf_modules)
        names = list(pieces) if pieces is not None else pieces_in_trace(model, traced, leaf_modules)
        unknown = [name for name in names if not _has_module(model, name)]
        if unknown:
            raise PlanError(f"piece(s) {unknown} name no module of {type(model).__name__}; pieces are module names "
                            f"in call order, e.g. {pieces_in_trace(model, traced, leaf_modules)[:4]}")
        if not names:
            raise PlanError(f"{type(model).__name__} calls no submodule to cut at; name the pieces (module names "
                            "in call order), or profile its pieces as a list of modules")
        _check_order(traced, names)
        # the model's own dataflow per piece (no threading of values several pieces read): the planner groups
        # the pieces into stages, and the runtime threads what the chosen stages read
        return split_model(traced, names[1:], leaf_modules=leaf_modules, thread_reads=False), names
    staged = model if isinstance(model, StagedModel) else stages_from_modules(list(model), num_inputs=len(inputs))
    names = list(pieces) if pieces is not None else [str(k) for k in range(staged.num_stages)]
    if len(names) != staged.num_stages or len(set(names)) != len(names):
        raise PlanError(f"{staged.num_stages} pieces given as modules but {len(names)} names {names}; give one "
                        "distinct name per piece, or leave pieces out (named 0, 1, ...)")
    return staged, names


def _check_order(traced: TracedModel, names: Sequence[str]) -> None:
    """PlanError unless the pieces' modules are first called in the order given (each piece runs from its module
    to the next's, the first from the model's start: a name out of order had labelled another piece's costs)."""
    first: dict[str, int] = {}
    for position, node in enumerate(traced.graph.nodes):
        for name in set(names).intersection(module_scopes(node)):
            first.setdefault(name, position)
        if node.op == "call_module" and str(node.target) in names:
            first.setdefault(str(node.target), position)
    ordered = sorted(names, key=lambda name: first.get(name, -1))
    if ordered != list(names):
        raise PlanError(f"pieces {list(names)} are not in call order: the model calls them as {ordered}; give them "
                        "in that order")


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
