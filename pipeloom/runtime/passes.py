"""Rewrites of traced graphs before and after they are cut into stages: symbolic sizes measured again
in the stage that uses them, and stage inputs that the stage changes in place copied first."""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

__all__ = ["copy_mutated_inputs", "localize_sizes"]


def _size_source(node: fx.Node, user: fx.Node, stage_of: dict[fx.Node, int]) -> tuple[fx.Node, int] | None:
    """A tensor the stage of ``user`` has, and a dimension of it, whose size is ``node``'s value."""
    expr = node.meta["val"].node.expr
    stage = stage_of[user]
    candidates = [*user.all_input_nodes, *(n for n, s in stage_of.items() if s == stage)]
    for tensor in candidates:
        fake = tensor.meta.get("val")
        if isinstance(fake, torch.Tensor) and stage_of.get(tensor) is not None:
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    return tensor, dim
    return None


def localize_sizes(graph: fx.Graph, stage_of: dict[fx.Node, int]) -> None:
    """torch.export's symbolic sizes (``sym_size``) used in another stage are measured again there, on
    a tensor that stage has, so that only tensors cross stage boundaries."""
    for node in list(graph.nodes):
        if not isinstance(node.meta.get("val"), torch.SymInt) or node not in stage_of:
            continue
        for user in list(node.users):
            if stage_of.get(user, stage_of[node]) == stage_of[node]:
                continue
            found = _size_source(node, user, stage_of)
            if found is None:
                continue  # it crosses as an int and check_stage_value names it
            with graph.inserting_before(user):
                size = graph.call_function(torch.ops.aten.sym_size.int, found)
            size.meta["val"] = node.meta["val"]
            stage_of[size] = stage_of[user]
            user.replace_input_with(node, size)


_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow,
                       operator.iand, operator.ior, operator.ixor)


def _mutates_first_argument(node: fx.Node, module: nn.Module) -> bool:
    """Whether ``node`` writes into its first argument (``relu_``, ``x.add_``, ``inplace=True``...)."""
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.arguments:
            alias = schema.arguments[0].alias_info
            return bool(alias is not None and alias.is_write)
        return node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_module":
        return getattr(module.get_submodule(str(node.target)), "inplace", False) is True
    return False


def copy_mutated_inputs(module: fx.GraphModule) -> None:
    """A stage input that the stage changes in place (an in-place ReLU right after a split point) is
    copied first: the runtime's inputs are autograd leaves, or values another stage still holds.
    ``clone`` passes gradients through unchanged, so results stay bitwise the same."""
    graph = module.graph
    changed = False
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        users = list(node.users)
        if not any(user.args and user.args[0] is node and _mutates_first_argument(user, module) for user in users):
            continue
        with graph.inserting_after(node):
            copy = graph.call_function(torch.clone, (node,))
        for user in users:
            user.replace_input_with(node, copy)
        changed = True
    if changed:
        graph.lint()
        module.recompile()
