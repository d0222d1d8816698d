"""Cut a cost table's pieces into pipeline stages: an exact dynamic program over split points.

Stage j holds the pieces ``starts[j] .. starts[j+1]-1`` (call order, as the runtime cuts). Its time
``T_j`` is the pieces' F + I + W plus, when its output goes to another rank, the link time of the
bytes leaving it. The objective is the pipeline time of Alpa's stage slicing,

    Σ_j T_j + weight · max_j T_j        (weight = N - 1, N = stage visits per rank and step),

subject to every copy of every stage fitting its memory limit (:class:`MemoryRule`). The front of
(max T, Σ T) serves every weight: whole per (stages, pieces) on small tables, one cap at a time on big
ones (:class:`SplitFront`). The CP-SAT DAG partitioner (:func:`partition_pieces_dag`) is there on
request; its stages need not be runs in call order, which the runtime cannot cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pipeloom.plan.costs import CostTable, format_bytes
from pipeloom.plan.plan import PartitionError

__all__ = [
    "LABEL_DP_MAX_PIECES",
    "MemoryRule",
    "Partition",
    "PartitionError",
    "SplitFront",
    "StageRule",
    "objective",
    "partition_pieces",
    "partition_pieces_dag",
    "segment_memory",
    "segment_time",
    "smallest_memory_scale",
    "split_partition",
    "split_times",
    "with_weight",
]

LABEL_DP_MAX_PIECES = 120
""":class:`SplitFront` keeps whole Pareto fronts (O(S·n²) labels) up to this many pieces, and walks
the front one cap at a time above (O(S·n·log n) per cap; 2,000 pieces into 16 stages in about a second)."""

_TOLERANCE = 1e-9
_CAP_TOLERANCE = 1e-10
"""Relative precision of the bisections on the cap: a front point's max T is at most this much above
the least max T with its Σ T, so a split's objective is within ``weight · max T · 1e-10`` of the exact one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryRule:
    """One copy of a stage on a rank: how many micro-batches it holds at the rank's peak, and its limit.

    Its bytes are ``static + held · (activation - w_activation) + w_held · w_activation`` where static
    counts weights, gradients and optimizer state (:meth:`CostTable.static_bytes`).
    """

    held: float = 1.0
    """Micro-batches whose forward ran and whose I (or B) has not: all their activations are held."""
    w_held: float = 1.0
    """Micro-batches whose forward ran and whose W (or B) has not: their W-kept activations are held."""
    limit: float | None = None
    """Bytes this copy may take (its share of the rank's limit); None for no limit."""

    def __post_init__(self) -> None:
        if self.held < 0 or self.w_held < self.held:
            raise PartitionError(f"memory rule needs 0 <= held <= w_held, got held={self.held}, "
                                 f"w_held={self.w_held}")

    def bytes(self, static: float, activation: float, w_activation: float) -> float:
        """Bytes a stage with these totals takes on its rank."""
        return static + self.held * (activation - w_activation) + self.w_held * w_activation


@dataclass(frozen=True, kw_only=True, slots=True)
class StageRule:
    """What the partitioner knows of one stage's place in the pipeline."""

    sends: bool = True
    """Its output goes to another rank, so the link time of the bytes leaving it counts."""
    copies: tuple[MemoryRule, ...] = (MemoryRule(),)
    """One rule per rank that holds the stage (two for two-replica schedules)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """Pieces assigned to stages, with the times and memory the objective saw."""

    stage_of: tuple[int, ...]
    """Per piece: its stage."""
    split_points: tuple[str, ...] | None
    """Names of the pieces where stages 1.. start; None when a stage is not a run of pieces in call
    order (possible only for a DAG partition), which the runtime cannot cut."""
    stage_times: tuple[float, ...]
    """Per stage: F + I + W of its pieces plus the link time of its output (when it sends)."""
    stage_memory: tuple[float, ...]
    """Per stage: bytes of its largest copy (:class:`MemoryRule`)."""
    objective: float
    """``Σ stage_times + weight · max(stage_times)``."""
    weight: float
    """The weight of the slowest stage in the objective."""
    method: Literal["dp", "dag"] = "dp"
    """Exact DP over split points, or the CP-SAT DAG partitioner."""
    status: str = "optimal"
    """``optimal`` (the DP is exact) or the DAG partitioner's status."""

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stage_times)

    @property
    def max_stage_time(self) -> float:
        """The slowest stage's time."""
        return max(self.stage_times)


