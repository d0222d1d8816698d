"""The plan search: for every schedule, stages per rank and micro-batch count, cut the model, re-cost the
schedule with the cut's real stage costs, simulate it, and keep the fastest plan that fits the memory.

The simulator is the judge: each candidate's step time is the simulated makespan of the library
schedule's per-rank action order on a problem built from the cost table (seconds and bytes).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeloom.errors import PipeloomError
from pipeloom.ir import Schedule, save_schedule
from pipeloom.plan.costs import CostTable, Link, format_bytes, table_for_size
from pipeloom.plan.noise import expected_makespan
from pipeloom.plan.partition import Partition, PartitionError
from pipeloom.plan.partitioner import MemoryTooSmall, SchedulePartitioner, format_bytes_up
from pipeloom.plan.plan import Plan, PlanError, save_plan
from pipeloom.plan.shape import ScheduleShape, library_schedule, schedule_shape
from pipeloom.plan.shared import shared_across_stages, shared_static_bytes, shared_sync_time
from pipeloom.problem import Problem, Stage, stage_graph
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.sim import Timeline, simulate

__all__ = ["MAX_PLAN_MICROBATCHES", "Candidate", "default_schedules", "NoPlanFits", "PlanResult", "exchange_time",
           "plan_pipeline", "recost", "replica_sync_time", "stage_spreads"]

def default_schedules() -> tuple[str, ...]:
    """The schedules :func:`plan_pipeline` tries unless told otherwise: every registry entry, read at
    call time (a new entry is tried with no other edit)."""
    return tuple(REGISTRY)

_FIT = 1 + 1e-9  # float slack on the memory limit


class NoPlanFits(PlanError):
    """No candidate fits the request; ``smallest_limit`` is a per-rank limit under which one does
    (None when nothing could be built at all)."""

    def __init__(self, message: str, *, smallest_limit: float | None) -> None:
        super().__init__(message)
        self.smallest_limit = smallest_limit


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


# ----------------------------------------------------------------------------------- re-costing


def recost(schedule: Schedule, table: CostTable, found: Partition, *, memory_limit: float | None,
           shape: ScheduleShape | None = None) -> Problem:
    """The problem of ``schedule``'s task graph with the real costs of ``found``'s stages.

    Stage durations are F, I (the :class:`~pipeloom.problem.Stage`'s ``b``) and W of the stage's pieces
    in seconds (for a schedule with a full backward, B is the pieces' full backward,
    :attr:`Piece.full_backward`), activations in bytes, static memory per rank the weights, gradients
    and optimizer state of its stages, and the communication latency the link time of the largest
    output crossing ranks. A stage that reads only model inputs (no gradient flows into it) has its I
    counted as W, as the engine's I has no input gradient to compute there. Every task also pays
    ``table.runtime.action_overhead`` (a full B once), and a stage's F and its B or I pay
    ``table.runtime.message_cost`` once per edge of the stage to or from another rank (the send or the
    receive that action posts). The task graph keeps the schedule's (same ranks, edges and backward
    split), so its action order stays valid. ``shape``: ``schedule_shape(schedule)``, when the caller has it.
    """
    shape = shape or schedule_shape(schedule)
    pieces = table.pieces
    starts = [found.stage_of.index(j) for j in range(found.num_stages)] + [len(pieces)]
    parts = [pieces[starts[j]:starts[j + 1]] for j in range(found.num_stages)]
    split = schedule.problem.splits_backward
    extra = table.runtime.action_overhead
    stages = []
    static = [0.0] * shape.num_ranks
    edges = [(s, c) for s in range(len(shape.rank)) for c in shape.consumers[s]]
    crossings = [0] * len(shape.rank)  # edges to or from another rank, per stage
    for s, c in edges:
        if shape.rank[c] != shape.rank[s]:
            crossings[s] += 1
            crossings[c] += 1
    for s, j in enumerate(shape.model_stage):
        part = parts[j]
        i, w = sum(p.i for p in part), sum(p.w for p in part)
        if not split:
            i, w = sum(p.full_backward for p in part), 0.0  # one autograd.backward, as the engine's B
        elif _reads_model_inputs_only(part):
            i, w = 0.0, i + w
        messages = table.runtime.message_cost * crossings[s]
        stages.append(Stage(ranks=(shape.rank[s],), f=sum(p.f for p in part) + extra + messages,
                            b=i + extra + messages, w=w + (extra if split else 0.0),
                            memory=sum(p.activation_bytes for p in part),
                            w_memory=sum(p.w_activation_bytes for p in part)))
        static[shape.rank[s]] += sum(table.static_bytes(p) for p in part)
    if table.shared and shape.replicas == 1:  # a shared parameter is held once by every rank that uses it
        for rank, extra_bytes in shared_static_bytes(table, piece_ranks(shape, found)).items():
            static[rank] += extra_bytes
    crossing = [pieces[starts[shape.model_stage[c]] - 1].output_bytes for s, c in edges
                if shape.rank[s] != shape.rank[c]]
    problem = stage_graph(
        stages, num_ranks=shape.num_ranks, edges=edges,
        backward="split" if split else "full",
        comm_latency=max((table.link.time(b) for b in crossing), default=0.0),
        memory_limit=memory_limit, static_memory=static,
    )
    _check_same_graph(schedule.problem, problem)
    return problem


def piece_ranks(shape, found: Partition) -> tuple[int, ...]:
    """Per piece of the table: the rank that holds it (one-replica schedules)."""
    rank_of_model_stage = {j: shape.rank[s] for s, j in enumerate(shape.model_stage)}
    return tuple(rank_of_model_stage[j] for j in found.stage_of)


def shared_time(table: CostTable, schedule: Schedule, found: Partition, *,
                shape: ScheduleShape | None = None) -> float:
    """Seconds the after-step exchange of shared parameters' gradients takes (:func:`shared_sync_time`;
    0 without shared parameters on several ranks)."""
    shape = shape or schedule_shape(schedule)
    if not table.shared or shape.replicas > 1:
        return 0.0
    return shared_sync_time(table, piece_ranks(shape, found), schedule.num_microbatches)


def _reads_model_inputs_only(part: Sequence) -> bool:
    """True when the pieces of a stage read nothing from other stages (only model inputs and each other)."""
    inside = {p.name for p in part}
    return all(name in inside for p in part for name in p.inputs)


def replica_sync_time(table: CostTable, schedule: Schedule, found: Partition, *, link: Link | None = None,
                      shape: ScheduleShape | None = None) -> float:
    """Seconds to add up the replicas' weight gradients after the step (two-replica schedules, else 0).

    As the engine does it, per model stage: the second replica's rank sends its M/2 micro-batch
    gradients of the stage (one buffer per micro-batch, ``M/2 x`` parameter bytes) to the first
    replica's rank, which adds them up and sends the sums back (parameter bytes once). All sends are
    posted before waiting, so the stages' exchanges overlap; what arrives at one rank is serialised:
    the time is the busiest rank's incoming ``M/2`` messages, then the busiest rank's incoming sums,
    each message paying the link's latency. The link is ``link``, else the table's ``runtime.replica_link``
    (measured as the engine exchanges), else its ``link``.
    """
    params = [0.0] * found.num_stages
    for piece, j in zip(table.pieces, found.stage_of):
        params[j] += piece.param_bytes
    return exchange_time(params, schedule, link or table.runtime.replica_link or table.link, shape=shape)


def stage_spreads(table: CostTable, schedule: Schedule, found: Partition, *,
                  shape: ScheduleShape | None = None) -> list[float]:
    """Per stage of ``schedule``: how much its actions' times vary (coefficient of variation): the
    table's ``runtime.time_spread``, measured on one piece's actions, for every stage with work to do.

    A stage of several pieces varies about as much as one piece does (measured on the example GPT's
    plans: their stages' spread was that of the profile's pieces, not the smaller one independent
    pieces would add up to); what varies is the machine's speed during the action, not each kernel.
    """
    shape = shape or schedule_shape(schedule)
    work = [0.0] * found.num_stages
    for piece, j in zip(table.pieces, found.stage_of):
        work[j] += piece.f + piece.full_backward
    return [table.runtime.time_spread if work[j] > 0 else 0.0 for j in shape.model_stage]


def exchange_time(stage_params: Sequence[float], schedule: Schedule, link: Link, *,
                  shape: ScheduleShape | None = None) -> float:
    """:func:`replica_sync_time` for model stages of ``stage_params`` bytes of parameters each."""
    shape = shape or schedule_shape(schedule)
    if shape.replicas == 1:
        return 0.0
    half = schedule.num_microbatches  # micro-batches per replica (M/2)
    gather = [0.0] * shape.num_ranks
    back = [0.0] * shape.num_ranks
    for j, params in enumerate(stage_params):
        holders = sorted(s for s in range(len(shape.model_stage)) if shape.model_stage[s] == j)
        owner = shape.rank[holders[0]]
        for s in holders[1:]:
            if shape.rank[s] != owner and params > 0:
                gather[owner] += half * link.time(params)
                back[shape.rank[s]] += link.time(params)
    return max(gather) + max(back)


def _check_same_graph(original: Problem, costed: Problem) -> None:
    def shape(problem: Problem) -> dict:
        return {task.key: (task.ranks, frozenset(task.deps)) for task in problem.tasks}

    assert shape(original) == shape(costed), "re-costing changed the schedule's task graph"


# ---------------------------------------------------------------------------------- the search


def _options(name: str, stages_per_rank: Sequence[int]) -> list[dict]:
    if "stages_per_rank" in REGISTRY[name].options:
        return [{"stages_per_rank": v} for v in stages_per_rank]
    return [{}]


MAX_PLAN_MICROBATCHES = 1024
"""Most micro-batches per step a plan considers: the default counts are the divisors of the global
batch up to this (found without counting to the batch), and a larger count asked for is refused.
Each candidate is simulated, and a step of more micro-batches than this has no bubble left to gain."""


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` up to :data:`MAX_PLAN_MICROBATCHES`."""
    return [m for m in range(1, min(n, MAX_PLAN_MICROBATCHES) + 1) if n % m == 0]


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
        # a memory-aware schedule (ZB-V) orders its actions for a limit: try the plan's and its default
        limits = (limit, None) if REGISTRY[name].memory_aware and limit is not None else (None,)
        tried = [self._try(base, partitioner, library_limit=lim) for lim in limits]
        best = min(tried, key=_rank)
        # nothing fits: say what the order built without the limit needs, as that order is the same
        # at any limit (the one built for the limit changes with it), so its need fits when passed back
        return best if best.fits else tried[-1]

    def _try(self, base: Candidate, partitioner: SchedulePartitioner, *, library_limit: float | None
             ) -> Candidate:
        table, limit = partitioner.table, self.memory_limit
        try:
            library = library_schedule(table, base.schedule, self.num_ranks, base.microbatches,
                                       memory_limit=library_limit, **base.schedule_options)
        except (ValueError, PipeloomError) as error:
            return dataclasses.replace(base, reason=f"not built: {error}")
        shape = schedule_shape(library)  # once: every split below is judged on it
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
        reason = "" if limit is None or peak <= limit * _FIT else f"peak {format_bytes(peak)} > {format_bytes(limit)}"
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
) -> PlanResult:
    """The fastest pipeline plan for ``table`` on ``num_ranks`` ranks of ``memory_limit`` bytes each.

    Tries every schedule of ``schedules`` (default :func:`default_schedules`), with each of
    ``stages_per_rank`` for the looped ones, and every micro-batch count M of ``microbatches``
    (default: the divisors of ``global_batch`` up to :data:`MAX_PLAN_MICROBATCHES`; micro-batch size =
    global_batch / M). ``table`` may
    be several tables of one model measured at different micro-batch sizes (:func:`table_for_size`
    interpolates between them; one table is scaled linearly). Each candidate is cut by the
    partitioner for the schedule's placement and memory profile, re-costed (:func:`recost`) and
    simulated. With ``search_time`` > 0, :func:`pipeloom.search.search` then looks for a faster
    order of the ``search_top`` best candidates' re-costed task graphs, that many seconds in all; a
    better one joins as schedule ``search`` (:meth:`PlanResult.save` writes it next to the plan).
    :class:`NoPlanFits` when nothing fits: it names the smallest per-rank limit that would, or why
    nothing could be built. ``progress``, when given, is called with a short line before each candidate.
    """
    started = time.perf_counter()
    tables = [table] if isinstance(table, CostTable) else list(table)
    table = table_for_size(tables, tables[0].microbatch_size if tables else 1)  # checks they match
    _check_request(table, num_ranks, global_batch, memory_limit, schedules)
    counts = sorted(set(microbatches)) if microbatches is not None else _divisors(global_batch)
    for m in counts:
        if isinstance(m, int) and not isinstance(m, bool) and m > MAX_PLAN_MICROBATCHES:
            raise PlanError(f"{m} micro-batches per step is more than the planner considers "
                            f"({MAX_PLAN_MICROBATCHES}); choose at most {MAX_PLAN_MICROBATCHES}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or global_batch % m:
            raise PlanError(f"micro-batch count {m!r} does not divide the global batch {global_batch}; "
                            f"choose among {_divisors(global_batch)}")
    search = _Search(tables, num_ranks=num_ranks, memory_limit=memory_limit)
    jobs = [(name, options, m) for m in counts for name in (schedules or default_schedules())
            for options in _options(name, stages_per_rank)]
    tried = []
    for k, (name, options, m) in enumerate(jobs):
        if progress is not None:
            progress(f"{name} with {m} micro-batches ({k + 1} of {len(jobs)})")
        tried.append(search.candidate(name, options, m, global_batch // m))
    ranked = sorted(tried, key=_rank)
    if search_time > 0:
        top = [c for c in ranked if c.fits][:search_top]
        ranked = sorted(ranked + [found for c in top if (found := _searched(
            c, search_time / len(top), memory_limit, table_for_size(tables, c.microbatch_size))) is not None],
            key=_rank)
    best = ranked[0]
    if not best.fits:
        raise _nothing_fits(table, num_ranks, memory_limit, ranked)
    plan = Plan(
        num_ranks=num_ranks, split_points=best.split_points or (), schedule=best.schedule,
        schedule_options=best.schedule_options, microbatches=best.microbatches, global_batch=global_batch,
        predicted_step_time=best.step_time, peak_memory=best.timeline.peak_memory, memory_limit=memory_limit,
        bubble_ratio=best.bubble_ratio, stage_times=best.partition.stage_times, device=table.device,
    )
    return PlanResult(plan=plan, timeline=best.timeline, candidates=tuple(ranked),
                      seconds=time.perf_counter() - started)


def _searched(candidate: Candidate, seconds: float, memory_limit: float | None,
              table: CostTable) -> Candidate | None:
    """The CP-SAT search's schedule for ``candidate``'s re-costed task graph, when it is faster
    (both predicted with ``table``'s time spread and start skew)."""
    from pipeloom.search import search

    schedule = candidate.timeline.schedule
    spread = stage_spreads(table, schedule, candidate.partition)
    try:
        result = search(schedule.problem, schedule.num_microbatches, time_limit=seconds, memory_limit=memory_limit,
                        name="search")
    except PipeloomError:
        return None
    timeline = simulate(result.schedule)
    makespan = (expected_makespan(result.schedule, spread, start_skew=table.runtime.start_skew)
                if any(spread) or table.runtime.start_skew else timeline.makespan)
    # the same replica exchange and step overhead as the candidate's
    step = (makespan + replica_sync_time(table, schedule, candidate.partition)
            + shared_time(table, schedule, candidate.partition) + table.runtime.step_overhead)
    if step >= candidate.step_time * (1 - 1e-9):
        return None
    if memory_limit is not None and max(timeline.peak_memory) > memory_limit * _FIT:
        return None  # the simulator is the judge of memory too
    return dataclasses.replace(candidate, schedule="search", schedule_options={}, step_time=step,
                               peak_memory=max(timeline.peak_memory), bubble_ratio=timeline.bubble_ratio,
                               timeline=timeline, reason="")


def _rank(candidate: Candidate) -> tuple:
    """Fitting candidates first by step time (ties: less memory), then the others by the memory they need."""
    if candidate.fits:
        return (0, candidate.step_time, candidate.peak_memory, candidate.microbatches)
    need = candidate.peak_memory if candidate.peak_memory is not None else float("inf")
    return (1, need, 0.0, candidate.microbatches)


def _check_request(table: CostTable, num_ranks: int, global_batch: int, memory_limit: float | None,
                   schedules: Sequence[str] | None) -> None:
    for name, value in (("num_ranks", num_ranks), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    if memory_limit is not None and not memory_limit > 0:
        raise PlanError(f"memory_limit must be a positive number of bytes, got {memory_limit!r}")
    unknown = [name for name in schedules or () if name not in REGISTRY]
    if unknown:
        raise PlanError(f"unknown schedule(s) {unknown}; choose among: {', '.join(REGISTRY)}")
    if not any(p.f > 0 or p.i > 0 or p.w > 0 for p in table.pieces):
        raise PlanError("every piece of the cost table takes no time (f, i and w all 0): there is nothing to "
                        "plan; profile the model (pipeloom profile) or fill in the pieces' times")
    if num_ranks > len(table.pieces):
        raise PlanError(
            f"{num_ranks} ranks need at least {num_ranks} pieces (one stage each), but the cost table has "
            f"{len(table.pieces)}; use at most {len(table.pieces)} ranks, or profile finer pieces"
        )


def _nothing_fits(table: CostTable, num_ranks: int, memory_limit: float | None,
                  ranked: Sequence[Candidate]) -> NoPlanFits:
    sized = [c for c in ranked if c.peak_memory is not None]
    if memory_limit is not None and sized:
        least = min(sized, key=lambda c: c.peak_memory)
        return NoPlanFits(
            f"no plan fits {format_bytes(memory_limit)} per rank on {num_ranks} ranks; the smallest that fits "
            f"is about {format_bytes_up(least.peak_memory)} (rounded up; {least.label}, {least.microbatches} "
            f"micro-batches of {least.microbatch_size}): raise the memory limit, or use more ranks",
            smallest_limit=least.peak_memory,
        )
    reasons = "; ".join(dict.fromkeys(c.reason for c in ranked))
    return NoPlanFits(f"no plan could be built for {len(table.pieces)} pieces on {num_ranks} ranks: {reasons}",
                      smallest_limit=None)
