"""Partition a DAG of model pieces into pipeline stages: CP-SAT minimises the slowest stage, then the
bytes crossing stages, on a model shrunk by TePDist-style stage windows (see docs/partition.md).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from pipeloom.graph import topological_order
from pipeloom.plan.errors import PartitionError
from pipeloom.plan.partitioning.dag_graph import (
    DagGraph,
    DagPartition,
    analytic_bound,
    bytes_cut,
    dag_graph,
    dag_result,
    greedy_split,
    stage_loads,
    whole_number,
)
from pipeloom.plan.partitioning.dag_model import PhaseModel

__all__ = ["CLOSURE_NODES", "partition_dag"]

CLOSURE_NODES = 20_000
"""Up to this many nodes the stage windows use exact ancestor/descendant sums (bitsets, n²/8 bytes);
above, the heaviest path to or from a node (a weaker but still valid bound)."""

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- stage windows


def _reach_sums(g: DagGraph, weights: np.ndarray, *, up: bool) -> np.ndarray:
    """Per node and weight column, a lower bound on the total weight of its ancestors (``up``) or
    descendants, itself included: exact sums over bitset closures up to :data:`CLOSURE_NODES` nodes,
    else the heaviest path."""
    n = g.n
    order = g.order if up else g.order[::-1]
    nexts = g.preds if up else g.succs
    if n > CLOSURE_NODES:
        out = weights.copy()
        for v in order:
            if nexts[v]:
                out[v] += out[list(nexts[v])].max(axis=0)
        return out
    reach = [0] * n  # Python ints as bitsets: bit u set = u is reached
    for v in order:
        bits = 1 << v
        for u in nexts[v]:
            bits |= reach[u]
        reach[v] = bits
    width = (n + 7) // 8
    bitmap = np.frombuffer(b"".join(r.to_bytes(width, "little") for r in reach), dtype=np.uint8).reshape(n, width)
    # weighted popcount by byte: table[b, j] = weight of the nodes 8j..8j+7 whose bits are set in b
    padded = np.zeros((width * 8, weights.shape[1]), dtype=np.float64)  # float sums stay exact < 2**53
    padded[:n] = weights
    byte_bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    table = np.einsum("bi,jic->bjc", byte_bits.astype(np.float64), padded.reshape(width, 8, -1))
    out = np.zeros(weights.shape, dtype=np.float64)
    for j in range(width):
        out += table[bitmap[:, j], j]
    return np.rint(out).astype(np.int64)


_Reach = tuple[np.ndarray, np.ndarray]
"""Per node and weight column: the ancestors' and the descendants' weight sums (:func:`_reach_sums`)."""


def _windows(g: DagGraph, ancestors: np.ndarray, descendants: np.ndarray,
             caps: Sequence[int | None]) -> tuple[list[int], list[int]] | None:
    """Per node, the stages [lo, hi] it can take in any partition whose stages stay within ``caps``
    (one per weight column, None = no cap); None when some node has none.

    Stages 0..s hold node i and all its ancestors, stages s..S-1 i and its descendants, so with
    A_i, D_i their weights and cap C: A_i <= (s+1)·C and D_i <= (S-s)·C, i.e.
    ceil(A_i/C) - 1 <= s <= S - ceil(D_i/C); then lo grows along edges and hi shrinks against them.
    """
    S = g.num_stages
    lo, hi = np.zeros(g.n, dtype=np.int64), np.full(g.n, S - 1, dtype=np.int64)
    for c, cap in enumerate(caps):
        if cap is None:
            continue
        a, d = ancestors[:, c], descendants[:, c]
        if cap > 0:
            lo = np.maximum(lo, -(-a // cap) - 1)
            hi = np.minimum(hi, S - -(-d // cap))
        else:
            lo, hi = np.where(a > 0, S, lo), np.where(d > 0, -1, hi)
    lo_l, hi_l = lo.tolist(), hi.tolist()
    for v in g.order:
        for u in g.preds[v]:
            lo_l[v] = max(lo_l[v], lo_l[u])
    for u in reversed(g.order):
        for v in g.succs[u]:
            hi_l[u] = min(hi_l[u], hi_l[v])
    if any(a > b for a, b in zip(lo_l, hi_l)):
        return None
    return lo_l, hi_l


# ---------------------------------------------------------------- the partitioner


def partition_dag(times: Sequence[float], edges: Sequence[tuple[int, int]], *, num_stages: int,
                  out_bytes: Sequence[float] | None = None, memory: Sequence[float] | None = None,
                  memory_limit: float | None = None, balance: float | None = None, time_limit: float = 10.0,
                  workers: int = 2) -> DagPartition:
    """Assign nodes 0..n-1 to ``num_stages`` non-empty pipeline stages, every edge (u, v) (v consumes
    u's output) going from a stage to the same or a later one.

    Primary objective: the slowest stage's time Σ times. Secondary: the cut bytes (``out_bytes[u]``
    once per other stage consuming u's output), among partitions whose slowest stage is within
    ``(1 + balance)`` of the best found (``balance`` None = 0: ties only). ``memory`` sums per stage
    must stay <= ``memory_limit``. Greedy topological splits seed CP-SAT; stage windows fix the nodes
    far from stage boundaries; both phases share ``time_limit`` seconds on ``workers`` threads and the
    result carries a proven bound. Raises PartitionError for a cycle (named), more stages than nodes,
    negative values, or a memory limit no partition meets (the message says which limit or how many
    stages would fit).
    """
    start = time.perf_counter()
    balance = 0.0 if balance is None else float(balance)
    if not math.isfinite(balance) or balance < 0:
        raise PartitionError(f"balance={balance!r}; give a slack >= 0 (0.05 = stages up to 5% slower)")
    if not time_limit > 0:
        raise PartitionError(f"time_limit={time_limit!r}; give a number of seconds > 0")
    if whole_number(workers) is None or workers < 1:
        raise PartitionError(f"workers={workers!r}; give a whole number >= 1")
    g = dag_graph(times, edges, num_stages, out_bytes, memory, memory_limit)
    deadline = start + time_limit
    hint = greedy_split(g)
    if hint is None:  # only a memory limit stops every topological split
        hint = _memory_fit(g, deadline, workers)
    columns = [g.t] + ([g.m] if g.limit is not None else [])
    weights = np.array(columns, dtype=np.int64).T
    sums = (_reach_sums(g, weights, up=True), _reach_sums(g, weights, up=False))
    secondary = any(g.b) and any(g.succs)
    stage_of, proven = _minimise_time(g, sums, hint, deadline, workers, secondary=secondary)
    bound = max(proven / g.time_scale, analytic_bound(g))
    slowest = max(stage_loads(g.times, stage_of, g.num_stages))
    optimal = slowest <= bound * (1 + (1e-12 if g.exact else 1e-6))  # rounding noise is far below 1e-6
    if secondary:
        stage_of, proven_cut = _minimise_cut(g, sums, stage_of, hint, balance, deadline, workers)
        optimal = optimal and proven_cut
    found = dag_result(g, stage_of, bound=bound, optimal=optimal, start=start)
    logger.debug("%d nodes into %d stages: slowest %g (bound %g, %s), %g bytes cut, in %.2f s", g.n, g.num_stages,
                 found.max_stage_time, found.bound, found.status, found.cut_bytes, found.seconds)
    return found


def _minimise_time(g: DagGraph, sums: _Reach, hint: list[int] | None, deadline: float, workers: int, *,
                   secondary: bool) -> tuple[list[int], int]:
    """Phase 1: minimise the slowest stage inside the windows of the hint's slowest stage (every
    better partition lies in them). Returns (stage_of, proven integer bound)."""
    lb = g.lower_bound()
    cap = sum(g.t) if hint is None else max(stage_loads(g.t, hint, g.num_stages))
    if hint is not None and cap <= lb:
        return hint, lb
    windows = _windows(g, *sums, [cap, g.limit])
    if windows is None:
        raise _memory_error(g, None)
    model = PhaseModel(g, *windows, cap=cap, minimise="time", hint=hint)
    share = 0.5 if secondary else 1.0
    found, proven, bound = model.solve((deadline - time.perf_counter()) * share, workers)
    if found is None:
        if hint is not None:
            return hint, lb
        if proven:
            raise _memory_error(g, None)
        raise PartitionError(f"no partition under memory_limit={g.memory_limit:g} found within the time "
                             "limit; raise time_limit (or memory_limit)")
    return found, max(lb, math.ceil(bound - 1e-6))


def _minimise_cut(g: DagGraph, sums: _Reach, stage_of: list[int], greedy: list[int] | None, balance: float,
                  deadline: float, workers: int) -> tuple[list[int], bool]:
    """Phase 2: minimise the cut bytes with every stage within (1 + balance) of phase 1's slowest,
    starting from the fewer-bytes one of phase 1's partition and the greedy one when it fits."""
    cap = math.floor((1 + balance) * max(stage_loads(g.t, stage_of, g.num_stages)) + 1e-9)
    if greedy is not None and max(stage_loads(g.t, greedy, g.num_stages)) <= cap:
        stage_of = min(stage_of, greedy, key=lambda s: bytes_cut(g.b, g.succs, s))
    if bytes_cut(g.b, g.succs, stage_of) == 0:
        return stage_of, True
    windows = _windows(g, *sums, [cap, g.limit])
    assert windows is not None, "the hint lies in the phase 2 windows"
    model = PhaseModel(g, *windows, cap=cap, minimise="cut", hint=stage_of)
    found, proven, _ = model.solve(deadline - time.perf_counter(), workers)
    if found is None or bytes_cut(g.b, g.succs, found) > bytes_cut(g.b, g.succs, stage_of):
        return stage_of, False
    return found, proven


