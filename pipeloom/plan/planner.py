"""The plan search: for every schedule, stages per rank and micro-batch count, cut the model, re-cost the
schedule with the cut's real stage costs, simulate it, and keep the fastest plan that fits the memory.

The simulator is the judge: each candidate's step time is the simulated makespan of the library
schedule's per-rank action order on a problem built from the cost table (seconds and bytes).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeloom.arithmetic import divisors
from pipeloom.errors import PipeloomError
from pipeloom.formatting import format_bytes
from pipeloom.ir import Schedule, save_schedule
from pipeloom.plan.costs.shared import shared_across_stages
from pipeloom.plan.costs.table import CostTable, table_for_size
from pipeloom.plan.errors import MemoryTooSmall, PartitionError, PlanArgumentError, PlanError
from pipeloom.plan.noise import expected_makespan
from pipeloom.plan.partitioning.partitioner import SchedulePartitioner, format_bytes_up
from pipeloom.plan.partitioning.rules import MEMORY_SLACK, Partition
from pipeloom.plan.partitioning.shape import (
    ScheduleShape,
    least_limit,
    library_schedule,
    schedule_shape,
    unbounded_limit,
)
from pipeloom.plan.plan import Plan, save_plan
from pipeloom.plan.recost import recost, replica_sync_time, shared_time, stage_spreads
from pipeloom.plan.refusals import check_request, nothing_fits, running_stats_pieces
from pipeloom.schedules import REGISTRY, build_schedule, schedule_names
from pipeloom.sim import Timeline, simulate

__all__ = ["MAX_PLAN_MICROBATCHES", "Candidate", "PlanResult", "plan_pipeline"]

logger = logging.getLogger(__name__)




@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One (schedule, options, micro-batch count) the search tried, and how it came out."""

    schedule: str
    """Schedule name (``search`` for a schedule found by :func:`pipeloom.search.search`)."""
    schedule_options: dict
    """Options of the built-in schedule, e.g. ``{"stages_per_rank": 2}``."""
    microbatches: int
    """Micro-batches per step."""
    microbatch_size: int
    """Samples per micro-batch."""
    step_time: float | None = None
    """Predicted seconds per step: the simulated makespan (with the table's runtime ``time_spread``
    or ``start_skew``, the mean over replays with varying action times and start delays:
    :func:`pipeloom.plan.noise.expected_makespan`), plus the
    replicas' gradient exchange for two-replica schedules (:func:`replica_sync_time`), plus the
    table's fixed runtime ``step_overhead``; None when no split fits."""
    peak_memory: float | None = None
    """Simulated peak bytes of the fullest rank; for a candidate no split fits, the least limit that would."""
    bubble_ratio: float | None = None
    """Simulated idle share."""
    split_points: tuple[str, ...] | None = None
    """Where model stages 1.. start."""
    reason: str = ""
    """Why the candidate does not fit ("" when it does)."""
    timeline: Timeline | None = field(default=None, repr=False, compare=False)
    """The simulated timeline (seconds, bytes)."""
    partition: Partition | None = field(default=None, repr=False, compare=False)
    """The split and its stage times."""
    data_parallel: int = 1
    """Replicas of the pipeline (:func:`pipeloom.plan.plan_mesh`); ``step_time`` includes their reduction."""

    @property
    def fits(self) -> bool:
        """Built, simulated and within the memory limit."""
        return self.step_time is not None and not self.reason

    def simulation(self) -> tuple[float, Timeline, Partition]:
        """``(step_time, timeline, partition)`` of a candidate that was cut and simulated (every fitting one)."""
        if self.step_time is None or self.timeline is None or self.partition is None:
            raise PlanError(f"candidate {self.label} was not simulated: {self.reason or 'no split'}")
        return self.step_time, self.timeline, self.partition

    @property
    def label(self) -> str:
        """``interleaved-1f1b (v=2)``-style name."""
        if "stages_per_rank" in self.schedule_options:
            return f"{self.schedule} (v={self.schedule_options['stages_per_rank']})"
        return self.schedule


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    """The best plan, its simulated timeline, and every candidate tried (best first)."""

    plan: Plan
    """The fastest candidate that fits, as a plan the runtime reads."""
    timeline: Timeline
    """Its simulated timeline (seconds and bytes)."""
    candidates: tuple[Candidate, ...]
    """Fitting candidates by step time, then the others."""
    seconds: float
    """Wall time of the search."""
    untried: int = 0
    """Candidates left untried because the search's ``deadline`` passed (0: every one was tried)."""

    @property
    def schedule(self) -> Schedule:
        """The best plan's schedule, re-costed with the plan's stage costs."""
        return self.timeline.schedule

    def save(self, path: str | Path) -> None:
        """Write the plan. Where the simulated action order is not what the engine builds from the
        plan's schedule name with default costs (a searched schedule, or a cost-aware generator such
        as ZB-V's list scheduler), that order goes next to the plan as ``<stem>.schedule.json`` and the
        plan names it (relative to the plan file), so the runtime runs exactly what was simulated."""
        path = Path(path)
        plan = self.plan
        if not _builds_same_order(plan, self.schedule):
            schedule_file = path.with_name(f"{path.stem}.schedule.json")
            save_schedule(self.schedule, schedule_file)
            plan = dataclasses.replace(plan, schedule=schedule_file.name, schedule_options={})
        save_plan(plan, path)


