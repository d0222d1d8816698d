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

from collections.abc import Sequence
from typing import Literal

from pipeloom.formatting import format_bytes
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PartitionError
from pipeloom.plan.partitioning.caps import CapFront, scale_by_bisection
from pipeloom.plan.partitioning.rules import (
    TOLERANCE,
    MemoryRule,
    Partition,
    PieceSums,
    StageRule,
    check_request,
    objective,
    partition_of,
)

__all__ = ["LABEL_DP_MAX_PIECES", "SplitFront", "partition_pieces", "partition_pieces_dag", "smallest_memory_scale"]

LABEL_DP_MAX_PIECES = 120
""":class:`SplitFront` keeps whole Pareto fronts (O(S·n²) labels) up to this many pieces, and walks
the front one cap at a time above (O(S·n·log n) per cap; 2,000 pieces into 16 stages in about a second)."""


_Label = tuple[float, float, int, int]
"""A Pareto label of the DP: ``(max T, Σ T, a, parent)`` (see :func:`_fronts`)."""


def _fronts(sums: PieceSums, rules: Sequence[StageRule]) -> list[list[list[_Label] | None]]:
    """``front[j][b]``: Pareto labels ``(max T, Σ T, a, parent)`` of j stages over pieces 0..b-1, where
    the last stage starts at piece a and ``parent`` indexes ``front[j-1][a]``."""
    n, count = sums.n, len(rules)
    front: list[list[list[_Label] | None]] = [[None] * (n + 1) for _ in range(count + 1)]
    front[0][0] = [(0.0, 0.0, -1, -1)]
    for j in range(1, count + 1):
        rule = rules[j - 1]
        for b in range(j, n - (count - j) + 1):
            labels: list[_Label] = []
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


def _pareto(labels: list[_Label]) -> list[_Label]:
    """The labels not dominated in (max T, Σ T), by increasing max T."""
    labels.sort()
    kept: list[_Label] = []
    for label in labels:
        if not kept or label[1] < kept[-1][1] - TOLERANCE * abs(kept[-1][1]):
            kept.append(label)
    return kept


def _walk_back(front: list[list[list[_Label] | None]], count: int, n: int, index: int) -> list[int]:
    """Stage starts of the label ``front[count][n][index]``."""
    starts = []
    b, k = n, index
    for j in range(count, 0, -1):
        labels = front[j][b]
        assert labels is not None, "a label's parent is on the front"
        _, _, a, k = labels[k]
        starts.append(a)
        b = a
    return starts[::-1]


class SplitFront:
    """Every split worth having for a table and its stage rules: the Pareto front of (max T, Σ T).

    :meth:`best` picks the split of least ``Σ T + weight · max T`` for any weight, so one front serves
    every micro-batch count that keeps the same rules. Up to :data:`LABEL_DP_MAX_PIECES` pieces the
    DP keeps the whole front per (stages, pieces) (exact); above, :class:`CapFront` finds the front's
    points one cap at a time (``method`` forces either: ``labels`` or ``caps``).
    """

    def __init__(self, table: CostTable, rules: Sequence[StageRule], *,
                 method: Literal["auto", "labels", "caps"] = "auto") -> None:
        check_request(table, rules, 0.0)
        if method not in ("auto", "labels", "caps"):
            raise PartitionError(f"unknown DP method {method!r}; choose auto, labels or caps")
        self.table, self.rules = table, tuple(rules)
        self._sums = PieceSums(table)
        labels = method == "labels" or (method == "auto" and self._sums.n <= LABEL_DP_MAX_PIECES)
        self._front = _fronts(self._sums, self.rules) if labels else None
        self._caps = None if labels else CapFront(self._sums, self.rules)

    @property
    def feasible(self) -> bool:
        """Whether some split fits the memory rules."""
        if self._caps is not None:
            return self._caps.point(float("inf")) is not None
        assert self._front is not None, "the label DP runs unless the cap DP does"
        return bool(self._front[len(self.rules)][self._sums.n])

    def best(self, weight: float) -> Partition:
        """The split of least ``Σ T_j + weight · max T_j``; PartitionError when none fits the memory."""
        if weight < 0:
            raise PartitionError(f"the weight of the slowest stage must be >= 0, got {weight}")
        starts: Sequence[int] | None = None
        if self._caps is not None:
            starts = self._caps.best(weight)
        else:
            assert self._front is not None, "the label DP runs unless the cap DP does"
            final = self._front[len(self.rules)][self._sums.n]
            if final:
                index = min(range(len(final)), key=lambda k: final[k][1] + weight * final[k][0])
                starts = _walk_back(self._front, len(self.rules), self._sums.n, index)
        if starts is None:
            raise _memory_error(self.table, self.rules)
        return partition_of(self.table, self._sums, self.rules, starts, weight)