# ------------------------------------------------------------------------------ the cost of a stage


class _Sums:
    """Prefix sums of a table for O(1) segment costs; ``crossing(a, b)``: bytes leaving pieces a..b-1."""

    def __init__(self, table: CostTable) -> None:
        pieces = table.pieces
        self.n = len(pieces)
        self.link = table.link
        self.time = _prefix(p.time for p in pieces)
        self.static = _prefix(table.static_bytes(p) for p in pieces)
        self.activation = _prefix(p.activation_bytes for p in pieces)
        self.w_activation = _prefix(p.w_activation_bytes for p in pieces)
        self.out = [p.output_bytes for p in pieces]
        self.last_use = [-1] * self.n
        for producer, consumer in table.edges:
            self.last_use[producer] = max(self.last_use[producer], consumer)
        self.chain = table.is_chain
        self._crossing: dict[int, list[float]] = {}

    def crossing(self, a: int, b: int) -> float:
        if b >= self.n:
            return 0.0
        if self.chain:
            return self.out[b - 1]
        row = self._crossing.get(b)
        if row is None:  # row[a] = Σ out[k] over k in [a, b) read by a piece >= b
            row = [0.0] * (b + 1)
            for k in range(b - 1, -1, -1):
                row[k] = row[k + 1] + (self.out[k] if self.last_use[k] >= b else 0.0)
            self._crossing[b] = row
        return row[a]

    def seconds(self, a: int, b: int, sends: bool) -> float:
        compute = self.time[b] - self.time[a]
        return compute + self.link.time(self.crossing(a, b)) if sends else compute

    def nbytes(self, a: int, b: int, rule: MemoryRule) -> float:
        return rule.bytes(self.static[b] - self.static[a], self.activation[b] - self.activation[a],
                          self.w_activation[b] - self.w_activation[a])

    def fits(self, a: int, b: int, rule: StageRule) -> bool:
        return all(c.limit is None or self.nbytes(a, b, c) <= c.limit * (1 + _TOLERANCE) for c in rule.copies)


def _prefix(values) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def segment_time(table: CostTable, first: int, stop: int, *, sends: bool = True) -> float:
    """Time of a stage holding pieces ``first .. stop-1``: their F + I + W, plus the link time of the
    bytes they pass to pieces at or after ``stop`` when ``sends``."""
    return _Sums(table).seconds(first, stop, sends)


def segment_memory(table: CostTable, first: int, stop: int, rule: MemoryRule) -> float:
    """Bytes of one copy of a stage holding pieces ``first .. stop-1`` under ``rule``."""
    return _Sums(table).nbytes(first, stop, rule)


def objective(stage_times: Sequence[float], weight: float) -> float:
    """``Σ T_j + weight · max T_j``, the pipeline-time objective."""
    return sum(stage_times) + weight * max(stage_times)


# ------------------------------------------------------------------------------------------ the DP


def _check_request(table: CostTable, rules: Sequence[StageRule], weight: float) -> None:
    if not rules:
        raise PartitionError("give at least one stage rule (one per stage)")
    if weight < 0:
        raise PartitionError(f"the weight of the slowest stage must be >= 0, got {weight}")
    if len(rules) > len(table.pieces):
        raise PartitionError(
            f"{len(rules)} stages need at least {len(rules)} pieces, but the cost table has "
            f"{len(table.pieces)}; use at most {len(table.pieces)} stages or profile finer pieces"
        )


def _fronts(sums: _Sums, rules: Sequence[StageRule]) -> list[list[list[tuple] | None]]:
    """``front[j][b]``: Pareto labels ``(max T, Σ T, a, parent)`` of j stages over pieces 0..b-1, where
    the last stage starts at piece a and ``parent`` indexes ``front[j-1][a]``."""
    n, count = sums.n, len(rules)
    front: list[list[list[tuple] | None]] = [[None] * (n + 1) for _ in range(count + 1)]
    front[0][0] = [(0.0, 0.0, -1, -1)]
    for j in range(1, count + 1):
        rule = rules[j - 1]
        for b in range(j, n - (count - j) + 1):
            labels = []
            for a in range(b - 1, j - 2, -1):  # the stage grows as a falls: memory only rises
                if not sums.fits(a, b, rule):
                    break
                previous = front[j - 1][a]
                if not previous:
                    continue
                t = sums.seconds(a, b, rule.sends)
                # the inner loop of the DP: a conditional expression is faster than max()
                labels.extend((mx if mx > t else t, total + t, a, k)  # noqa: FURB136
                              for k, (mx, total, _, _) in enumerate(previous))
            front[j][b] = _pareto(labels)
    return front


