"""Partition a DAG of model pieces into pipeline stages: CP-SAT minimises the slowest stage, then the
bytes crossing stages, on a model shrunk by TePDist-style stage windows (see docs/partition.md).
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import ortools  # noqa: F401 - import OR-Tools before anything that may load SciPy
from ortools.sat.python import cp_model

from pipeloom.graph import find_cycle, topological_order
from pipeloom.plan.plan import PartitionError
from pipeloom.search.cpsat import Status, found_solution, integer_scale, status_word, to_units

__all__ = ["CLOSURE_NODES", "DagPartition", "PartitionError", "greedy_partition_dag", "partition_dag"]

CLOSURE_NODES = 20_000
"""Up to this many nodes the stage windows use exact ancestor/descendant sums (bitsets, n²/8 bytes);
above, the heaviest path to or from a node (a weaker but still valid bound)."""

_RESOLUTION = 10**12
"""Fitted scales map the total (time, memory or bytes) to about this many integer units."""
_GAP_LIMIT = 1e-7
"""CP-SAT stops when the relative gap of a phase falls below this (rounding noise is larger)."""


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
class _Graph:
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


def _whole(value) -> int | None:
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


def _graph(times, edges, num_stages, out_bytes, memory, memory_limit) -> _Graph:
    """Validate the request and build the integer graph (raises PartitionError)."""
    n = len(times)
    times = _numbers("times", times, n)
    if _whole(num_stages) is None or num_stages < 1:
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
        u, v = (_whole(x) for x in edge) if len(edge) == 2 else (None, None)
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
    return _Graph(times, out_bytes, memory, memory_limit, num_stages, preds_t, succs_t, tuple(order),
                  to_units(times, time_scale, exact=time_exact, rounding=math.floor), time_exact, time_scale,
                  to_units(out_bytes, byte_scale, exact=byte_exact), m, limit)


# ---------------------------------------------------------------- evaluation and greedy split


def _result(g: _Graph, stage_of: Sequence[int], *, bound: float, optimal: bool, start: float) -> DagPartition:
    """Measure ``stage_of`` in real units (``bound``: a proven floor, raised to the analytic one)."""
    stage_times = tuple(float(t) for t in _loads(g.times, stage_of, g.num_stages))
    memory = None if g.memory is None else tuple(float(m) for m in _loads(g.memory, stage_of, g.num_stages))
    slowest = max(stage_times)
    bound = min(max(bound, _analytic_bound(g)), slowest)  # min: float noise only
    return DagPartition(stage_of=tuple(stage_of), stage_times=stage_times, max_stage_time=slowest,
                        cut_bytes=_cut(g.out_bytes, g.succs, stage_of), bound=bound,
                        status=status_word(optimal), seconds=time.perf_counter() - start,
                        stage_memory=memory)


def _cut(out_bytes: Sequence[float], succs, stage_of: Sequence[int]) -> float:
    """Σ_u bytes_u · |{stage of a consumer of u} \\ {stage of u}|."""
    total = 0.0
    for u, consumers in enumerate(succs):
        if out_bytes[u] and consumers:
            total += out_bytes[u] * len({stage_of[v] for v in consumers} - {stage_of[u]})
    return total


def _split(order: Sequence[int], g: _Graph) -> list[int] | None:
    """Split ``order`` into S non-empty contiguous pieces minimising the slowest (integer times) under
    the memory limit: binary search on the cap, greedy fill per cap; None when memory admits none."""
    S, n = g.num_stages, g.n
    pt = np.concatenate(([0], np.cumsum([g.t[v] for v in order], dtype=np.int64)))
    pm = None if g.limit is None else np.concatenate(([0], np.cumsum([g.m[v] for v in order], dtype=np.int64)))

    def starts_for(cap: int) -> list[int] | None:
        starts, i = [], 0
        while i < n:
            if len(starts) == S:
                return None
            starts.append(i)
            j = int(np.searchsorted(pt, pt[i] + cap, side="right")) - 1
            if pm is not None:
                j = min(j, int(np.searchsorted(pm, pm[i] + g.limit, side="right")) - 1)
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


def _greedy(g: _Graph) -> list[int] | None:
    """Best split (slowest stage, then cut bytes) of three topological orders: breadth-first,
    depth-first and the node numbering when it is one."""
    orders = [list(g.order), topological_order(g.preds, order="depth")]
    if all(u < v for v in range(g.n) for u in g.preds[v]):
        orders.append(list(range(g.n)))
    best, best_key = None, None
    for order in orders:
        stage_of = _split(order, g)
        if stage_of is not None:
            key = (max(_loads(g.t, stage_of, g.num_stages)), _cut(g.b, g.succs, stage_of))
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
    g = _graph(times, edges, num_stages, out_bytes, memory, memory_limit)
    stage_of = _greedy(g)
    if stage_of is None:
        raise PartitionError(f"no topological split into {num_stages} stages fits memory_limit="
                             f"{memory_limit:g}; partition_dag searches further and says what fits")
    return _result(g, stage_of, bound=0.0, optimal=False, start=start)


# ---------------------------------------------------------------- stage windows


def _reach_sums(g: _Graph, weights: np.ndarray, *, up: bool) -> np.ndarray:
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
    bits = np.frombuffer(b"".join(r.to_bytes(width, "little") for r in reach), dtype=np.uint8)
    bits = bits.reshape(n, width)
    # weighted popcount by byte: table[b, j] = weight of the nodes 8j..8j+7 whose bits are set in b
    padded = np.zeros((width * 8, weights.shape[1]), dtype=np.float64)  # float sums stay exact < 2**53
    padded[:n] = weights
    byte_bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    table = np.einsum("bi,jic->bjc", byte_bits.astype(np.float64), padded.reshape(width, 8, -1))
    out = np.zeros(weights.shape, dtype=np.float64)
    for j in range(width):
        out += table[bits[:, j], j]
    return np.rint(out).astype(np.int64)


def _windows(g: _Graph, ancestors: np.ndarray, descendants: np.ndarray,
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


# ---------------------------------------------------------------- the CP-SAT model


class _Model:
    """One CP-SAT phase over the nodes whose window spans several stages (integer units).

    Data: node i with time t_i, memory m_i, output bytes b_i, window [lo_i, hi_i], consumers C(i);
    stages k = 0..S-1; stage-time cap U; memory limit L.
    Variables (order encoding): g_ik = [stage_i > k] for lo_i <= k < hi_i, so stage_i = lo_i + Σ_k g_ik
    and x_ik = [stage_i = k] = g_i,k-1 - g_ik (with g_i,lo_i-1 = 1 and g_i,hi_i = 0).
    Phase ``time``: minimise T, load_k <= T <= U. Phase ``cut``: load_k <= U, minimise the cut bytes.
    """

    def __init__(self, g: _Graph, lo: list[int], hi: list[int], *, cap: int, minimise: str,
                 hint: Sequence[int] | None) -> None:
        self.g, self.lo, self.hi, self.hint = g, lo, hi, hint
        self.model = cp_model.CpModel()
        self.gv = [[self.model.NewBoolVar("") for _ in range(lo[i], hi[i])] for i in range(g.n)]
        self._monotone()
        self._precedence()
        loads = self._sums(g.t)
        if minimise == "time":
            self.objective = self.model.NewIntVar(g.lower_bound(), cap, "T")
            for load in loads:
                self.model.Add(load <= self.objective)
        else:
            for load in loads:
                self.model.Add(load <= cap)
            self.objective = self._cut_bytes()
        self.model.Minimize(self.objective)
        if g.limit is not None:
            for used in self._sums(g.m):
                self.model.Add(used <= g.limit)
        for count in self._sums([1] * g.n):
            self.model.Add(count >= 1)
        if hint is not None:  # a complete hint: CP-SAT starts from it as a first solution
            for i, stage in enumerate(hint):
                for k, var in zip(range(lo[i], hi[i]), self.gv[i]):
                    self.model.AddHint(var, stage > k)
            if minimise == "time":
                self.model.AddHint(self.objective, max(_loads(g.t, hint, g.num_stages)))

    def x(self, i: int, k: int):
        """x_ik = [stage_i = k] as a constant or a linear expression."""
        lo, hi, gv = self.lo[i], self.hi[i], self.gv[i]
        if not lo <= k <= hi:
            return 0
        return (1 if k == lo else gv[k - 1 - lo]) - (gv[k - lo] if k < hi else 0)

    def _monotone(self) -> None:
        """g_i,k+1 => g_ik (a node past stage k+1 is past stage k)."""
        for gs in self.gv:
            for a, b in pairwise(gs):
                self.model.AddImplication(b, a)

    def _precedence(self) -> None:
        """stage_u <= stage_v for each edge (u, v): g_uk => g_vk where both exist (windows already
        give lo_u <= lo_v and hi_u <= hi_v)."""
        for u, consumers in enumerate(self.g.succs):
            for v in consumers:
                for k in range(self.lo[v], self.hi[u]):
                    self.model.AddImplication(self.gv[u][k - self.lo[u]], self.gv[v][k - self.lo[v]])

    def _sums(self, weights: Sequence[int]) -> list:
        """Per stage k: Σ_i w_i·x_ik = P_k - P_k-1 with prefix sums P_k = Σ_i w_i·[stage_i <= k] =
        Σ_i w_i·(1 - g_ik) (each g in one equality; fixed nodes and windows fold into constants)."""
        S, total = self.g.num_stages, sum(weights)
        step, local = [0] * (S + 1), [0] * S  # step: from k on; local: at k only
        terms: list[list] = [[] for _ in range(S)]
        coefs: list[list[int]] = [[] for _ in range(S)]
        for i, w in enumerate(weights):
            if w == 0:
                continue
            lo, gs = self.lo[i], self.gv[i]
            step[lo + len(gs)] += w  # [stage_i <= k] = 1 from hi_i on, 1 - g_ik inside the window
            for j, var in enumerate(gs):
                local[lo + j] += w
                terms[lo + j].append(var)
                coefs[lo + j].append(-w)
        hinted = None if self.hint is None else np.cumsum(_loads(weights, self.hint, S)).tolist()
        prefix, running = [0], 0
        for k in range(S):
            running += step[k]
            if terms[k]:
                p = self.model.NewIntVar(0, total, "")
                self.model.Add(p == cp_model.LinearExpr.WeightedSum(terms[k], coefs[k]) + running + local[k])
                if hinted is not None:
                    self.model.AddHint(p, hinted[k])
                prefix.append(p)
            else:
                prefix.append(running + local[k])
        return [b - a for a, b in pairwise(prefix)]

    def _cut_bytes(self):
        """Σ_u b_u Σ_k y_uk with y_uk >= x_vk - x_uk for each consumer v: y_uk = 1 when stage k
        consumes u's output and u is not on k (fixed pairs fold into the constant)."""
        terms, weights, const = [], [], 0
        for u, consumers in enumerate(self.g.succs):
            b = self.g.b[u]
            if b == 0 or not consumers:
                continue
            for k in sorted({k for v in consumers for k in range(self.lo[v], self.hi[v] + 1)}):
                xu = self.x(u, k)
                if isinstance(xu, int) and xu == 1:
                    continue
                xs = [self.x(v, k) for v in consumers]
                if isinstance(xu, int) and any(isinstance(x, int) and x == 1 for x in xs):
                    const += b
                    continue
                y = self.model.NewBoolVar("")
                if self.hint is not None:
                    h = self.hint
                    self.model.AddHint(y, h[u] != k and any(h[v] == k for v in consumers))
                for x in xs:
                    if not (isinstance(x, int) and x == 0):
                        self.model.Add(y >= x - xu)
                terms.append(y)
                weights.append(b)
        return cp_model.LinearExpr.WeightedSum(terms, weights) + const

    def solve(self, seconds: float, workers: int) -> tuple[list[int] | None, bool, float]:
        """(stage per node or None, proven: optimal or infeasible, objective bound)."""
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.9 * seconds - 0.05, 0.05)  # loading takes time too
        solver.parameters.num_workers = workers
        solver.parameters.relative_gap_limit = _GAP_LIMIT
        solver.parameters.max_presolve_iterations = 1  # presolve gains little on this model and
        solver.parameters.cp_model_probing_level = 0  # takes seconds at 10,000 nodes
        status = solver.Solve(self.model)
        if not found_solution(status):
            return None, status == cp_model.INFEASIBLE, 0.0
        stage_of = [lo + sum(solver.BooleanValue(var) for var in gs) for lo, gs in zip(self.lo, self.gv)]
        bound = solver.BestObjectiveBound()
        return stage_of, solver.ObjectiveValue() - bound < 0.5, bound


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
    if _whole(workers) is None or workers < 1:
        raise PartitionError(f"workers={workers!r}; give a whole number >= 1")
    g = _graph(times, edges, num_stages, out_bytes, memory, memory_limit)
    deadline = start + time_limit
    hint = _greedy(g)
    if hint is None:  # only a memory limit stops every topological split
        hint = _memory_fit(g, deadline, workers)
    columns = [g.t] + ([g.m] if g.limit is not None else [])
    weights = np.array(columns, dtype=np.int64).T
    sums = (_reach_sums(g, weights, up=True), _reach_sums(g, weights, up=False))
    secondary = any(g.b) and any(g.succs)
    stage_of, bound = _minimise_time(g, sums, hint, deadline, workers, secondary=secondary)
    bound = max(bound / g.time_scale, _analytic_bound(g))
    slowest = max(_loads(g.times, stage_of, g.num_stages))
    optimal = slowest <= bound * (1 + (1e-12 if g.exact else 1e-6))  # rounding noise is far below 1e-6
    if secondary:
        stage_of, proven_cut = _minimise_cut(g, sums, stage_of, hint, balance, deadline, workers)
        optimal = optimal and proven_cut
    return _result(g, stage_of, bound=bound, optimal=optimal, start=start)