def _builds_same_order(plan: Plan, simulated: Schedule) -> bool:
    """Whether ``build_schedule(plan.schedule, ...)`` with default costs gives ``simulated``'s action order."""
    if plan.schedule not in REGISTRY:
        return False
    try:
        built = build_schedule(plan.schedule, plan.num_ranks, plan.microbatches, **plan.schedule_options)
    except (ValueError, PipeloomError):
        return False
    return [list(map(str, actions)) for actions in built.ranks] == \
        [list(map(str, actions)) for actions in simulated.ranks]


# ---------------------------------------------------------------------------------- the search


def _options(name: str, stages_per_rank: Sequence[int]) -> list[dict]:
    if "stages_per_rank" in REGISTRY[name].options:
        return [{"stages_per_rank": v} for v in stages_per_rank]
    return [{}]


MAX_PLAN_MICROBATCHES = 1024
"""Most micro-batches per step a plan considers: the default counts are the divisors of the global
batch up to this (found without counting to the batch), and a larger count asked for is refused.
Each candidate is simulated, and a step of more micro-batches than this has no bubble left to gain."""


class _Search:
    """The state of one :func:`plan_pipeline` call: inputs, and a partitioner per micro-batch size."""

    def __init__(self, tables: Sequence[CostTable], *, num_ranks: int, memory_limit: float | None) -> None:
        self.tables, self.num_ranks, self.memory_limit = tables, num_ranks, memory_limit
        self._partitioners: dict[int, SchedulePartitioner] = {}

    def partitioner(self, size: int) -> SchedulePartitioner:
        if size not in self._partitioners:
            self._partitioners[size] = SchedulePartitioner(table_for_size(self.tables, size))
        return self._partitioners[size]

    def candidate(self, name: str, options: dict, microbatches: int, size: int) -> Candidate:
        """Build, cut, re-cost and simulate one candidate; a failure becomes its ``reason``."""
        base = Candidate(schedule=name, schedule_options=options, microbatches=microbatches, microbatch_size=size)
        partitioner = self.partitioner(size)
        limit = self.memory_limit
        # a memory-aware schedule (ZB-V) orders its actions for a limit: try the plan's and its default; without a
        # limit its default and one it never reaches (as fast as any limit it never reaches: docs/plan.md)
        limits: tuple[float | None, ...] = (None,)
        if REGISTRY[name].memory_aware:
            limits = (limit, None) if limit is not None else (
                None, unbounded_limit(partitioner.table, self.num_ranks, microbatches))
        tried = [self._try(base, partitioner, library_limit=lim) for lim in limits]
        best = min(tried, key=_rank)
        if best.fits or limit is None:
            return best
        # nothing fits: say the least that an order built alike at any limit needs (the one built for the limit
        # changes with it), so that the need, passed back, fits: the order built without a limit, or the one built
        # for the generator's least memory (its need can be far below the other's: 2.4 GiB against 3.98 GiB)
        steady = [tried[-1]]
        if REGISTRY[name].memory_aware:
            steady.append(self._try(base, partitioner, library_limit=least_limit(partitioner.table, self.num_ranks)))
        return min(steady, key=_rank)

    def _try(self, base: Candidate, partitioner: SchedulePartitioner, *, library_limit: float | None
             ) -> Candidate:
        table, limit = partitioner.table, self.memory_limit
        stages = self.num_ranks * base.schedule_options.get("stages_per_rank", 1)
        if stages > len(table.pieces):  # refused before building a schedule of that many stages
            return dataclasses.replace(base, reason=f"too many stages: {stages} stages ({self.num_ranks} ranks x "
                                                    f"{stages // self.num_ranks} per rank) for {len(table.pieces)} "
                                                    "pieces")
        try:
            library = library_schedule(table, base.schedule, self.num_ranks, base.microbatches,
                                       memory_limit=library_limit, **base.schedule_options)
        except (ValueError, PipeloomError) as error:
            return dataclasses.replace(base, reason=f"not built: {error}")
        shape = schedule_shape(library)  # once: every split below is judged on it
        shown = running_stats_pieces(table)
        if shape.replicas > 1 and shown:  # the replicas would update them apart (the runtime refuses it), any split
            return dataclasses.replace(base, reason=f"piece(s) {shown} update running statistics (BatchNorm) "
                                                    "in training: they need a one-replica schedule")
        try:
            splits = partitioner.candidates(shape, memory_limit=limit)
        except MemoryTooSmall as error:
            return dataclasses.replace(base, peak_memory=error.smallest_limit,
                                       reason=f"no split fits; needs about {format_bytes_up(error.smallest_limit)}")
        except PartitionError as error:
            return dataclasses.replace(base, reason=f"too many stages: {error}")
        return min((self._simulated(base, table, library, shape, found) for found in splits), key=_rank)

    def _simulated(self, base: Candidate, table: CostTable, library: Schedule, shape: ScheduleShape,
                   found: Partition) -> Candidate:
        """``base`` with ``library``'s order (of shape ``shape``) re-costed for the split ``found`` and simulated."""
        limit = self.memory_limit
        if shape.replicas > 1 and shared_across_stages(table, found.stage_of):
            names = ", ".join(p.name for p in shared_across_stages(table, found.stage_of))
            return dataclasses.replace(base, reason=f"shared parameter(s) {names} on several stages need a "
                                                    "one-replica schedule")
        costed = dataclasses.replace(library, problem=recost(library, table, found, memory_limit=limit, shape=shape))
        timeline = simulate(costed)
        runtime = table.runtime
        makespan = timeline.makespan
        if runtime.time_spread or runtime.start_skew:
            spreads = stage_spreads(table, library, found, shape=shape)
            makespan = expected_makespan(costed, spreads, start_skew=runtime.start_skew)
        peak = max(timeline.peak_memory)
        reason = ("" if limit is None or peak <= limit * MEMORY_SLACK
                  else f"peak {format_bytes(peak)} > {format_bytes(limit)}")
        return dataclasses.replace(
            base, step_time=(makespan + replica_sync_time(table, library, found, shape=shape)
                             + shared_time(table, library, found, shape=shape) + runtime.step_overhead),
            peak_memory=peak,
            bubble_ratio=timeline.bubble_ratio, split_points=found.split_points, timeline=timeline,
            partition=found, reason=reason,
        )


