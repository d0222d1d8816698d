"""The DAG partitioner's input and answer: the validated graph with its integer copies, the
:class:`DagPartition` result, stage loads and cut bytes, and the greedy topological split (the
baseline, and the solver's first hint)."""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from pipeloom.graph import find_cycle, topological_order
from pipeloom.plan.errors import PartitionError
from pipeloom.search.cpsat import Status, integer_scale, status_word, to_units

__all__ = ["DagGraph", "DagPartition", "analytic_bound", "bytes_cut", "dag_graph", "dag_result", "greedy_partition_dag",
           "greedy_split", "stage_loads", "whole_number"]

_RESOLUTION = 10**12
"""Fitted scales map the total (time, memory or bytes) to about this many integer units."""
_Num = TypeVar("_Num", int, float)


@dataclass(frozen=True, kw_only=True, slots=True)
class DagPartition:
    """Nodes assigned to pipeline stages; every edge goes from a stage to the same or a later one."""

    stage_of: tuple[int, ...]
    """Per node: its stage, 0..S-1 (each stage holds at least one node)."""
    stage_times: tuple[float, ...]
    """Per stage: the sum of its nodes' times."""
    max_stage_time: float
    """The slowest stage's time (the pipeline's bottleneck; primary objective)."""
    cut_bytes: float
    """Bytes crossing stages: each node's output counts once per other stage that consumes it."""
    bound: float
    """No valid partition has a slowest stage faster than this (proven)."""
    status: Status
    """``optimal``: no partition has a faster slowest stage (up to a relative 1e-6 when times were
    rounded to integers) and none within the balance slack cuts fewer bytes; else ``feasible``."""
    seconds: float
    """Wall time the partitioner took."""
    stage_memory: tuple[float, ...] | None = None
    """Per stage: the sum of its nodes' memory (None when no memory was given)."""

    @property
    def gap(self) -> float:
        """``(max_stage_time - bound) / bound`` (0 when the bound is 0)."""
        return 0.0 if self.bound <= 0 else max(0.0, (self.max_stage_time - self.bound) / self.bound)

    @property
    def stages(self) -> tuple[tuple[int, ...], ...]:
        """Per stage: its nodes in increasing order."""
        members: list[list[int]] = [[] for _ in self.stage_times]
        for node, stage in enumerate(self.stage_of):
            members[stage].append(node)
        return tuple(tuple(m) for m in members)