def _analytic_bound(g: _Graph) -> float:
    """max(total / S, largest node): no partition's slowest stage is faster."""
    return max(sum(g.times) / g.num_stages, max(g.times))


def _loads(weights: Sequence[float], stage_of: Sequence[int], num_stages: int) -> list:
    loads = [0] * num_stages
    for v, s in enumerate(stage_of):
        loads[s] += weights[v]
    return loads


def _minimise_time(g: _Graph, sums, hint: list[int] | None, deadline: float, workers: int, *,
                   secondary: bool) -> tuple[list[int], int]:
    """Phase 1: minimise the slowest stage inside the windows of the hint's slowest stage (every
    better partition lies in them). Returns (stage_of, proven integer bound)."""
    lb = g.lower_bound()
    cap = sum(g.t) if hint is None else max(_loads(g.t, hint, g.num_stages))
    if hint is not None and cap <= lb:
        return hint, lb
    windows = _windows(g, *sums, [cap, g.limit])
    if windows is None:
        raise _memory_error(g, None)
    model = _Model(g, *windows, cap=cap, minimise="time", hint=hint)
    share = 0.5 if secondary else 1.0
    found, proven, bound = model.solve((deadline - time.perf_counter()) * share, workers)
    if found is None and hint is None:
        if proven:
            raise _memory_error(g, None)
        raise PartitionError(f"no partition under memory_limit={g.memory_limit:g} found within the time "
                             "limit; raise time_limit (or memory_limit)")
    if found is None:
        return hint, lb
    return found, max(lb, math.ceil(bound - 1e-6))


