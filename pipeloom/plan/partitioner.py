"""Partitions for the placements and memory profiles of schedules: exact for one stage per rank,
a few good candidates when a rank holds several stages and shares its memory limit among them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeloom.ir import Schedule
from pipeloom.plan.costs import CostTable, format_bytes
from pipeloom.plan.partition import (
    DP_MAX_PIECES,
    Partition,
    PartitionError,
    SplitFront,
    StageRule,
    partition_pieces_dag,
    smallest_memory_scale,
)
from pipeloom.plan.placement import (
    PARTITION_PROFILES,
    Placement,
    ScheduleShape,
    library_schedule,
    rank_objective,
    schedule_shape,
    stage_rules,
)
from pipeloom.schedules import REGISTRY

__all__ = ["MemoryTooSmall", "SchedulePartitioner", "partition"]


class MemoryTooSmall(PartitionError):
    """No split fits the memory limit; ``smallest_limit`` is a per-rank limit that would."""

    def __init__(self, message: str, *, smallest_limit: float) -> None:
        super().__init__(message)
        self.smallest_limit = smallest_limit


class SchedulePartitioner:
    """Partitions for one cost table under the placements and memory profiles of schedules.

    One stage per rank: the rank's limit is the stage's (exact). Several stages per rank: the rank's
    limit is shared among them equally, and in proportion to their bytes in a guide split, then in
    the last split found (``rounds`` times); guides are the split that ignores the limit and a lean
    split (:meth:`_lean`). Each sharing gives the DP's best split under it (a heuristic: fast, not
    exact). Split fronts are cached by their rules, so schedules and micro-batch counts with the
    same memory profile share one DP.
    """

    def __init__(self, table: CostTable, *, method: Literal["auto", "dp", "dag"] = "auto",
                 time_limit: float = 10.0, rounds: int = 3) -> None:
        if method not in ("auto", "dp", "dag"):
            raise PartitionError(f"unknown method {method!r}; choose auto, dp or dag")
        self.table, self.rounds, self.time_limit = table, rounds, time_limit
        self.dag = method == "dag" or (method == "auto" and len(table.pieces) > DP_MAX_PIECES)
        self._fronts: dict[tuple[StageRule, ...], SplitFront] = {}
        self._leans: dict[ScheduleShape, tuple[float, list[int]]] = {}
        pieces = table.pieces
        self._sums = tuple(_prefix(values) for values in (
            [table.static_bytes(p) for p in pieces], [p.activation_bytes for p in pieces],
            [p.w_activation_bytes for p in pieces]))

    def _best(self, rules: tuple[StageRule, ...], weight: float) -> Partition | None:
        if self.dag:
            try:
                return partition_pieces_dag(self.table, rules, weight=weight, time_limit=self.time_limit)
            except PartitionError:
                return None
        front = self._fronts.get(rules)
        if front is None:
            front = self._fronts[rules] = SplitFront(self.table, rules)
        return front.best(weight) if front.feasible else None

    def partition(self, schedule: Schedule | ScheduleShape, *, memory_limit: float | None) -> Partition:
        """The split of least pipeline time for ``schedule`` whose memory rules fit ``memory_limit``
        bytes per rank: the best of :meth:`candidates` by :func:`rank_objective`."""
        shape = schedule if isinstance(schedule, ScheduleShape) else schedule_shape(schedule)
        return min(self.candidates(shape, memory_limit=memory_limit), key=lambda p: rank_objective(shape, p))

    def candidates(self, schedule: Schedule | ScheduleShape, *, memory_limit: float | None) -> list[Partition]:
        """Splits for ``schedule`` whose memory rules fit ``memory_limit`` bytes per rank, each the DP's
        best (weight: :func:`visits_per_rank` - 1) under one sharing of the ranks' limits; one split
        for one stage per rank (exact), a few otherwise, for the caller to judge (e.g. by simulation).
        PartitionError when the schedule has more stages than the table has pieces;
        :class:`MemoryTooSmall` saying what limit would fit."""
        shape = schedule if isinstance(schedule, ScheduleShape) else schedule_shape(schedule)
        if shape.num_model_stages > len(self.table.pieces):
            raise PartitionError(
                f"the schedule cuts the model into {shape.num_model_stages} stages, but the cost table has "
                f"{len(self.table.pieces)} pieces; use fewer ranks or stages per rank, or profile finer pieces"
            )
        weight = shape.visits - 1
        found = self._best(stage_rules(shape, memory_limit=memory_limit), weight)
        if memory_limit is None or len(set(shape.rank)) == shape.num_stages:
            if found is None:
                raise self._memory_error(shape, memory_limit)
            return [found]
        free = self._best(stage_rules(shape, memory_limit=None), weight)
        assert free is not None
        if max(self._rank_bytes(shape, _starts(free))) <= memory_limit * (1 + 1e-9):
            return [free]
        candidates = {found.stage_of: found} if found is not None else {}
        least, lean = self._lean(shape)
        for guide in [_starts(free)] + ([lean] if least <= memory_limit * (1 + 1e-9) else []):
            for _ in range(self.rounds):
                shares = self._shares(shape, guide)
                better = self._best(stage_rules(shape, memory_limit=memory_limit, shares=shares), weight)
                if better is None:
                    break
                candidates.setdefault(better.stage_of, better)
                guide = _starts(better)
        if not candidates:
            raise self._memory_error(shape, memory_limit)
        return list(candidates.values())

    def _copy_bytes(self, shape: ScheduleShape, starts: Sequence[int]) -> list[float]:
        """Per schedule stage: bytes of its copy when model stage j starts at ``starts[j]``."""
        static, activation, kept = self._sums
        bounds = [*starts, len(self.table.pieces)]
        result = []
        for s, j in enumerate(shape.model_stage):
            a, b = bounds[j], bounds[j + 1]
            held, w_held = shape.held[s]
            result.append(static[b] - static[a] + held * (activation[b] - activation[a] - kept[b] + kept[a])
                          + w_held * (kept[b] - kept[a]))
        return result

    def _rank_bytes(self, shape: ScheduleShape, starts: Sequence[int]) -> list[float]:
        totals = [0.0] * shape.num_ranks
        for s, nbytes in enumerate(self._copy_bytes(shape, starts)):
            totals[shape.rank[s]] += nbytes
        return totals

    def _shares(self, shape: ScheduleShape, starts: Sequence[int]) -> list[float]:
        """Each schedule stage's share of its rank's limit, in proportion to its bytes in the split."""
        held = self._copy_bytes(shape, starts)
        totals = [0.0] * shape.num_ranks
        for s, nbytes in enumerate(held):
            totals[shape.rank[s]] += nbytes
        return [held[s] / totals[r] if totals[r] > 0 else 1.0 / shape.stages_on(r) for s, r in enumerate(shape.rank)]

    def _lean(self, shape: ScheduleShape) -> tuple[float, list[int]]:
        """A split with little memory on its fullest rank, and that memory (cached per shape).

        Bottleneck DPs with the rank limits shared in proportion to the last split's bytes, then a
        local search shifting runs of consecutive split points by one piece while the ranks' bytes,
        sorted from the fullest, fall lexicographically. Exact for one stage per rank (the first DP already is)."""
        if shape in self._leans:
            return self._leans[shape]
        shares, best = None, None
        for _ in range(self.rounds):
            _, starts = smallest_memory_scale(self.table, stage_rules(shape, memory_limit=1.0, shares=shares))
            key = sorted(self._rank_bytes(shape, starts), reverse=True)
            if best is None or key < best[0]:
                best = (key, list(starts))
            shares = self._shares(shape, starts)
        key, starts = best
        moved = len(set(shape.rank)) < shape.num_stages
        while moved:
            moved = False
            for trial in _shifted(starts, len(self.table.pieces)):
                trial_key = sorted(self._rank_bytes(shape, trial), reverse=True)
                if trial_key < key:
                    key, starts, moved = trial_key, trial, True
        self._leans[shape] = (key[0], starts)
        return self._leans[shape]

    def smallest_limit(self, schedule: Schedule | ScheduleShape) -> float:
        """A per-rank limit under which :meth:`partition` finds a split for ``schedule``: the least one
        for one stage per rank, the fullest rank of :meth:`_lean`'s split otherwise."""
        shape = schedule if isinstance(schedule, ScheduleShape) else schedule_shape(schedule)
        return self._lean(shape)[0] * (1 + 1e-9)

    def _memory_error(self, shape: ScheduleShape, memory_limit: float | None) -> MemoryTooSmall:
        limit = self.smallest_limit(shape)
        return MemoryTooSmall(
            f"no split of the {len(self.table.pieces)} pieces into {shape.num_model_stages} stages on "
            f"{shape.num_ranks} ranks fits {format_bytes(memory_limit or 0)} per rank; the smallest limit "
            f"that fits is about {format_bytes(limit)}: raise the limit, or use more ranks or fewer "
            f"micro-batches in flight", smallest_limit=limit,
        )


