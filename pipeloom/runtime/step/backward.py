"""Backward passes of one stage: full (B), or split into input gradients (I) and weight gradients (W).

The split walks the autograd graph once per I: the nodes from which a stage input can be reached
(the *input path*) run in I; at every input-path node that also feeds a parameter, a pre-hook keeps
the gradient arriving at that node, and W later runs only the parameter side of those nodes from the
kept gradients (``torch.autograd.grad`` on gradient edges). Each node computes the same values with
the same kernels as in a full backward, so I+W gives bitwise the gradients of B.

Weight gradients are accumulated into ``.grad`` exactly as autograd's own accumulation does: the
first one is stored, later ones are added in place, so a stage's W (or B) actions in micro-batch
order give the same bits as the single-device reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

_engine_run_backward: Callable[..., tuple[torch.Tensor, ...]] | None
try:  # torch's own entry into the C++ engine, under torch.autograd.grad/backward (torch >= 2.3)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - older torch: the public functions do the same
    _engine_run_backward = None

__all__ = ["PendingWeights", "accumulate_grad", "add_in_order", "backward_full", "backward_input", "grad_node"]


def grad_node(tensor: torch.Tensor) -> Node | None:
    """The autograd node that receives ``tensor``'s gradient (its grad_fn, or a leaf's accumulator)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if tensor.requires_grad:
        view = tensor.view_as(tensor).grad_fn
        assert view is not None  # autograd records the view (backward runs with grad mode on)
        return view.next_functions[0][0]
    return None