def _minimise_cut(g: _Graph, sums, stage_of: list[int], greedy: list[int] | None, balance: float,
                  deadline: float, workers: int) -> tuple[list[int], bool]:
    """Phase 2: minimise the cut bytes with every stage within (1 + balance) of phase 1's slowest,
    starting from the fewer-bytes one of phase 1's partition and the greedy one when it fits."""
    cap = math.floor((1 + balance) * max(_loads(g.t, stage_of, g.num_stages)) + 1e-9)
    if greedy is not None and max(_loads(g.t, greedy, g.num_stages)) <= cap:
        stage_of = min(stage_of, greedy, key=lambda s: _cut(g.b, g.succs, s))
    if _cut(g.b, g.succs, stage_of) == 0:
        return stage_of, True
    windows = _windows(g, *sums, [cap, g.limit])
    assert windows is not None, "the hint lies in the phase 2 windows"
    model = _Model(g, *windows, cap=cap, minimise="cut", hint=stage_of)
    found, proven, _ = model.solve(deadline - time.perf_counter(), workers)
    if found is None or _cut(g.b, g.succs, found) > _cut(g.b, g.succs, stage_of):
        return stage_of, False
    return found, proven


# ---------------------------------------------------------------- memory that does not fit


def _edges(g: _Graph) -> list[tuple[int, int]]:
    return [(u, v) for v in range(g.n) for u in g.preds[v]]