def _prefix(values: Sequence[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def _shifted(starts: Sequence[int], n: int):
    """Every split made by moving split points j..k (1 <= j <= k) of ``starts`` one piece up or down."""
    bounds = [*starts, n]
    for j in range(1, len(starts)):
        for k in range(j, len(starts)):
            for step in (-1, 1):
                if bounds[j] + step > bounds[j - 1] and bounds[k] + step < bounds[k + 1]:
                    yield [b + step if j <= i <= k else b for i, b in enumerate(starts)]


def _starts(found: Partition) -> list[int]:
    """First piece of each stage of a contiguous partition."""
    return [found.stage_of.index(j) for j in range(found.num_stages)]


def partition(
    table: CostTable,
    *,
    num_ranks: int,
    placement: Placement = "linear",
    stages_per_rank: int = 2,
    microbatches: int = 1,
    memory_limit: float | None = None,
    method: Literal["auto", "dp", "dag"] = "auto",
    time_limit: float = 10.0,
) -> Partition:
    """Cut ``table`` for ``num_ranks`` ranks in a placement style, minimising the pipeline time.

    ``linear``: p stages, one per rank, memory as 1F1B holds it (p - r micro-batches on rank r).
    ``interleaved``: p·v stages (v = ``stages_per_rank``), stage s on rank s % p, memory as
    interleaved 1F1B. ``v``: 2p stages, rank r holds r and 2p-1-r, memory as ZB-V ordered for the
    table's costs (:func:`library_schedule`).
    ``memory_limit`` is bytes per rank. ``method``: ``dp`` (exact), ``dag`` (CP-SAT, for big
    tables), ``auto`` (DP up to :data:`DP_MAX_PIECES` pieces).
    """
    if placement not in PARTITION_PROFILES:
        raise PartitionError(f"unknown placement {placement!r}; choose one of: {', '.join(PARTITION_PROFILES)}")
    name = PARTITION_PROFILES[placement]
    options = {"stages_per_rank": stages_per_rank} if "stages_per_rank" in REGISTRY[name].options else {}
    try:
        schedule = library_schedule(table, name, num_ranks, microbatches, memory_limit=memory_limit, **options)
    except ValueError as error:
        raise PartitionError(str(error)) from None
    return SchedulePartitioner(table, method=method, time_limit=time_limit).partition(
        schedule, memory_limit=memory_limit)