def partition_pieces(table: CostTable, rules: Sequence[StageRule], *, weight: float) -> Partition:
    """The split points minimising ``Σ T_j + weight · max T_j`` over ``len(rules)`` stages (exact).

    ``rules[j]`` says whether stage j sends its output to another rank and what memory each of its
    copies may take. PartitionError when there are more stages than pieces, or when no split fits
    the memory (the message names how much more memory the best split needs).
    """
    check_request(table, rules, weight)
    return SplitFront(table, rules).best(weight)


def partition_pieces_dag(table: CostTable, rules: Sequence[StageRule], *, weight: float,
                         time_limit: float = 10.0, workers: int = 2) -> Partition:
    """The CP-SAT DAG partitioner (:func:`pipeloom.plan.partitioning.dag.partition_dag`) on the table's pieces:
    it minimises the slowest stage's compute, then the bytes crossing stages.

    It runs first without memory limits; when that split breaks a rule, again with its memory
    model, which has one size per piece and one limit for all stages: each piece counts with the
    largest held counts of any stage copy, under the smallest copy limit (safe, not exact). The
    result's ``split_points`` is None when a stage is not a run of pieces in call order.
    """
    check_request(table, rules, weight)
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
    return all(c.limit is None or c.bytes(*totals[j]) <= c.limit * (1 + TOLERANCE)
               for j, rule in enumerate(rules) for c in rule.copies)


def _dag_split(table: CostTable, rules: Sequence[StageRule], weight: float, memory: list[float] | None,
               limit: float | None, time_limit: float, workers: int) -> Partition:
    """One call of the DAG partitioner, its answer as a :class:`Partition`."""
    from pipeloom.plan.partitioning.dag import partition_dag

    found = partition_dag([p.time for p in table.pieces], list(table.edges), num_stages=len(rules),
                          out_bytes=[p.output_bytes for p in table.pieces], memory=memory, memory_limit=limit,
                          time_limit=time_limit, workers=workers)
    stage_of = tuple(found.stage_of)
    if all(stage_of[k] <= stage_of[k + 1] for k in range(len(stage_of) - 1)):
        starts = [stage_of.index(j) for j in range(len(rules))]
        return partition_of(table, PieceSums(table), rules, starts, weight, method="dag", status=found.status)
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


# ----------------------------------------------------------------------- what memory would fit


def smallest_memory_scale(table: CostTable, rules: Sequence[StageRule]) -> tuple[float, tuple[int, ...]]:
    """``(scale, starts)``: the smallest factor by which every copy's limit must grow for some split to
    fit (1 or less: it fits already), and that split's stage starts. A bottleneck DP over
    ``max_copies bytes / limit``; copies without a limit do not count."""
    check_request(table, rules, 0.0)
    sums = PieceSums(table)
    if sums.n > LABEL_DP_MAX_PIECES:
        return scale_by_bisection(sums, rules)
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


def _memory_error(table: CostTable, rules: Sequence[StageRule]) -> PartitionError:
    scale, _ = smallest_memory_scale(table, rules)
    limits = sorted({c.limit for rule in rules for c in rule.copies if c.limit})
    shown = ", ".join(f"{format_bytes(limit)} -> {format_bytes(limit * scale)}" for limit in limits[:3])
    return PartitionError(
        f"no split of the {len(table.pieces)} pieces into {len(rules)} stages fits the memory limits; the "
        f"best split needs {scale:.3g}x the memory ({shown}): raise the limit, or use more stages or ranks"
    )