def _memory_fit(g: _Graph, deadline: float, workers: int) -> list[int] | None:
    """A partition within the memory limit from minimising the largest stage memory (a third of the
    time left); raises when that proves none exists; None when undecided."""
    seconds = max(0.1, (deadline - time.perf_counter()) / 3)
    fit = partition_dag(g.memory, _edges(g), num_stages=g.num_stages, time_limit=seconds, workers=workers)
    if max(_loads(g.m, fit.stage_of, g.num_stages)) <= g.limit:
        return list(fit.stage_of)
    if fit.bound > g.memory_limit:
        raise _memory_error(g, fit)
    return None


def _fewest_stages(g: _Graph) -> int | None:
    """Fewest stages a greedy memory-only fill of a topological order needs (None: a node alone is
    over the limit)."""
    if max(g.m) > g.limit:
        return None
    best = g.n
    for order in (g.order, topological_order(g.preds, order="depth")):
        count, used = 1, 0
        for v in order:
            if used + g.m[v] > g.limit:
                count, used = count + 1, 0
            used += g.m[v]
        best = min(best, count)
    return best


def _memory_error(g: _Graph, fit: DagPartition | None) -> PartitionError:
    """What would fit: the smallest limit for these stages (proven, or the best found) and how many
    stages this limit needs."""
    if fit is None:
        fit = partition_dag(g.memory, _edges(g), num_stages=g.num_stages, time_limit=2.0)
    S, limit = g.num_stages, g.memory_limit
    text = f"memory_limit={limit:g} admits no partition into {S} stages"
    heaviest = max(range(g.n), key=lambda v: g.memory[v])
    if g.memory[heaviest] > limit:
        text += f" (node {heaviest} alone needs {g.memory[heaviest]:g})"
    if fit.status == "optimal":
        text += f"; the smallest limit that fits {S} stages is {fit.max_stage_time:g}"
    else:
        text += f"; a limit of {fit.max_stage_time:g} fits {S} stages (none below {fit.bound:g} does)"
    fewest = _fewest_stages(g)
    if fewest is not None and fewest <= g.n:
        text += f", or keep this limit with {fewest} stages"
    return PartitionError(text)