def _output_node(output: torch.Tensor) -> Node:
    """The node receiving the gradient of an output that requires grad (as ``_differentiable`` keeps)."""
    node = grad_node(output)
    assert node is not None
    return node


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` the way autograd's AccumulateGrad does (store, then add in place)."""
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad.add_(grad)  # .grad never requires grad: no autograd recording


def add_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((p0 + p1) + p2) + ...``: the left-to-right sum autograd and the reference loop compute."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _run_engine(roots: Sequence, grads: Sequence[torch.Tensor], inputs: Sequence = (), *,
                retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """Run autograd from ``roots`` (tensors or gradient edges) with ``grads``.

    With ``inputs``: their gradients are returned (``None`` where unreachable), nothing is
    accumulated, like ``torch.autograd.grad(..., allow_unused=True)``. Without: every leaf's
    gradient is accumulated into ``.grad``, like ``torch.autograd.backward``. It calls the engine
    the way those functions do, without their Python-side checks of the gradients' shapes (about
    50 us a call, several calls per I and W): the C++ engine checks every root's gradient itself.
    """
    if _engine_run_backward is None:  # pragma: no cover
        if inputs:
            return torch.autograd.grad(roots, inputs, grads, retain_graph=retain_graph, allow_unused=True)
        torch.autograd.backward(roots, grads, retain_graph=retain_graph)
        return ()
    return _engine_run_backward(tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), True,
                                accumulate_grad=not inputs)


def _differentiable(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]):
    """The (output, grad) pairs that carry a gradient: outputs that require grad and got one."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def backward_full(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                  inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """B: gradients of ``inputs`` (returned), weight gradients accumulated into the parameters' ``.grad``.

    ``inputs`` are the stage's detached input leaves; those that do not require grad get ``None``. Each
    input's gradient is taken as it arrives (a hook), before ``.grad`` would copy it into the leaf's strides:
    the earlier stage's backward gets it in the layout one device would hand it.
    """
    outs, gs = _differentiable(outputs, grads)
    arrived: dict[int, torch.Tensor] = {}
    handles = [leaf.register_hook(_arrival(arrived, k)) for k, leaf in enumerate(inputs) if leaf.requires_grad]
    try:
        if outs:
            _run_engine(outs, gs)
    finally:
        for handle in handles:
            handle.remove()
    result = []
    for k, leaf in enumerate(inputs):
        result.append(arrived.get(k, leaf.grad) if leaf.requires_grad else None)
        leaf.grad = None
    return result


def _arrival(arrived: dict[int, torch.Tensor], k: int):
    """A leaf's hook recording the gradient that reaches it, unchanged."""

    def record(grad: torch.Tensor) -> None:
        arrived[k] = grad

    return record


@dataclass(slots=True)
class _WeightGroup:
    """One ``torch.autograd.grad`` call of W: gradient roots and the parameters reached only from them."""

    roots: list  # GradientEdge into an input-path node, or an output tensor off the input path
    grads: list[torch.Tensor]  # the gradient arriving at each root
    params: list[torch.Tensor]
    edges: list[GradientEdge]  # the parameters' accumulator nodes


@dataclass(slots=True)
class PendingWeights:
    """What W needs after I: kept gradients per group, and the gradients I already computed."""

    groups: list[_WeightGroup] = field(default_factory=list)
    ready: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (param, grad) from I

    def weight(self) -> None:
        """W: compute the parameters' gradients and accumulate them into ``.grad``; frees the graph.

        Groups run in reverse discovery order (the nodes I reached last first, whose kept gradients
        and saved inputs are the most recently touched), each accumulated at once while its result
        is still in cache. Every parameter belongs to one group, so the order across groups does
        not change any ``.grad``.
        """
        for param, grad in self.ready:
            accumulate_grad(param, grad)
        for group in reversed(self.groups):
            if not group.grads:  # the node never ran in I (no gradient reached it)
                continue
            found = _run_engine(group.roots, group.grads, group.edges)
            for param, result in zip(group.params, found):
                if result is not None:
                    accumulate_grad(param, result)
        self.groups.clear()
        self.ready.clear()


def _graph(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``roots`` (in discovery order) and each node's children."""
    seen: set[Node] = set(roots)
    order = list(roots)
    children: dict[Node, list[Node]] = {}
    for node in order:  # grows while walking
        kids = [child for child, _ in node.next_functions if child is not None]
        children[node] = kids
        for child in kids:
            if child not in seen:
                seen.add(child)
                order.append(child)
    return order, children


def _reaching(order: list[Node], children: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """Nodes from which some node of ``targets`` can be reached (targets included)."""
    parents: dict[Node, list[Node]] = {}
    for node in order:
        for child in children[node]:
            parents.setdefault(child, []).append(node)
    reach = set(targets)
    stack = list(targets)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in reach:
                reach.add(parent)
                stack.append(parent)
    return reach


def _params_below(starts: Sequence[Node], children: dict[Node, list[Node]], input_path: set[Node],
                  param_of: dict[Node, torch.Tensor]) -> list[Node]:
    """Parameter nodes reachable from ``starts`` through nodes off the input path."""
    seen: set[Node] = set()
    stack = [n for n in starts if n not in input_path]
    found: list[Node] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in param_of:
            found.append(node)
        stack.extend(c for c in children[node] if c not in input_path and c not in seen)
    return found


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                   ) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """I: gradients of ``inputs`` now; the returned :class:`PendingWeights` computes ``params``' later.

    ``inputs`` are the stage's detached input leaves, ``params`` its parameters. Every input-path
    node that feeds parameters off the input path keeps the gradient arriving at it (a pre-hook);
    W restarts there, one ``autograd.grad`` per such node, so it recomputes nothing of I. A
    parameter reached from two such places (a weight used twice) gets its gradient in I already,
    summed by autograd as in a full backward, and is accumulated at W.
    """
    outs, gs = _differentiable(outputs, grads)
    pending = PendingWeights()
    wanted = [leaf for leaf in inputs if leaf.requires_grad]
    if not outs:
        return [None] * len(inputs), pending
    roots = [_output_node(o) for o in outs]
    order, children = _graph(roots)
    # leaves' accumulators sit in the graph with their tensor as .variable: no lookups needed
    trainable = {id(p) for p in params if p.requires_grad}
    wanted_ids = {id(leaf) for leaf in wanted}
    param_of: dict[Node, torch.Tensor] = {}
    input_nodes: set[Node] = set()
    for node in order:
        if not children[node] and hasattr(node, "variable"):
            variable = node.variable
            if id(variable) in trainable:
                param_of[node] = variable
            elif id(variable) in wanted_ids:
                input_nodes.add(node)
    input_path = _reaching(order, children, input_nodes)
    # groups: each hooked input-path node, plus one for the outputs off the input path
    hooked: list[tuple[Node, list[Node]]] = []
    for node in order:
        if node in input_path and node not in input_nodes:
            below = _params_below(children[node], children, input_path, param_of)
            if below:
                hooked.append((node, below))
    free_roots = [(o, g) for o, g, n in zip(outs, gs, roots) if n not in input_path]
    free_params = _params_below([_output_node(o) for o, _ in free_roots], children, input_path, param_of)
    uses: dict[Node, int] = {}
    for _, below in [*hooked, (None, free_params)]:
        for node in below:
            uses[node] = uses.get(node, 0) + 1
    shared = [node for node, count in uses.items() if count > 1]
    kept: dict[Node, _WeightGroup] = {}
    handles = []
    for node, below in hooked:
        mine = [n for n in below if uses[n] == 1]
        if mine:
            group = _WeightGroup(roots=[], grads=[], params=[param_of[n] for n in mine],
                                 edges=[GradientEdge(n, 0) for n in mine])
            kept[node] = group
            pending.groups.append(group)
            handles.append(node.register_prehook(_keeper(node, group)))
    mine = [n for n in free_params if uses[n] == 1]
    if mine:
        pending.groups.append(_WeightGroup(roots=[o for o, _ in free_roots], grads=[g for _, g in free_roots],
                                           params=[param_of[n] for n in mine],
                                           edges=[GradientEdge(n, 0) for n in mine]))
    shared_params = [param_of[n] for n in shared]
    found: Sequence[torch.Tensor | None]
    try:
        if wanted and input_nodes or shared_params:
            found = _run_engine(outs, gs, wanted + shared_params, retain_graph=True)
        else:
            found = [None] * len(wanted)
    finally:
        for handle in handles:
            handle.remove()
    pending.ready.extend((p, g) for p, g in zip(shared_params, found[len(wanted):]) if g is not None)
    by_leaf = dict(zip(map(id, wanted), found[:len(wanted)]))
    return [by_leaf.get(id(leaf)) for leaf in inputs], pending


def _keeper(node: Node, group: _WeightGroup):
    """A pre-hook storing the gradients arriving at ``node`` as the roots of ``group``."""

    def keep(grad_outputs: tuple) -> None:
        for index, grad in enumerate(grad_outputs):
            if grad is not None:
                group.roots.append(GradientEdge(node, index))
                group.grads.append(grad)

    return keep