@dataclass(frozen=True, slots=True)
class DagGraph:
    """Validated input with integer copies for CP-SAT: time t = floor(time * scale) (so integer
    bounds stay valid for the real times), memory m = ceil(memory * scale) and the limit floored (so
    integer feasibility implies real feasibility), bytes rounded (only compared)."""

    times: tuple[float, ...]
    out_bytes: tuple[float, ...]
    memory: tuple[float, ...] | None
    memory_limit: float | None
    num_stages: int
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    t: tuple[int, ...]
    exact: bool
    time_scale: float
    b: tuple[int, ...]
    m: tuple[int, ...] | None
    limit: int | None

    @property
    def n(self) -> int:
        return len(self.times)

    def lower_bound(self) -> int:
        """Integer floor on the slowest stage: max(ceil(total / S), largest node)."""
        return max(-(-sum(self.t) // self.num_stages), max(self.t))


# ---------------------------------------------------------------- input checks and scaling


def _numbers(name: str, values: Sequence[float], n: int) -> tuple[float, ...]:
    """``values`` as floats, one per node, each finite and >= 0."""
    if len(values) != n:
        raise PartitionError(f"{name} has {len(values)} values for {n} nodes; give one per node")
    out = tuple(float(v) for v in values)
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise PartitionError(f"{name}[{i}] = {v!r}; every value must be a finite number >= 0")
    return out


def whole_number(value) -> int | None:
    """``value`` as an int when it is one (Python or NumPy integer), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


def _scale(values: Sequence[float], top: float) -> tuple[float, bool]:
    """Smallest power of ten up to 10**6 making every value whole with ``top`` scaled to at most
    2**40 (exact), else ``_RESOLUTION / top``."""
    return integer_scale(values, top=top, fitted=_RESOLUTION, room=2**40)


def _cycle_error(preds, placed: list[int]) -> PartitionError:
    """Name one cycle among the nodes a topological sort could not place."""
    cycle = find_cycle(preds, placed)
    return PartitionError(f"the graph has a cycle: {' -> '.join(map(str, cycle))}; "
                          "edges (u, v) must form a DAG (v consumes u's output)")


def dag_graph(times, edges, num_stages, out_bytes, memory, memory_limit) -> DagGraph:
    """Validate the request and build the integer graph (raises PartitionError)."""
    n = len(times)
    times = _numbers("times", times, n)
    if whole_number(num_stages) is None or num_stages < 1:
        raise PartitionError(f"num_stages={num_stages!r}; give a whole number >= 1")
    if num_stages > n:
        raise PartitionError(f"num_stages={num_stages} is more stages than nodes ({n}); every stage needs "
                             f"a node, so use at most {n} stages")
    out_bytes = (0.0,) * n if out_bytes is None else _numbers("out_bytes", out_bytes, n)
    if memory_limit is not None and memory is None:
        raise PartitionError("memory_limit needs memory (one value per node)")
    memory = None if memory is None else _numbers("memory", memory, n)
    if memory_limit is not None and (not math.isfinite(memory_limit) or memory_limit < 0):
        raise PartitionError(f"memory_limit={memory_limit!r}; give a finite number >= 0")
    preds: list[set[int]] = [set() for _ in range(n)]
    for edge in edges:
        u, v = (whole_number(x) for x in edge) if len(edge) == 2 else (None, None)
        if u is None or v is None or not (0 <= u < n and 0 <= v < n):
            raise PartitionError(f"edge {tuple(edge)} is not a pair of node numbers in 0..{n - 1}")
        preds[v].add(u)
    preds_t = tuple(tuple(sorted(p)) for p in preds)
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        for u in preds_t[v]:
            succs[u].append(v)
    succs_t = tuple(tuple(s) for s in succs)
    order = topological_order(preds_t, order="breadth")
    if len(order) < n:
        raise _cycle_error(preds_t, order)
    time_scale, time_exact = _scale(times, sum(times))
    byte_scale, byte_exact = _scale(out_bytes, sum(out_bytes))
    m = limit = None
    if memory is not None:
        scale, exact = _scale(memory + ((memory_limit,) if memory_limit is not None else ()),
                              max(sum(memory), memory_limit or 0.0))
        m = to_units(memory, scale, exact=exact, rounding=math.ceil)
        limit = None if memory_limit is None else to_units((memory_limit,), scale, exact=exact,
                                                           rounding=math.floor)[0]
    return DagGraph(times, out_bytes, memory, memory_limit, num_stages, preds_t, succs_t, tuple(order),
                  to_units(times, time_scale, exact=time_exact, rounding=math.floor), time_exact, time_scale,
                  to_units(out_bytes, byte_scale, exact=byte_exact), m, limit)


# ---------------------------------------------------------------- evaluation and greedy split


def dag_result(g: DagGraph, stage_of: Sequence[int], *, bound: float, optimal: bool, start: float) -> DagPartition:
    """Measure ``stage_of`` in real units (``bound``: a proven floor, raised to the analytic one)."""
    stage_times = tuple(float(t) for t in stage_loads(g.times, stage_of, g.num_stages))
    memory = None if g.memory is None else tuple(float(m) for m in stage_loads(g.memory, stage_of, g.num_stages))
    slowest = max(stage_times)
    bound = min(max(bound, analytic_bound(g)), slowest)  # min: float noise only
    return DagPartition(stage_of=tuple(stage_of), stage_times=stage_times, max_stage_time=slowest,
                        cut_bytes=bytes_cut(g.out_bytes, g.succs, stage_of), bound=bound,
                        status=status_word(optimal), seconds=time.perf_counter() - start,
                        stage_memory=memory)


def bytes_cut(out_bytes: Sequence[float], succs, stage_of: Sequence[int]) -> float:
    """Σ_u bytes_u · |{stage of a consumer of u} \\ {stage of u}|."""
    total = 0.0
    for u, consumers in enumerate(succs):
        if out_bytes[u] and consumers:
            total += out_bytes[u] * len({stage_of[v] for v in consumers} - {stage_of[u]})
    return total


def _split(order: Sequence[int], g: DagGraph) -> list[int] | None:
    """Split ``order`` into S non-empty contiguous pieces minimising the slowest (integer times) under
    the memory limit: binary search on the cap, greedy fill per cap; None when memory admits none."""
    S, n = g.num_stages, g.n
    zero = np.zeros(1, dtype=np.int64)
    pt = np.concatenate((zero, np.cumsum([g.t[v] for v in order], dtype=np.int64)))
    memory = None
    if g.limit is not None and g.m is not None:
        memory = np.concatenate((zero, np.cumsum([g.m[v] for v in order], dtype=np.int64))), g.limit

    def starts_for(cap: int) -> list[int] | None:
        starts: list[int] = []
        i = 0
        while i < n:
            if len(starts) == S:
                return None
            starts.append(i)
            j = int(np.searchsorted(pt, pt[i] + cap, side="right")) - 1
            if memory is not None:
                pm, limit = memory
                j = min(j, int(np.searchsorted(pm, pm[i] + limit, side="right")) - 1)
            if j <= i:
                return None
            i = j
        return starts

    low, high = g.lower_bound(), int(pt[-1])
    best = starts_for(high)
    if best is None:
        return None
    while low < high:
        mid = (low + high) // 2
        found = starts_for(mid)
        if found is None:
            low = mid + 1
        else:
            best, high = found, mid
    while len(best) < S:  # split the piece with the most nodes: no piece gets slower or heavier
        ends = best[1:] + [n]
        k = max(range(len(best)), key=lambda k: ends[k] - best[k])
        best.insert(k + 1, (best[k] + ends[k]) // 2)
    stage_of = [0] * n
    for k, (a, b) in enumerate(zip(best, best[1:] + [n])):
        for v in order[a:b]:
            stage_of[v] = k
    return stage_of


def greedy_split(g: DagGraph) -> list[int] | None:
    """Best split (slowest stage, then cut bytes) of three topological orders: breadth-first,
    depth-first and the node numbering when it is one."""
    orders = [list(g.order), topological_order(g.preds, order="depth")]
    if all(u < v for v in range(g.n) for u in g.preds[v]):
        orders.append(list(range(g.n)))
    best, best_key = None, None
    for order in orders:
        stage_of = _split(order, g)
        if stage_of is not None:
            key = (max(stage_loads(g.t, stage_of, g.num_stages)), bytes_cut(g.b, g.succs, stage_of))
            if best_key is None or key < best_key:
                best, best_key = stage_of, key
    return best


def greedy_partition_dag(times: Sequence[float], edges: Sequence[tuple[int, int]], *, num_stages: int,
                         out_bytes: Sequence[float] | None = None, memory: Sequence[float] | None = None,
                         memory_limit: float | None = None) -> DagPartition:
    """The baseline: the best contiguous split of a few topological orders (no solver).

    Raises PartitionError as :func:`partition_dag` does; also when memory admits no such split.
    """
    start = time.perf_counter()
    g = dag_graph(times, edges, num_stages, out_bytes, memory, memory_limit)
    stage_of = greedy_split(g)
    if stage_of is None:
        raise PartitionError(f"no topological split into {num_stages} stages fits memory_limit="
                             f"{memory_limit:g}; partition_dag searches further and says what fits")
    return dag_result(g, stage_of, bound=0.0, optimal=False, start=start)


def analytic_bound(g: DagGraph) -> float:
    """max(total / S, largest node): no partition's slowest stage is faster."""
    return max(sum(g.times) / g.num_stages, max(g.times))


def stage_loads(weights: Sequence[_Num], stage_of: Sequence[int], num_stages: int) -> list[_Num]:
    """Per stage: the sum of its nodes' weights (integers stay integers)."""
    loads: list[_Num] = [0] * num_stages
    for v, s in enumerate(stage_of):
        loads[s] += weights[v]
    return loads