def _pareto(labels: list[tuple]) -> list[tuple]:
    """The labels not dominated in (max T, Σ T), by increasing max T."""
    labels.sort()
    kept: list[tuple] = []
    for label in labels:
        if not kept or label[1] < kept[-1][1] - _TOLERANCE * abs(kept[-1][1]):
            kept.append(label)
    return kept


def _walk_back(front, count: int, n: int, index: int) -> list[int]:
    """Stage starts of the label ``front[count][n][index]``."""
    starts = []
    b, k = n, index
    for j in range(count, 0, -1):
        _, _, a, k = front[j][b][k]
        starts.append(a)
        b = a
    return starts[::-1]


class SplitFront:
    """Every split worth having for a table and its stage rules: the Pareto front of (max T, Σ T).

    :meth:`best` picks the split of least ``Σ T + weight · max T`` for any weight, so one front serves
    every micro-batch count that keeps the same rules. Up to :data:`LABEL_DP_MAX_PIECES` pieces the
    DP keeps the whole front per (stages, pieces) (exact); above, :class:`_CapDP` finds the front's
    points one cap at a time (``method`` forces either: ``labels`` or ``caps``).
    """

    def __init__(self, table: CostTable, rules: Sequence[StageRule], *,
                 method: Literal["auto", "labels", "caps"] = "auto") -> None:
        _check_request(table, rules, 0.0)
        if method not in ("auto", "labels", "caps"):
            raise PartitionError(f"unknown DP method {method!r}; choose auto, labels or caps")
        self.table, self.rules = table, tuple(rules)
        self._sums = _Sums(table)
        labels = method == "labels" or (method == "auto" and self._sums.n <= LABEL_DP_MAX_PIECES)
        self._front = _fronts(self._sums, self.rules) if labels else None
        self._caps = None if labels else _CapDP(self._sums, self.rules)

    @property
    def feasible(self) -> bool:
        """Whether some split fits the memory rules."""
        if self._caps is not None:
            return self._caps.point(float("inf")) is not None
        return bool(self._front[len(self.rules)][self._sums.n])

    def best(self, weight: float) -> Partition:
        """The split of least ``Σ T_j + weight · max T_j``; PartitionError when none fits the memory."""
        if weight < 0:
            raise PartitionError(f"the weight of the slowest stage must be >= 0, got {weight}")
        if self._caps is not None:
            starts = self._caps.best(weight)
        else:
            final = self._front[len(self.rules)][self._sums.n]
            starts = None
            if final:
                index = min(range(len(final)), key=lambda k: final[k][1] + weight * final[k][0])
                starts = _walk_back(self._front, len(self.rules), self._sums.n, index)
        if starts is None:
            raise _memory_error(self.table, self.rules)
        return _result(self.table, self._sums, self.rules, starts, weight)


def partition_pieces(table: CostTable, rules: Sequence[StageRule], *, weight: float) -> Partition:
    """The split points minimising ``Σ T_j + weight · max T_j`` over ``len(rules)`` stages (exact).

    ``rules[j]`` says whether stage j sends its output to another rank and what memory each of its
    copies may take. PartitionError when there are more stages than pieces, or when no split fits
    the memory (the message names how much more memory the best split needs).
    """
    _check_request(table, rules, weight)
    return SplitFront(table, rules).best(weight)


def partition_pieces_dag(table: CostTable, rules: Sequence[StageRule], *, weight: float,
                         time_limit: float = 10.0, workers: int = 2) -> Partition:
    """The CP-SAT DAG partitioner (:func:`pipeloom.plan.dag.partition_dag`) on the table's pieces:
    it minimises the slowest stage's compute, then the bytes crossing stages.

    It runs first without memory limits; when that split breaks a rule, again with its memory
    model, which has one size per piece and one limit for all stages: each piece counts with the
    largest held counts of any stage copy, under the smallest copy limit (safe, not exact). The
    result's ``split_points`` is None when a stage is not a run of pieces in call order.
    """
    _check_request(table, rules, weight)
    copies = [c for rule in rules for c in rule.copies]
    limits = [c.limit for c in copies if c.limit is not None]
    found = _dag_split(table, rules, weight, None, None, time_limit, workers)
    if not limits or _fits_rules(table, rules, found.stage_of):
        return found
    held = MemoryRule(held=max(c.held for c in copies), w_held=max(c.w_held for c in copies))
    memory = [held.bytes(table.static_bytes(p), p.activation_bytes, p.w_activation_bytes) for p in table.pieces]
    return _dag_split(table, rules, weight, memory, min(limits), time_limit, workers)


