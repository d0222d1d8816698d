"""Rewrites of traced graphs before and after they are cut into stages: symbolic sizes measured again
in the stage that uses them, stage inputs that the stage changes in place copied first, and the trace
device written into a graph replaced by the device a stage runs on."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from pipeloom.runtime.errors import SplitError
from pipeloom.runtime.model.tracing import module_scopes

if TYPE_CHECKING:
    from pipeloom.runtime.program import Source

__all__ = ["TRACED_DEVICE", "copy_mutated_inputs", "localize_sizes", "retarget_devices"]

TRACED_DEVICE = "pipeloom_traced_device"
"""``GraphModule.meta`` key: the device torch.export traced on (it writes it into ``to``/``arange`` calls)."""


def _size_source(expr: object, user: fx.Node, stage_of: dict[fx.Node, int | Source],
                 position: dict[fx.Node, float]) -> tuple[fx.Node, int] | None:
    """A tensor that ``user``'s stage has before ``user`` runs (made there, or already an input of the
    stage), nearest first, and a dimension of it whose size is the symbolic ``expr``."""
    stage, when = stage_of[user], position[user]
    # every node with a stage: compute nodes, and placeholders (the model's inputs, MODEL_INPUT)
    candidates = [n for n in stage_of if position[n] < when and isinstance(n.meta.get("val"), torch.Tensor)
                  and (stage_of[n] == stage or any(stage_of.get(u) == stage for u in n.users))]
    for tensor in sorted(candidates, key=position.__getitem__, reverse=True):
        for dim, size in enumerate(tensor.meta["val"].shape):
            if isinstance(size, torch.SymInt) and size.node.expr == expr:
                return tensor, dim
    return None


def localize_sizes(graph: fx.Graph, stage_of: dict[fx.Node, int | Source]) -> None:
    """torch.export's symbolic sizes (``sym_size``) used in another stage are measured again there, on
    a tensor that stage has, so that only tensors cross stage boundaries; a size computed from sizes
    (``Mod(8 - Mod(s70, 8), 8)``: a scan's padding; ``Min(4, s70)``, a top-k's count that a ``no_grad`` region
    returns) is computed again there from sizes measured there. One that cannot be is refused now, naming where it is
    made and used (SplitError)."""
    position: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not isinstance(node.meta.get("val"), torch.SymInt) or node not in stage_of:
            continue
        for user in list(node.users):
            if stage_of.get(user, stage_of[node]) == stage_of[node]:
                continue
            size = _size_in_stage(graph, node, user, stage_of, position, {})
            if size is None:
                raise SplitError(
                    f"the size {node.meta['val'].node.expr} ({node.name}) made in stage {stage_of[node]}"
                    f"{_where(node)} is used in stage {stage_of[user]}{_where(user)} ({user.name}), which has no "
                    "tensor to measure it from again, and only tensors cross stages; choose split points that "
                    "leave both in one stage, or cut the model by hand: "
                    "pipeloom.runtime.stages_from_modules([stage0, stage1, ...])")
            user.replace_input_with(node, size)


def _where(node: fx.Node) -> str:
    """`` (in module 'layers.3.mixer')``: the innermost module whose forward made ``node``, if any."""
    paths = module_scopes(node)
    return f" (in module {paths[-1]!r})" if paths else ""


_INT_OPERATIONS = tuple(getattr(operator, name) for name in (
    "add", "sub", "mul", "floordiv", "mod", "neg", "pow", "truediv")) + (
    torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float, torch.sym_int, torch.sym_ite)


def _size_in_stage(graph: fx.Graph, node: fx.Node, user: fx.Node, stage_of: dict[fx.Node, int | Source],
                   position: dict[fx.Node, float], made: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """A node in ``user``'s stage, before it, whose value is the symbolic size ``node``: a dimension of a
    tensor that stage has, or ``node``'s own integer operation on such sizes (and constants); None if
    neither exists."""
    if node in made:
        return made[node]
    found = _size_source(node.meta["val"].node.expr, user, stage_of, position)
    if found is not None:
        target: object = torch.ops.aten.sym_size.int
        args: tuple = found
    elif node.op != "call_function" or node.target not in _INT_OPERATIONS or node.kwargs:
        rebuilt_size = _expression_in_stage(graph, node.meta["val"], user, stage_of, position)
        if rebuilt_size is not None:
            made[node] = rebuilt_size
        return rebuilt_size
    else:
        rebuilt = []
        for arg in node.args:
            if isinstance(arg, fx.Node):
                if not isinstance(arg.meta.get("val"), (torch.SymInt, int)):
                    return None
                arg = _size_in_stage(graph, arg, user, stage_of, position, made)
                if arg is None:
                    return None
            elif not isinstance(arg, (int, float, bool)):
                return None
            rebuilt.append(arg)
        target, args = node.target, tuple(rebuilt)
    made[node] = _insert(graph, target, args, node.meta["val"], user, stage_of, position)
    return made[node]


def _insert(graph: fx.Graph, target: object, args: tuple, value: object, user: fx.Node,
            stage_of: dict[fx.Node, int | Source], position: dict[fx.Node, float]) -> fx.Node:
    """A call of ``target`` on ``args`` (its value ``value``) in ``user``'s stage, just before ``user``."""
    with graph.inserting_before(user):
        size = graph.call_function(target, args)  # type: ignore[arg-type]
    size.meta["val"] = value
    stage_of[size] = stage_of[user]
    position[size] = position[user] - 0.5
    return size