# ---------------------------------------------------------------- memory that does not fit


def _edges(g: DagGraph) -> list[tuple[int, int]]:
    return [(u, v) for v in range(g.n) for u in g.preds[v]]


def _limited(g: DagGraph) -> tuple[tuple[float, ...], float, tuple[int, ...], int]:
    """``(memory, memory_limit, m, limit)`` of a graph with a memory limit, where the memory errors start."""
    assert g.memory is not None and g.memory_limit is not None and g.m is not None and g.limit is not None, \
        "only a memory limit makes a partition not fit"
    return g.memory, g.memory_limit, g.m, g.limit


def _memory_fit(g: DagGraph, deadline: float, workers: int) -> list[int] | None:
    """A partition within the memory limit from minimising the largest stage memory (a third of the
    time left); raises when that proves none exists; None when undecided."""
    memory, memory_limit, m, limit = _limited(g)
    seconds = max(0.1, (deadline - time.perf_counter()) / 3)
    fit = partition_dag(memory, _edges(g), num_stages=g.num_stages, time_limit=seconds, workers=workers)
    if max(stage_loads(m, fit.stage_of, g.num_stages)) <= limit:
        return list(fit.stage_of)
    if fit.bound > memory_limit:
        raise _memory_error(g, fit)
    return None


def _fewest_stages(g: DagGraph) -> int | None:
    """Fewest stages a greedy memory-only fill of a topological order needs (None: a node alone is
    over the limit)."""
    _, _, m, limit = _limited(g)
    if max(m) > limit:
        return None
    best = g.n
    for order in (g.order, topological_order(g.preds, order="depth")):
        count, used = 1, 0
        for v in order:
            if used + m[v] > limit:
                count, used = count + 1, 0
            used += m[v]
        best = min(best, count)
    return best


def _memory_error(g: DagGraph, fit: DagPartition | None) -> PartitionError:
    """What would fit: the smallest limit for these stages (proven, or the best found) and how many
    stages this limit needs."""
    memory, limit, _, _ = _limited(g)
    if fit is None:
        fit = partition_dag(memory, _edges(g), num_stages=g.num_stages, time_limit=2.0)
    S = g.num_stages
    text = f"memory_limit={limit:g} admits no partition into {S} stages"
    heaviest = max(range(g.n), key=lambda v: memory[v])
    if memory[heaviest] > limit:
        text += f" (node {heaviest} alone needs {memory[heaviest]:g})"
    if fit.status == "optimal":
        text += f"; the smallest limit that fits {S} stages is {fit.max_stage_time:g}"
    else:
        text += f"; a limit of {fit.max_stage_time:g} fits {S} stages (none below {fit.bound:g} does)"
    fewest = _fewest_stages(g)
    if fewest is not None and fewest <= g.n:
        text += f", or keep this limit with {fewest} stages"
    return PartitionError(text)