def _fits_rules(table: CostTable, rules: Sequence[StageRule], stage_of: Sequence[int]) -> bool:
    totals = [[0.0, 0.0, 0.0] for _ in rules]  # static, activation, W-kept bytes per stage
    for piece, j in zip(table.pieces, stage_of):
        totals[j][0] += table.static_bytes(piece)
        totals[j][1] += piece.activation_bytes
        totals[j][2] += piece.w_activation_bytes
    return all(c.limit is None or c.bytes(*totals[j]) <= c.limit * (1 + _TOLERANCE)
               for j, rule in enumerate(rules) for c in rule.copies)


def _dag_split(table: CostTable, rules: Sequence[StageRule], weight: float, memory: list[float] | None,
               limit: float | None, time_limit: float, workers: int) -> Partition:
    """One call of the DAG partitioner, its answer as a :class:`Partition`."""
    from pipeloom.plan.dag import partition_dag

    found = partition_dag([p.time for p in table.pieces], list(table.edges), num_stages=len(rules),
                          out_bytes=[p.output_bytes for p in table.pieces], memory=memory, memory_limit=limit,
                          time_limit=time_limit, workers=workers)
    stage_of = tuple(found.stage_of)
    if all(stage_of[k] <= stage_of[k + 1] for k in range(len(stage_of) - 1)):
        starts = [stage_of.index(j) for j in range(len(rules))]
        return _result(table, _Sums(table), rules, starts, weight, method="dag", status=found.status)
    times = [0.0] * len(rules)
    leaving = [0.0] * len(rules)
    for k, piece in enumerate(table.pieces):
        times[stage_of[k]] += piece.time
    consumers: dict[int, set[int]] = {}
    for producer, consumer in table.edges:
        consumers.setdefault(producer, set()).add(stage_of[consumer])
    for producer, stages in consumers.items():
        if stages - {stage_of[producer]}:
            leaving[stage_of[producer]] += table.pieces[producer].output_bytes
    times = [t + (table.link.time(leaving[j]) if rules[j].sends else 0.0) for j, t in enumerate(times)]
    memory_used = tuple(found.stage_memory) if found.stage_memory else (0.0,) * len(rules)
    return Partition(stage_of=stage_of, split_points=None, stage_times=tuple(times), stage_memory=memory_used,
                     objective=objective(times, weight), weight=weight, method="dag", status=found.status)


def _result(table: CostTable, sums: _Sums, rules: Sequence[StageRule], starts: Sequence[int],
            weight: float, *, method: Literal["dp", "dag"] = "dp", status: str = "optimal") -> Partition:
    bounds = [*starts, sums.n]
    times = tuple(sums.seconds(bounds[j], bounds[j + 1], rules[j].sends) for j in range(len(rules)))
    memory = tuple(max(sums.nbytes(bounds[j], bounds[j + 1], c) for c in rules[j].copies)
                   for j in range(len(rules)))
    stage_of = tuple(j for j in range(len(rules)) for _ in range(bounds[j], bounds[j + 1]))
    return Partition(stage_of=stage_of, split_points=tuple(table.pieces[a].name for a in starts[1:]),
                     stage_times=times, stage_memory=memory, objective=objective(times, weight),
                     weight=weight, method=method, status=status)


# ------------------------------------------------------------------- the parametric DP (big tables)