_SYMPY_OPERATIONS = {"Add": operator.add, "Mul": operator.mul, "Min": torch.sym_min, "Max": torch.sym_max,
                     "FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod}
"""The integer operations of a symbolic size's expression (sympy's and torch's classes by name), as graph calls."""


def _expression_in_stage(graph: fx.Graph, value: torch.SymInt, user: fx.Node,
                         stage_of: dict[fx.Node, int | Source], position: dict[fx.Node, float]) -> fx.Node | None:
    """A node in ``user``'s stage computing the symbolic size ``value`` from its expression (a size made by a node
    that is no integer operation, such as the output of a ``no_grad`` region): its sizes measured on tensors the
    stage has, combined by the expression's operations; None if a size cannot be measured there."""

    def build(expr: object) -> tuple[object, object] | None:  # (node or constant, its value)
        if getattr(expr, "is_Integer", False):
            return int(expr), int(expr)  # type: ignore[call-overload]
        found = _size_source(expr, user, stage_of, position)
        if found is not None:
            tensor, dim = found
            size = tensor.meta["val"].shape[dim]
            return _insert(graph, torch.ops.aten.sym_size.int, found, size, user, stage_of, position), size
        operation = _SYMPY_OPERATIONS.get(type(expr).__name__)
        parts = [build(arg) for arg in getattr(expr, "args", ())] if operation is not None else [None]
        if not parts or any(part is None for part in parts):
            return None
        node, val = parts[0]  # type: ignore[misc]
        for other, other_val in parts[1:]:  # type: ignore[misc]
            val = operation(val, other_val)  # type: ignore[misc]
            node = _insert(graph, operation, (node, other), val, user, stage_of, position)
        return node, val

    built = build(value.node.expr)
    return built[0] if built is not None and isinstance(built[0], fx.Node) else None


_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow,
                       operator.iand, operator.ior, operator.ixor)


def _mutates_first_argument(node: fx.Node, module: nn.Module) -> bool:
    """Whether ``node`` writes into its first argument (``relu_``, ``x.add_``, ``inplace=True``...)."""
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.arguments:
            alias = schema.arguments[0].alias_info
            return bool(alias is not None and alias.is_write)
        name = getattr(node.target, "__name__", "")  # torch.relu_ and the like carry no schema under fx
        in_place_name = name.endswith("_") and not name.startswith("_")
        return in_place_name or node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_module":
        return getattr(module.get_submodule(str(node.target)), "inplace", False) is True
    return False


_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "select", "narrow", "transpose", "permute",
                 "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as", "t", "__getitem__",
                 "split", "chunk", "unbind", "movedim", "diagonal", "as_strided", "unfold", "T", "mT"}


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s result may share memory with its first argument (a view of it)."""
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    if node.op == "call_function":
        if node.target is operator.getitem:
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.returns:
            alias = schema.returns[0].alias_info
            return bool(alias is not None and not alias.is_write and schema.arguments
                        and schema.arguments[0].alias_info is not None)
        return getattr(node.target, "__name__", "") in _VIEW_METHODS
    return False


def _written(node: fx.Node, module: nn.Module) -> bool:
    """Whether ``node``'s value, or a view of it, is changed in place by the graph."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        for user in value.users:
            first = user.args[0] if user.args else None
            if first is value and (_mutates_first_argument(user, module) or user.target is operator.setitem):
                return True
            if first is value and _aliases(user):
                stack.append(user)
    return False


def copy_mutated_inputs(module: fx.GraphModule) -> None:
    """A stage input that the stage changes in place, or through a view of it (an in-place ReLU right
    after a split point, ``h[:, 0] = 0``), is copied first: the runtime's inputs are autograd leaves, or
    values another stage still holds. ``clone`` passes gradients through unchanged, so results stay
    bitwise the same."""
    graph = module.graph
    changed = False
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        if not _written(node, module):
            continue
        users = list(node.users)
        with graph.inserting_after(node):
            copy = graph.call_function(torch.clone, (node,))
        for user in users:
            user.replace_input_with(node, copy)
        changed = True
    if changed:
        graph.lint()
        module.recompile()


def retarget_devices(module: fx.GraphModule, device: torch.device) -> int:
    """Replace the device torch.export traced on (``module.meta[TRACED_DEVICE]``), which it writes into
    calls such as ``aten.to.device`` and ``aten.arange(device=...)``, by ``device``; so too the meta device
    (a model built on it bakes it in wherever its code asks a parameter for its device). Returns how many
    arguments changed. Stages traced by torch.fx keep their devices (they come from the model's code)."""
    traced = module.meta.get(TRACED_DEVICE)
    if traced is None:
        return 0
    stale = {torch.device(traced).type, "meta"}
    count = 0

    def swap(value: object) -> object:
        nonlocal count
        if isinstance(value, torch.device) and value.type in stale and value != device:
            count += 1
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:  # HOP bodies too
        before = count
        for node in graph_module.graph.nodes:
            node.args = swap(node.args)
            node.kwargs = {key: swap(value) for key, value in node.kwargs.items()}
        if count > before:
            graph_module.recompile()
    module.meta[TRACED_DEVICE] = str(device)
    return count
