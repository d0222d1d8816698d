"""Partitions for the placements and memory profiles of schedules: exact for one stage per rank,
a few good candidates when a rank holds several stages and shares its memory limit among them."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from pipeloom.formatting import format_bytes
from pipeloom.ir import Schedule
from pipeloom.plan.costs.parts import parse_bytes
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import MemoryTooSmall, PartitionError
from pipeloom.plan.partitioning.chain import SplitFront, partition_pieces_dag, smallest_memory_scale
from pipeloom.plan.partitioning.rules import (
    MEMORY_SLACK,
    MemoryRule,
    Partition,
    StageRule,
    prefix_sums,
    split_partition,
    split_times,
)
from pipeloom.plan.partitioning.shape import (
    PARTITION_PROFILES,
    PartitionPlacement,
    ScheduleShape,
    library_schedule,
    rank_objective,
    rank_time_objective,
    schedule_shape,
    stage_rules,
)
from pipeloom.schedules import REGISTRY

__all__ = ["SchedulePartitioner", "format_bytes_up", "partition"]


logger = logging.getLogger(__name__)


class SchedulePartitioner:
    """Partitions for one cost table under the placements and memory profiles of schedules.

    One stage per rank: the rank's limit is the stage's (exact). Several stages per rank: the rank's
    limit is shared among them equally, and in proportion to their bytes in a guide split, then in
    the last split found (``rounds`` times); guides are the split that ignores the limit and a lean
    split (:meth:`_lean`). Each sharing gives the DP's best split under it (a heuristic: fast, not
    exact). Whatever the limit, the *seeds* (:meth:`_seeds`: the lean split and the leanest split
    under each fixed sharing) are tried too, so a limit fits exactly when it is at least
    :meth:`smallest_limit`, and more memory never fails. Two-replica schedules also get the split
    that is best by the rank's load (:meth:`_by_rank_load`). Split fronts are cached by their rules,
    so schedules and micro-batch counts with the same memory profile share one DP.
    """

    def __init__(self, table: CostTable, *, method: Literal["auto", "dp", "dag"] = "auto",
                 time_limit: float = 10.0, rounds: int = 3, exhaustive: int = 5000) -> None:
        if method not in ("auto", "dp", "dag"):
            raise PartitionError(f"unknown method {method!r}; choose auto, dp or dag")
        self.table, self.rounds, self.time_limit, self.exhaustive = table, rounds, time_limit, exhaustive
        self.dag = method == "dag"
        self._fronts: dict[tuple[StageRule, ...], SplitFront] = {}
        self._leans: dict[ScheduleShape, tuple[float, list[int]]] = {}
        self._seeded: dict[ScheduleShape, list[tuple[float, tuple[int, ...]]]] = {}
        pieces = table.pieces
        self._sums = tuple(prefix_sums(values) for values in (
            [table.static_bytes(p) for p in pieces], [p.activation_bytes for p in pieces],
            [p.w_activation_bytes for p in pieces]))

    def _best(self, rules: tuple[StageRule, ...], weight: float) -> Partition | None:
        if self.dag:
            try:
                return partition_pieces_dag(self.table, rules, weight=weight, time_limit=self.time_limit)
            except PartitionError:
                return None
        key = tuple(StageRule(sends=r.sends, copies=tuple(MemoryRule() if c.limit is None else c for c in r.copies))
                    for r in rules)  # without a limit, the held counts change nothing but the memory shown
        front = self._fronts.get(key)
        if front is None:
            front = self._fronts[key] = SplitFront(self.table, key)
        if not front.feasible:
            return None
        found = front.best(weight)
        return found if key == rules else split_partition(self.table, rules, _starts(found), weight=weight)

    def partition(self, schedule: Schedule | ScheduleShape, *, memory_limit: float | None) -> Partition:
        """The split of least pipeline time for ``schedule`` whose memory rules fit ``memory_limit``
        bytes per rank: the best of :meth:`candidates` by :func:`rank_objective`."""
        shape = schedule if isinstance(schedule, ScheduleShape) else schedule_shape(schedule)
        return min(self.candidates(shape, memory_limit=memory_limit), key=lambda p: rank_objective(shape, p))

    def candidates(self, schedule: Schedule | ScheduleShape, *, memory_limit: float | None) -> list[Partition]:
        """Splits for ``schedule`` whose memory rules fit ``memory_limit`` bytes per rank, each the DP's
        best (weight: :func:`visits_per_rank` - 1) under one sharing of the ranks' limits, the seeds
        that fit, and for two replicas the best by rank load; one split for one stage per rank (exact),
        a few otherwise, for the caller to judge (e.g. by simulation).
        PartitionError when the schedule has more stages than the table has pieces;
        :class:`MemoryTooSmall` below :meth:`smallest_limit`."""
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
            return self._logged(shape, self._with_rank_load(shape, {found.stage_of: found}, memory_limit))
        if memory_limit < self.smallest_limit(shape) / MEMORY_SLACK:
            raise self._memory_error(shape, memory_limit)
        candidates = {found.stage_of: found} if found is not None else {}
        free = self._best(stage_rules(shape, memory_limit=None), weight)
        assert free is not None
        rules = stage_rules(shape, memory_limit=memory_limit)
        for nbytes, starts in [(max(self._rank_bytes(shape, _starts(free))), _starts(free)), *self._seeds(shape)]:
            if nbytes <= memory_limit * MEMORY_SLACK:
                split = split_partition(self.table, rules, starts, weight=weight)
                candidates.setdefault(split.stage_of, split)
        least, lean = self._lean(shape)
        for guide in [_starts(free)] + ([lean] if least <= memory_limit * MEMORY_SLACK else []):
            for _ in range(self.rounds):
                shares = self._shares(shape, guide)
                better = self._best(stage_rules(shape, memory_limit=memory_limit, shares=shares), weight)
                if better is None:
                    break
                candidates.setdefault(better.stage_of, better)
                guide = _starts(better)
        return self._logged(shape, self._with_rank_load(shape, candidates, memory_limit))

    @staticmethod
    def _logged(shape: ScheduleShape, splits: list[Partition]) -> list[Partition]:
        """``splits``, with one DEBUG line saying how many there are and the best objective among them."""
        logger.debug("%d split(s) of %d model stages on %d ranks; best objective %.4g s", len(splits),
                     shape.num_model_stages, shape.num_ranks, min((s.objective for s in splits), default=float("nan")))
        return splits

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
        shares = None
        best: tuple[list[float], list[int]] | None = None
        for _ in range(self.rounds):
            _, split = smallest_memory_scale(self.table, stage_rules(shape, memory_limit=1.0, shares=shares))
            key = sorted(self._rank_bytes(shape, split), reverse=True)
            if best is None or key < best[0]:
                best = (key, list(split))
            shares = self._shares(shape, split)
        assert best is not None, "rounds >= 1"
        key, starts = best
        step = max(1, len(self.table.pieces) // (4 * len(starts))) if len(set(shape.rank)) < shape.num_stages else 0
        while step >= 1:  # runs of split points move by step pieces, then by half as many, down to 1
            moved = True
            while moved:
                moved = False
                for trial in _shifted(starts, len(self.table.pieces), step):
                    trial_key = sorted(self._rank_bytes(shape, trial), reverse=True)
                    if trial_key < key:
                        key, starts, moved = trial_key, trial, True
            step //= 2
        self._leans[shape] = (key[0], starts)
        return self._leans[shape]

    def _seeds(self, shape: ScheduleShape) -> list[tuple[float, tuple[int, ...]]]:
        """``(bytes of the fullest rank, starts)`` of splits that do not depend on the limit (cached per
        shape): the lean split, and the leanest split (a bottleneck DP) with the ranks' limits shared
        equally, and in proportion to the bytes of the split that ignores the limit and of the lean split."""
        if shape not in self._seeded:
            least, lean = self._lean(shape)
            found = [(least, tuple(lean))]
            free = self._best(stage_rules(shape, memory_limit=None), shape.visits - 1)
            assert free is not None
            for shares in (None, self._shares(shape, _starts(free)), self._shares(shape, lean)):
                _, starts = smallest_memory_scale(self.table, stage_rules(shape, memory_limit=1.0, shares=shares))
                found.append((max(self._rank_bytes(shape, starts)), tuple(starts)))
            self._seeded[shape] = found
        return self._seeded[shape]

    def smallest_limit(self, schedule: Schedule | ScheduleShape) -> float:
        """The least per-rank limit under which :meth:`candidates` finds a split for ``schedule``, exact
        for the splits it considers: the bottleneck DP's for one stage per rank (exact), the leanest
        seed (:meth:`_seeds`) otherwise. :meth:`candidates` fits at this limit and fails below it."""
        shape = schedule if isinstance(schedule, ScheduleShape) else schedule_shape(schedule)
        if len(set(shape.rank)) == shape.num_stages:
            return self._lean(shape)[0]
        return min(nbytes for nbytes, _ in self._seeds(shape))

    def _memory_error(self, shape: ScheduleShape, memory_limit: float | None) -> MemoryTooSmall:
        limit = self.smallest_limit(shape)
        return MemoryTooSmall(
            f"no split of the {len(self.table.pieces)} pieces into {shape.num_model_stages} stages on "
            f"{shape.num_ranks} ranks fits {format_bytes(memory_limit or 0)} per rank; the smallest limit "
            f"that fits is about {format_bytes_up(limit)} (rounded up): raise the limit, or use more ranks or "
            f"fewer micro-batches in flight", smallest_limit=limit,
        )

    def _with_rank_load(self, shape: ScheduleShape, candidates: dict[tuple[int, ...], Partition],
                        memory_limit: float | None) -> list[Partition]:
        """``candidates``, and for two replicas the split of least :func:`rank_objective` that fits:
        by enumeration up to ``exhaustive`` splits, else by local search from each candidate."""
        if shape.replicas != 2:
            return list(candidates.values())
        rules = stage_rules(shape, memory_limit=memory_limit)
        times = split_times(self.table, rules)

        def cost(starts: Sequence[int]) -> float:
            if memory_limit is not None and max(self._rank_bytes(shape, starts)) > memory_limit * MEMORY_SLACK:
                return float("inf")
            return rank_time_objective(shape, times(starts))

        n, count = len(self.table.pieces), shape.num_model_stages
        if math.comb(n - 1, count - 1) <= self.exhaustive:
            best = min(((0, *cuts) for cuts in itertools.combinations(range(1, n), count - 1)), key=cost)
        else:
            best = min((_descend(_starts(p), n, cost) for p in candidates.values()), key=cost)
        if cost(best) < float("inf"):
            split = split_partition(self.table, rules, best, weight=shape.visits - 1)
            candidates.setdefault(split.stage_of, split)
        return list(candidates.values())


def format_bytes_up(nbytes: float) -> str:
    """:func:`format_bytes`, rounded up at its last digit: a size that, read back, is at least ``nbytes``."""
    value, unit = float(nbytes), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    if unit == "B":
        return f"{math.ceil(value):.0f} B"
    step = 10.0 ** (math.floor(math.log10(value)) - 2) if value > 0 else 1.0
    decimals = max(0, -round(math.log10(step)))
    shown = math.ceil(value / step - 1e-12) * step
    for number in (shown, shown + step):  # the second when the decimal text fell a hair below
        digits = f"{number:.{decimals}f}"
        text = f"{digits.rstrip('0').rstrip('.') if '.' in digits else digits} {unit}"
        if parse_bytes(text) >= nbytes:
            return text
    return text


def _descend(starts: Sequence[int], n: int, cost: Callable[[Sequence[int]], float]) -> tuple[int, ...]:
    """Local search: move one split point by ±step while ``cost`` falls, halving the step down to 1."""
    best, value = list(starts), cost(starts)
    step = max(1, n // (4 * len(starts)))
    while step >= 1:
        moved = True
        while moved:
            moved = False
            for j in range(1, len(best)):
                for delta in (-step, step):
                    trial = best.copy()
                    trial[j] += delta
                    upper = trial[j + 1] if j + 1 < len(trial) else n
                    if trial[j - 1] < trial[j] < upper and (c := cost(trial)) < value:
                        best, value, moved = trial, c, True
        step //= 2
    return tuple(best)


def _shifted(starts: Sequence[int], n: int, step: int = 1) -> Iterator[list[int]]:
    """Every split made by moving split points j..k (1 <= j <= k) of ``starts`` ``step`` pieces up or down."""
    bounds = [*starts, n]
    for j in range(1, len(starts)):
        for k in range(j, len(starts)):
            for move in (-step, step):
                if bounds[j] + move > bounds[j - 1] and bounds[k] + move < bounds[k + 1]:
                    yield [b + move if j <= i <= k else b for i, b in enumerate(starts)]


def _starts(found: Partition) -> list[int]:
    """First piece of each stage of a contiguous partition."""
    return [found.stage_of.index(j) for j in range(found.num_stages)]


def partition(
    table: CostTable,
    *,
    num_ranks: int,
    placement: PartitionPlacement = "linear",
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
    ``memory_limit`` is bytes per rank. ``method``: ``auto`` or ``dp``, the chain DP over split points
    in call order (:class:`~pipeloom.plan.partitioning.chain.SplitFront`, any size); ``dag``, the CP-SAT DAG
    partitioner, whose stages may not be runs in call order (then ``split_points`` is None and the
    runtime cannot cut it).
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