def plan_pipeline(
    table: CostTable | Sequence[CostTable],
    *,
    num_ranks: int,
    global_batch: int,
    memory_limit: float | None = None,
    schedules: Sequence[str] | None = None,
    stages_per_rank: Sequence[int] = (2,),
    microbatches: Sequence[int] | None = None,
    search_time: float = 0.0,
    search_top: int = 2,
    progress: Callable[[str], None] | None = None,
    deadline: float | None = None,
) -> PlanResult:
    """The fastest pipeline plan for ``table`` on ``num_ranks`` ranks of ``memory_limit`` bytes each (None: no
    limit; the memory-aware schedules then order for their own default memory, see :func:`library_schedule`).

    Tries every schedule of ``schedules`` (default: every built-in one,
    :func:`pipeloom.schedules.schedule_names`), with each of ``stages_per_rank`` for the looped ones, and every
    micro-batch count M of ``microbatches`` (default: the divisors of ``global_batch`` up to
    :data:`MAX_PLAN_MICROBATCHES`; micro-batch size = global_batch / M). ``table`` may
    be several tables of one model measured at different micro-batch sizes (:func:`table_for_size`
    interpolates between them; one table is scaled linearly). Each candidate is cut by the
    partitioner for the schedule's placement and memory profile, re-costed (:func:`recost`) and
    simulated. With ``search_time`` > 0, :func:`pipeloom.search.search` then looks for a faster
    order of the ``search_top`` best candidates' re-costed task graphs, that many seconds in all; a
    better one joins as schedule ``search`` (:meth:`PlanResult.save` writes it next to the plan).
    :class:`NoPlanFits` when nothing fits: it names the smallest per-rank limit that would, or why
    nothing could be built. ``progress``, when given, is called with a short line before each candidate.
    ``deadline`` (a ``time.perf_counter()`` value; None: none): once it has passed, the candidates not yet
    tried are left out (after the first, so there is an answer) and counted in :attr:`PlanResult.untried`;
    they come in micro-batch counts from the smallest up.
    """
    started = time.perf_counter()
    tables = [table] if isinstance(table, CostTable) else list(table)
    table = table_for_size(tables, tables[0].microbatch_size if tables else 1)  # checks they match
    check_request(table, num_ranks, global_batch, memory_limit, schedules)
    counts = _microbatch_counts(microbatches, global_batch)
    search = _Search(tables, num_ranks=num_ranks, memory_limit=memory_limit)
    jobs = [(name, options, m) for m in counts for name in (schedules or schedule_names())
            for options in _options(name, stages_per_rank)]
    logger.info("planning %d pieces on %d ranks: %d candidates (schedules x micro-batch counts)",
                len(table.pieces), num_ranks, len(jobs))
    tried: list[Candidate] = []
    untried = 0
    for k, (name, options, m) in enumerate(jobs):
        if deadline is not None and tried and time.perf_counter() > deadline:
            untried = len(jobs) - k
            logger.info("time limit reached: %d of %d candidates left untried", untried, len(jobs))
            break
        if progress is not None:
            progress(f"{name} with {m} micro-batches ({k + 1} of {len(jobs)})")
        tried.append(search.candidate(name, options, m, global_batch // m))
        _log_candidate(tried[-1])
    ranked = sorted(tried, key=_rank)
    if search_time > 0:
        top = [c for c in ranked if c.fits][:search_top]
        ranked = sorted(ranked + [found for c in top if (found := _searched(
            c, search_time / len(top), memory_limit, table_for_size(tables, c.microbatch_size))) is not None],
            key=_rank)
    best = ranked[0]
    if not best.fits:
        raise nothing_fits(table, num_ranks, memory_limit, ranked)
    step_time, timeline, partition = best.simulation()
    logger.info("best plan: %s, %d micro-batches of %d: step %.4g s, peak %s (%d of %d candidates fit, %.1f s)",
                best.label, best.microbatches, best.microbatch_size, step_time, format_bytes(max(timeline.peak_memory)),
                sum(c.fits for c in ranked), len(ranked), time.perf_counter() - started)
    plan = Plan(
        num_ranks=num_ranks, split_points=best.split_points or (), schedule=best.schedule,
        schedule_options=best.schedule_options, microbatches=best.microbatches, global_batch=global_batch,
        predicted_step_time=step_time, peak_memory=timeline.peak_memory, memory_limit=memory_limit,
        bubble_ratio=best.bubble_ratio, stage_times=partition.stage_times, device=table.device,
    )
    return PlanResult(plan=plan, timeline=timeline, candidates=tuple(ranked),
                      seconds=time.perf_counter() - started, untried=untried)


def _microbatch_counts(microbatches: Sequence[int] | None, global_batch: int) -> list[int]:
    """The micro-batch counts to try (given, or every divisor of the global batch), checked."""
    counts = sorted(set(microbatches)) if microbatches is not None else divisors(global_batch, MAX_PLAN_MICROBATCHES)
    for m in counts:
        if isinstance(m, int) and not isinstance(m, bool) and m > MAX_PLAN_MICROBATCHES:
            raise PlanArgumentError(f"{m} micro-batches per step is more than the planner considers "
                            f"({MAX_PLAN_MICROBATCHES}); choose at most {MAX_PLAN_MICROBATCHES}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or global_batch % m:
            raise PlanArgumentError(f"micro-batch count {m!r} does not divide the global batch {global_batch}; "
                            f"choose among {divisors(global_batch, MAX_PLAN_MICROBATCHES)}")
    return counts


def _searched(candidate: Candidate, seconds: float, memory_limit: float | None,
              table: CostTable) -> Candidate | None:
    """The CP-SAT search's schedule for ``candidate``'s re-costed task graph, when it is faster
    (both predicted with ``table``'s time spread and start skew)."""
    from pipeloom.search import search

    step_time, simulated, partition = candidate.simulation()
    schedule = simulated.schedule
    spread = stage_spreads(table, schedule, partition)
    try:
        result = search(schedule.problem, schedule.num_microbatches, time_limit=seconds, memory_limit=memory_limit,
                        name="search")
    except PipeloomError as error:
        logger.info("search for %s found no schedule: %s", candidate.label, error)
        return None
    timeline = simulate(result.schedule)
    makespan = (expected_makespan(result.schedule, spread, start_skew=table.runtime.start_skew)
                if any(spread) or table.runtime.start_skew else timeline.makespan)
    # the same replica exchange and step overhead as the candidate's
    step = (makespan + replica_sync_time(table, schedule, partition)
            + shared_time(table, schedule, partition) + table.runtime.step_overhead)
    if step >= step_time * (1 - 1e-9):
        logger.info("search for %s: step %.4g s, not faster than %.4g s", candidate.label, step, step_time)
        return None
    if memory_limit is not None and max(timeline.peak_memory) > memory_limit * MEMORY_SLACK:
        logger.info("search for %s: peak %s over the limit", candidate.label, format_bytes(max(timeline.peak_memory)))
        return None  # the simulator is the judge of memory too
    logger.info("search for %s: step %.4g s, faster than %.4g s", candidate.label, step, step_time)
    return dataclasses.replace(candidate, schedule="search", schedule_options={}, step_time=step,
                               peak_memory=max(timeline.peak_memory), bubble_ratio=timeline.bubble_ratio,
                               timeline=timeline, reason="")


def _log_candidate(candidate: Candidate) -> None:
    """One DEBUG line per candidate: its step time and peak, or why it does not fit."""
    if candidate.fits:
        logger.debug("%s, %d micro-batches of %d: step %.4g s, peak %s", candidate.label, candidate.microbatches,
                     candidate.microbatch_size, candidate.step_time, format_bytes(candidate.peak_memory or 0.0))
    else:
        logger.debug("%s, %d micro-batches of %d: %s", candidate.label, candidate.microbatches,
                     candidate.microbatch_size, candidate.reason or "not simulated")


def _rank(candidate: Candidate) -> tuple:
    """Fitting candidates first by step time (ties: less memory), then the others by the memory they need."""
    if candidate.fits:
        return (0, candidate.step_time, candidate.peak_memory, candidate.microbatches)
    need = candidate.peak_memory if candidate.peak_memory is not None else float("inf")
    return (1, need, 0.0, candidate.microbatches)
