"""Directed acyclic graphs as plain lists: node ``v``'s predecessors ``preds[v]`` (node numbers
0..n-1). Topological orders, one cycle, longest head/tail paths, ancestry bitsets and the
max-weight closure; no other pipeloom module is imported, so the problem model and every solver can use it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

__all__ = [
    "ancestors",
    "find_cycle",
    "head_tail",
    "max_weight_closure",
    "members",
    "topological_order",
    "users_of",
]

Number = TypeVar("Number", int, float)
Order = Literal["passes", "breadth", "depth"]
Edges = Sequence[Sequence[tuple[int, Number]]]
"""Per node: ``(predecessor, edge length)`` pairs."""


def users_of(preds: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per node: its distinct successors, in increasing order."""
    users: list[list[int]] = [[] for _ in preds]
    for v, before in enumerate(preds):
        for u in sorted(set(before)):
            users[u].append(v)
    return users


def topological_order(preds: Sequence[Sequence[int]], *, order: Order = "passes") -> list[int]:
    """Every node after its predecessors (Kahn's algorithm, O(nodes + edges)); nodes on a cycle or
    after one are left out, so ``len(result) < len(preds)`` means the graph has a cycle.

    Ties (several nodes ready) go by ``order``:

    - ``passes``: passes over the nodes in increasing order, each placing every node whose
      predecessors are placed (those placed earlier in the same pass included): a node that becomes
      ready joins the pass when it is numbered above the node that freed it, else the next pass.
      Stable: a graph already in topological order comes back unchanged.
    - ``breadth``: first in, first out from the sources in increasing order (a breadth-first order).
    - ``depth``: last in, first out (a depth-first order, branches kept together).
    """
    users = users_of(preds)
    waiting = [len(set(before)) for before in preds]
    sources = [v for v, count in enumerate(waiting) if count == 0]
    placed: list[int] = []
    if order == "passes":
        current = sources
        while current:
            heapq.heapify(current)
            later: list[int] = []
            while current:
                v = heapq.heappop(current)
                placed.append(v)
                for user in users[v]:
                    waiting[user] -= 1
                    if waiting[user] == 0:
                        (heapq.heappush(current, user) if user > v else later.append(user))
            current = later
        return placed
    lifo = order == "depth"
    ready = deque(reversed(sources) if lifo else sources)
    while ready:
        v = ready.pop() if lifo else ready.popleft()
        placed.append(v)
        for user in users[v]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    return placed


def find_cycle(preds: Sequence[Sequence[int]], placed: Sequence[int], *,
               key: Callable[[int], SupportsRichComparison] | None = None) -> list[int]:
    """One cycle among the nodes a topological order left out (``placed`` is that order), in edge
    direction, starting and ending at its smallest node (by ``key``): the same cycle however found.

    Every node left out keeps a predecessor left out, so walking from the smallest one to its
    smallest such predecessor repeats a node; the walk from its first visit, reversed, is a cycle."""
    smallest = min if key is None else (lambda nodes: min(nodes, key=key))
    left = set(range(len(preds))) - set(placed)
    position: dict[int, int] = {}
    walk: list[int] = []
    v = smallest(left)
    while v not in position:
        position[v] = len(walk)
        walk.append(v)
        v = smallest([u for u in preds[v] if u in left])
    cycle = walk[position[v]:][::-1]
    first = cycle.index(smallest(cycle))
    cycle = cycle[first:] + cycle[:first]
    return [*cycle, cycle[0]]


def head_tail(order: Sequence[int], edges: Edges[Number], durations: Sequence[Number],
              zero: Number) -> tuple[list[Number], list[Number]]:
    """Per node v: the longest path from the sources to v's start (head: ``max over (u, l) in
    edges[v] of head_u + d_u + l``) and from v's end to the sinks (tail: ``max over users w of
    d_w + tail_w + l``), over a topological ``order``; ``zero`` (0 or 0.0) sets the number type."""
    head = [zero] * len(durations)
    for v in order:
        for u, length in edges[v]:
            head[v] = max(head[v], head[u] + durations[u] + length)
    tail = [zero] * len(durations)
    for v in reversed(order):
        for u, length in edges[v]:
            tail[u] = max(tail[u], durations[v] + tail[v] + length)
    return head, tail


def ancestors(preds: Sequence[Sequence[int]], order: Sequence[int]) -> list[int]:
    """Per node v: a bitset whose bit u is set when u reaches v (u runs before v in every order)."""
    bits = [0] * len(preds)
    for v in order:
        for u in preds[v]:
            bits[v] |= bits[u] | (1 << u)
    return bits


def members(bits: int) -> list[int]:
    """The nodes of an :func:`ancestors` bitset, in increasing order."""
    found = []
    while bits:
        low = bits & -bits
        found.append(low.bit_length() - 1)
        bits ^= low
    return found


def max_weight_closure(weights: Sequence[int], preds: Sequence[Sequence[int]]) -> list[int]:
    """A set D closed under preds (v in D implies preds[v] in D) of the greatest ``sum(weights[D])``
    (possibly empty), in increasing order, by a minimum cut on OR-Tools' ``SimpleMaxFlow``.

    Network: source -> v (capacity w_v > 0), v -> sink (capacity -w_v > 0), v -> u for u in
    preds[v] (a capacity no cut can pay); the source side of a minimum cut is a best closed set.
    Weights are integers (max flow's capacities are); scale real ones first."""
    import ortools  # noqa: F401 - import OR-Tools before anything that may load SciPy
    from ortools.graph.python import max_flow

    if not any(w > 0 for w in weights):
        return []
    source, sink = len(weights), len(weights) + 1
    never = sum(abs(w) for w in weights) + 1
    flow = max_flow.SimpleMaxFlow()
    flow.add_arc_with_capacity(source, sink, 0)  # both ends exist even when no arc reaches one
    for v, weight in enumerate(weights):
        if weight > 0:
            flow.add_arc_with_capacity(source, v, weight)
        elif weight < 0:
            flow.add_arc_with_capacity(v, sink, -weight)
        for u in preds[v]:
            flow.add_arc_with_capacity(v, u, never)
    status = flow.solve(source, sink)
    if status != flow.OPTIMAL:
        raise RuntimeError(f"max flow ended with status {status}")  # only on overflow or bad input
    return sorted(v for v in flow.get_source_side_min_cut() if v < len(weights))
