"""Cut a cost table's pieces into pipeline stages: an exact dynamic program over split points.

Stage j holds the pieces ``starts[j] .. starts[j+1]-1`` (call order, as the runtime cuts). Its time
``T_j`` is the pieces' F + I + W plus, when its output goes to another rank, the link time of the
bytes leaving it. The objective is the pipeline time of Alpa's stage slicing,

    Σ_j T_j + weight · max_j T_j        (weight = N - 1, N = stage visits per rank and step),

subject to every copy of every stage fitting its memory limit (:class:`MemoryRule`). The DP keeps,
per (stages used, pieces used), the Pareto front of (max T, Σ T), so one run serves every weight.
Very large tables go to the CP-SAT DAG partitioner (:mod:`pipeloom.plan.dag`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipeloom.plan.costs import CostTable, format_bytes
from pipeloom.plan.plan import PartitionError

__all__ = [
    "DP_MAX_PIECES",
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
    "with_weight",
]

DP_MAX_PIECES = 300
"""``method="auto"`` runs the DP up to this many pieces (O(S·n²) labels, about a second at 300 pieces
and 16 stages) and the CP-SAT DAG partitioner above."""

_TOLERANCE = 1e-9


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

    :meth:`best` picks the split of least ``Σ T + weight · max T`` for any weight, so one DP serves
    every micro-batch count that keeps the same rules.
    """

    def __init__(self, table: CostTable, rules: Sequence[StageRule]) -> None:
        _check_request(table, rules, 0.0)
        self.table, self.rules = table, tuple(rules)
        self._sums = _Sums(table)
        self._front = _fronts(self._sums, self.rules)

    @property
    def feasible(self) -> bool:
        """Whether some split fits the memory rules."""
        return bool(self._front[len(self.rules)][self._sums.n])

    def best(self, weight: float) -> Partition:
        """The split of least ``Σ T_j + weight · max T_j``; PartitionError when none fits the memory."""
        if weight < 0:
            raise PartitionError(f"the weight of the slowest stage must be >= 0, got {weight}")
        final = self._front[len(self.rules)][self._sums.n]
        if not final:
            raise _memory_error(self.table, self.rules)
        index = min(range(len(final)), key=lambda k: final[k][1] + weight * final[k][0])
        starts = _walk_back(self._front, len(self.rules), self._sums.n, index)
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


# ----------------------------------------------------------------------- what memory would fit


def smallest_memory_scale(table: CostTable, rules: Sequence[StageRule]) -> tuple[float, tuple[int, ...]]:
    """``(scale, starts)``: the smallest factor by which every copy's limit must grow for some split to
    fit (1 or less: it fits already), and that split's stage starts. A bottleneck DP over
    ``max_copies bytes / limit``; copies without a limit do not count."""
    _check_request(table, rules, 0.0)
    sums = _Sums(table)
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


def with_weight(partition: Partition, weight: float) -> Partition:
    """The same split judged with another weight of the slowest stage."""
    return dataclasses.replace(partition, weight=weight, objective=objective(partition.stage_times, weight))
