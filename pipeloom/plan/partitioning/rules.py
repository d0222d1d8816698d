"""What the partitioner works on: the memory and stage rules, the :class:`Partition` it returns, and
prefix sums that give any run of pieces its time and bytes in O(1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import PartitionError

__all__ = ["MEMORY_SLACK", "TOLERANCE", "MemoryRule", "Partition", "PieceSums", "StageRule", "check_request",
           "objective", "partition_of", "prefix_sums", "segment_memory", "segment_time", "split_partition",
           "split_times", "with_weight"]

TOLERANCE = 1e-9
"""Relative slack on memory limits and on equal sums of stage times."""


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


class PieceSums:
    """Prefix sums of a table for O(1) segment costs; ``crossing(a, b)``: bytes leaving pieces a..b-1."""

    def __init__(self, table: CostTable) -> None:
        pieces = table.pieces
        self.n = len(pieces)
        self.link = table.link
        self.time = prefix_sums(p.time for p in pieces)
        self.static = prefix_sums(table.static_bytes(p) for p in pieces)
        self.activation = prefix_sums(p.activation_bytes for p in pieces)
        self.w_activation = prefix_sums(p.w_activation_bytes for p in pieces)
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
        return all(c.limit is None or self.nbytes(a, b, c) <= c.limit * (1 + TOLERANCE) for c in rule.copies)


MEMORY_SLACK = 1 + 1e-9
"""A memory use fits a limit when it is at most ``limit * MEMORY_SLACK`` (float rounding of sums)."""


def prefix_sums(values: Iterable[float]) -> list[float]:
    """``[0, v0, v0 + v1, ...]``: any run's sum in O(1)."""
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def segment_time(table: CostTable, first: int, stop: int, *, sends: bool = True) -> float:
    """Time of a stage holding pieces ``first .. stop-1``: their F + I + W, plus the link time of the
    bytes they pass to pieces at or after ``stop`` when ``sends``."""
    return PieceSums(table).seconds(first, stop, sends)


def segment_memory(table: CostTable, first: int, stop: int, rule: MemoryRule) -> float:
    """Bytes of one copy of a stage holding pieces ``first .. stop-1`` under ``rule``."""
    return PieceSums(table).nbytes(first, stop, rule)


def objective(stage_times: Sequence[float], weight: float) -> float:
    """``Σ T_j + weight · max T_j``, the pipeline-time objective."""
    return sum(stage_times) + weight * max(stage_times)


def check_request(table: CostTable, rules: Sequence[StageRule], weight: float) -> None:
    if not rules:
        raise PartitionError("give at least one stage rule (one per stage)")
    if weight < 0:
        raise PartitionError(f"the weight of the slowest stage must be >= 0, got {weight}")
    if len(rules) > len(table.pieces):
        raise PartitionError(
            f"{len(rules)} stages need at least {len(rules)} pieces, but the cost table has "
            f"{len(table.pieces)}; use at most {len(table.pieces)} stages or profile finer pieces"
        )


def partition_of(table: CostTable, sums: PieceSums, rules: Sequence[StageRule], starts: Sequence[int],
            weight: float, *, method: Literal["dp", "dag"] = "dp", status: str = "optimal") -> Partition:
    bounds = [*starts, sums.n]
    times = tuple(sums.seconds(bounds[j], bounds[j + 1], rules[j].sends) for j in range(len(rules)))
    memory = tuple(max(sums.nbytes(bounds[j], bounds[j + 1], c) for c in rules[j].copies)
                   for j in range(len(rules)))
    stage_of = tuple(j for j in range(len(rules)) for _ in range(bounds[j], bounds[j + 1]))
    return Partition(stage_of=stage_of, split_points=tuple(table.pieces[a].name for a in starts[1:]),
                     stage_times=times, stage_memory=memory, objective=objective(times, weight),
                     weight=weight, method=method, status=status)


def split_partition(table: CostTable, rules: Sequence[StageRule], starts: Sequence[int], *,
                    weight: float) -> Partition:
    """The :class:`Partition` whose stage j starts at piece ``starts[j]`` (``starts[0] == 0``), judged
    with ``weight`` under ``rules`` (memory is reported, not checked)."""
    check_request(table, rules, weight)
    n = len(table.pieces)
    if len(starts) != len(rules) or starts[0] != 0 or any(b <= a for a, b in zip(starts, [*starts[1:], n])):
        raise PartitionError(f"stage starts {list(starts)} must begin at 0 and rise to at most {n - 1}, one per rule")
    return partition_of(table, PieceSums(table), rules, starts, weight)


def split_times(table: CostTable, rules: Sequence[StageRule]) -> Callable[[Sequence[int]], tuple[float, ...]]:
    """A function from stage starts to stage times under ``rules`` (prefix sums built once)."""
    sums, sends = PieceSums(table), [rule.sends for rule in rules]

    def times(starts: Sequence[int]) -> tuple[float, ...]:
        bounds = [*starts, sums.n]
        return tuple(sums.seconds(bounds[j], bounds[j + 1], sends[j]) for j in range(len(sends)))

    return times


def with_weight(partition: Partition, weight: float) -> Partition:
    """The same split judged with another weight of the slowest stage."""
    return dataclasses.replace(partition, weight=weight, objective=objective(partition.stage_times, weight))