class _CapDP:
    """The same front for big tables: least Σ T under a cap on every T_j, found by a DP in O(S·n·log n)
    (a range minimum per stage end), then a search over the cap (Eisner-Severance style).

    ``least(cap)``: the split of least Σ T whose stages all take <= cap; among equal sums, bisection on
    the cap finds the least max T (to a relative :data:`_CAP_TOLERANCE`). Every point of the
    Pareto front of (max T, Σ T) is one such split, so :meth:`best` walks the front from the least
    Σ T down to the least max T, skipping caps that cannot beat the best split seen (a split of max T
    = M can only win if ``Σ_seen + weight · M`` is below the best objective).
    """

    def __init__(self, sums: _Sums, rules: Sequence[StageRule]) -> None:
        import numpy as np

        self.np, self.sums, self.rules = np, sums, tuple(rules)
        n = sums.n
        self.time = np.array(sums.time)
        self.lower = max(max(sums.time[k + 1] - sums.time[k] for k in range(n)), sums.time[n] / len(rules))
        # query intervals: stage end b, its start a in [lo, hi], the bytes leaving [a, b) constant there
        qb, qlo, qhi, qbytes = [], [], [], []
        live = _live_values(sums)
        for b in range(1, n + 1):
            first, produced = 0, live[b]
            suffix = sum(sums.out[k] for k in produced)
            for k in produced:
                if first <= k:
                    qb.append(b), qlo.append(first), qhi.append(k), qbytes.append(suffix)
                suffix -= sums.out[k]
                first = k + 1
            if first <= b - 1:
                qb.append(b), qlo.append(first), qhi.append(b - 1), qbytes.append(0.0)
        self.qb, self.qlo, self.qhi = np.array(qb), np.array(qlo), np.array(qhi)
        link = np.array([sums.link.time(x) for x in qbytes])
        self.link = [link if rule.sends else np.zeros(len(qb)) for rule in self.rules]
        self.fits_from = [self._fits_from(rule) for rule in self.rules]
        self.starts = np.searchsorted(self.qb, np.arange(n + 2))  # queries of b: starts[b]:starts[b+1]
        self._points: list[tuple[float, float, float, tuple[int, ...]]] = []  # (cap, max T, Σ T, starts)

    def _fits_from(self, rule: StageRule):
        """Per stage end b: the first start a whose stage fits every copy's limit."""
        np, sums = self.np, self.sums
        first = np.zeros(sums.n + 1, dtype=np.int64)
        for c in rule.copies:
            if c.limit is None:
                continue
            held = np.array([c.bytes(s, a, w) for s, a, w in zip(sums.static, sums.activation, sums.w_activation)])
            first = np.maximum(first, np.searchsorted(held, held - c.limit * (1 + _TOLERANCE), side="left"))
        return first

    def _solve(self, cap: float) -> tuple[float, float, tuple[int, ...]] | None:
        """``(max T, Σ T, starts)`` of a split of least Σ T with every T_j <= cap; None when none fits."""
        np, n, count = self.np, self.sums.n, len(self.rules)
        values = np.full(n + 1, np.inf)
        values[0] = 0.0
        table = [values]
        for j in range(count):
            lo = np.maximum(self.qlo, np.maximum(self.fits_from[j][self.qb], j))
            if cap < np.inf:  # T = time[b] - time[a] + link <= cap
                lo = np.maximum(lo, np.searchsorted(self.time, self.time[self.qb] + self.link[j] - cap * (1 + 1e-12)))
            ok = (lo <= self.qhi) & (self.qb <= n - (count - 1 - j))
            found = _range_min(np, values - self.time, lo[ok], self.qhi[ok]) + self.time[self.qb[ok]] + self.link[j][ok]
            values = np.full(n + 1, np.inf)
            np.minimum.at(values, self.qb[ok], found)
            table.append(values)
        if not np.isfinite(values[n]):
            return None
        starts, b = [], n
        for j in range(count, 0, -1):  # walk back: the start whose sum gives the stage end's value
            q = slice(self.starts[b], self.starts[b + 1])
            lo = np.maximum(self.qlo[q], np.maximum(self.fits_from[j - 1][b], j - 1))
            if cap < np.inf:
                lo = np.maximum(lo, np.searchsorted(self.time, self.time[b] + self.link[j - 1][q] - cap * (1 + 1e-12)))
            best = (np.inf, -1)
            for low, high, link in zip(lo, self.qhi[q], self.link[j - 1][q]):
                if low <= high:
                    segment = table[j - 1][low:high + 1] - self.time[low:high + 1]
                    k = int(np.argmin(segment))
                    best = min(best, (segment[k] + link, low + k))
            starts.append(best[1])
            b = best[1]
        starts = tuple(starts[::-1])
        times = [self.sums.seconds(a, z, r.sends) for a, z, r in zip(starts, [*starts[1:], n], self.rules)]
        return max(times), sum(times), starts

    def point(self, cap: float, lower: float | None = None) -> tuple[float, float, tuple[int, ...]] | None:
        """The front point of least Σ T under ``cap``: ``(max T, Σ T, starts)`` with max T the least one
        for that sum (bisection on the cap down to ``lower``, below which nothing fits)."""
        for top, mx, total, starts in self._points:
            if mx <= cap <= top:
                return mx, total, starts
        found = self._solve(cap)
        if found is None:
            return None
        target = found[1] + _TOLERANCE * abs(found[1])
        lo = max(self.lower, lower or 0.0) * (1 - 1e-12)
        while found[0] - lo > _CAP_TOLERANCE * found[0]:
            middle = (lo + found[0]) / 2
            trial = self._solve(middle)
            if trial is not None and trial[1] <= target:
                found = trial
            else:
                lo = middle
        self._points.append((cap, *found))
        return found

    def best(self, weight: float) -> tuple[int, ...] | None:
        """Stage starts of the split of least ``Σ T + weight · max T``; None when none fits."""
        top = self.point(float("inf"))
        if top is None:
            return None
        if weight == 0:
            return top[2]
        least = self._least_max(top[0])
        bottom = self.point(least)
        best = min((top, bottom), key=lambda p: p[1] + weight * p[0])
        cap, total = top[0], top[1]
        while True:
            cap = min(cap * (1 - _CAP_TOLERANCE), (best[1] + weight * best[0] - total) / weight)
            if cap < bottom[0]:
                return best[2]
            found = self.point(cap, lower=bottom[0])
            if found is None:
                return best[2]
            cap, total = found[0], found[1]
            best = min((best, found), key=lambda p: p[1] + weight * p[0])

    def _least_max(self, high: float) -> float:
        """The least max T of any split that fits (bisection: within :data:`_CAP_TOLERANCE`)."""
        lo = self.lower * (1 - 1e-12)
        while high - lo > _CAP_TOLERANCE * high:
            middle = (lo + high) / 2
            trial = self._solve(middle)
            if trial is None:
                lo = middle
            else:
                high = trial[0]
        return high


def _range_min(np, values, lo, hi):
    """``min(values[lo[q] .. hi[q]])`` for every query q (a sparse table; lo <= hi)."""
    levels = [values]
    width = 1
    while 2 * width <= len(values):
        last = levels[-1]
        levels.append(np.minimum(last[:-width], last[width:]))
        width *= 2
    size = len(values)
    stacked = np.full((len(levels), size), np.inf)
    for k, level in enumerate(levels):
        stacked[k, :len(level)] = level
    k = np.frexp((hi - lo + 1).astype(np.float64))[1] - 1
    return np.minimum(stacked[k, lo], stacked[k, hi - (1 << k) + 1])


def _live_values(sums: _Sums) -> list[list[int]]:
    """Per cut b (pieces before b | pieces from b): the pieces before it whose output is read at or
    after b, ascending (a chain: ``[b - 1]``; none at the end)."""
    n = sums.n
    if sums.chain:
        return [[]] + [[b - 1] for b in range(1, n)] + [[]]
    live: list[list[int]] = [[] for _ in range(n + 1)]
    for k in range(n):
        for b in range(k + 1, min(sums.last_use[k], n - 1) + 1):
            live[b].append(k)
    return live


# ----------------------------------------------------------------------- what memory would fit


def smallest_memory_scale(table: CostTable, rules: Sequence[StageRule]) -> tuple[float, tuple[int, ...]]:
    """``(scale, starts)``: the smallest factor by which every copy's limit must grow for some split to
    fit (1 or less: it fits already), and that split's stage starts. A bottleneck DP over
    ``max_copies bytes / limit``; copies without a limit do not count."""
    _check_request(table, rules, 0.0)
    sums = _Sums(table)
    if sums.n > LABEL_DP_MAX_PIECES:
        return _scale_by_bisection(sums, rules)
    n, count = sums.n, len(rules)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    start = [[-1] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for j in range(1, count + 1):
        for b in range(j, n - (count - j) + 1):
            for a in range(b - 1, j - 2, -1):  # the stage grows as a falls: its own need only rises
                own = max(sums.nbytes(a, b, c) / c.limit if c.limit else 0.0 for c in rules[j - 1].copies)
                if own >= best[j][b]:
                    break
                need = max(own, best[j - 1][a])
                if need < best[j][b]:
                    best[j][b], start[j][b] = need, a
    starts, b = [], n
    for j in range(count, 0, -1):
        starts.append(start[j][b])
        b = start[j][b]
    return best[count][n], tuple(starts[::-1])


def _scale_by_bisection(sums: _Sums, rules: Sequence[StageRule]) -> tuple[float, tuple[int, ...]]:
    """:func:`smallest_memory_scale` for big tables: bisection on the scale (relative 1e-12), each step a
    reachability DP with numpy; the scale returned is the split's own need, so it fits exactly."""
    import numpy as np

    n, count = sums.n, len(rules)
    copies = [[(np.array([c.bytes(*t) for t in zip(sums.static, sums.activation, sums.w_activation)]), c.limit)
               for c in rule.copies if c.limit] for rule in rules]

    def split(scale: float) -> tuple[int, ...] | None:
        firsts, reach = [], np.zeros(n + 1, dtype=bool)
        reach[0] = True
        for j, held in enumerate(copies):
            first = np.full(n + 1, j, dtype=np.int64)
            for prefix, limit in held:
                first = np.maximum(first, np.searchsorted(prefix, prefix - limit * scale, side="left"))
            counts = np.concatenate(([0], np.cumsum(reach)))  # counts[b] = reachable starts below b
            last = np.arange(n + 1)  # a <= b - 1
            reach = (first <= last - 1) & (counts[last] - counts[np.minimum(first, last)] > 0)
            reach[:j + 1] = False
            firsts.append((first, reach.copy()))
        if not reach[n]:
            return None
        starts, b = [], n
        for j in range(count - 1, -1, -1):
            previous = firsts[j - 1][1] if j else np.eye(1, n + 1, 0, dtype=bool)[0]
            a = int(np.flatnonzero(previous[firsts[j][0][b]:b])[0]) + int(firsts[j][0][b])
            starts.append(a)
            b = a
        return tuple(starts[::-1])

    def need(starts: tuple[int, ...]) -> float:
        bounds = [*starts, n]
        return max((sums.nbytes(bounds[j], bounds[j + 1], c) / c.limit for j in range(count)
                    for c in rules[j].copies if c.limit), default=0.0)

    if not any(copies):
        return 0.0, tuple(range(count))
    best = split(float("inf"))
    high, low = need(best), 0.0
    while high - low > 1e-12 * high:
        middle = (low + high) / 2
        trial = split(middle)
        if trial is None:
            low = middle
        else:
            best, high = trial, need(trial)
    return high, best


def _memory_error(table: CostTable, rules: Sequence[StageRule]) -> PartitionError:
    scale, _ = smallest_memory_scale(table, rules)
    limits = sorted({c.limit for rule in rules for c in rule.copies if c.limit})
    shown = ", ".join(f"{format_bytes(limit)} -> {format_bytes(limit * scale)}" for limit in limits[:3])
    return PartitionError(
        f"no split of the {len(table.pieces)} pieces into {len(rules)} stages fits the memory limits; the "
        f"best split needs {scale:.3g}x the memory ({shown}): raise the limit, or use more stages or ranks"
    )


def split_partition(table: CostTable, rules: Sequence[StageRule], starts: Sequence[int], *,
                    weight: float) -> Partition:
    """The :class:`Partition` whose stage j starts at piece ``starts[j]`` (``starts[0] == 0``), judged
    with ``weight`` under ``rules`` (memory is reported, not checked)."""
    _check_request(table, rules, weight)
    n = len(table.pieces)
    if len(starts) != len(rules) or starts[0] != 0 or any(b <= a for a, b in zip(starts, [*starts[1:], n])):
        raise PartitionError(f"stage starts {list(starts)} must begin at 0 and rise to at most {n - 1}, one per rule")
    return _result(table, _Sums(table), rules, starts, weight)


def split_times(table: CostTable, rules: Sequence[StageRule]) -> Callable[[Sequence[int]], tuple[float, ...]]:
    """A function from stage starts to stage times under ``rules`` (prefix sums built once)."""
    sums, sends = _Sums(table), [rule.sends for rule in rules]

    def times(starts: Sequence[int]) -> tuple[float, ...]:
        bounds = [*starts, sums.n]
        return tuple(sums.seconds(bounds[j], bounds[j + 1], sends[j]) for j in range(len(sends)))

    return times


def with_weight(partition: Partition, weight: float) -> Partition:
    """The same split judged with another weight of the slowest stage."""
    return dataclasses.replace(partition, weight=weight, objective=objective(partition.stage_times, weight))
