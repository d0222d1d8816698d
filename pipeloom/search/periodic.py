"""Periodic (repetend) search for many micro-batches: the shortest steady-state period
(:mod:`pipeloom.search.repetend`) solved with CP-SAT, unrolled to M micro-batches in time linear
in M and re-simulated as soon as possible; the list schedule (and, when small, the exact search)
stands in where the unrolled schedule fails validation.
"""

from __future__ import annotations

import time
from dataclasses import replace

from pipeloom.errors import ScheduleError
from pipeloom.ir import Action
from pipeloom.problem import Problem
from pipeloom.search.budget import SECONDS_PER_ACTION
from pipeloom.search.common import IntegerProblem, lower_bound, period_lower_bound, to_integers
from pipeloom.search.cpsat import meets_bound, status_word
from pipeloom.search.errors import SearchError
from pipeloom.search.exact import solve_exact
from pipeloom.search.greedy import feasible_limit_note, list_schedule
from pipeloom.search.memory_bounds import limit_of
from pipeloom.search.repetend import coarsen
from pipeloom.search.result import SearchResult
from pipeloom.search.steady import Progress, Repetend, smallest_limit, solve_repetend, unroll
from pipeloom.sim import Timeline
from pipeloom.validate import validate

__all__ = ["FALLBACK_EXACT_INTERVALS", "solve_periodic"]

_RESERVE = 0.1
"""Seconds of the time limit kept for unrolling and re-simulating, plus :data:`_FALLBACK_PASSES`."""
_FALLBACK_PASSES = 2.0
"""Whole-schedule passes (:data:`~pipeloom.search.budget.SECONDS_PER_ACTION` each) kept for the
list-schedule fallback when the repetend fails (building it, validating it)."""
FALLBACK_EXACT_INTERVALS = 400
"""When the unrolled schedule fails, the exact search (warm-started from the list schedule) runs
if tasks x micro-batches is at most this (as ``pipeloom.search.api``'s auto mode); else the list
schedule alone stands in."""


def _measured_period(timeline: Timeline, copies: int) -> float | None:
    """Mean start-to-start distance of one task over the middle half of the micro-batches
    (whole repetends only); None when there are too few micro-batches."""
    schedule = timeline.schedule
    m = schedule.num_microbatches
    first, last = m // 4 // copies * copies, 3 * m // 4 // copies * copies
    if last <= first:
        return None
    task = schedule.problem.tasks[0]
    starts = {action.microbatch: start for action, start, _ in timeline.events(task.ranks[0])
              if type(action) is Action and action.task == task.key}
    return (starts[last] - starts[first]) / (last - first)


_STEADY_ACTIONS = 200_000
"""The most actions unrolled only to measure a steady period (a few seconds to validate at most)."""


def _steady_period(problem: Problem, repetend: Repetend, timeline: Timeline, name: str) -> float | None:
    """The real period of ``repetend`` unrolled with ``problem``'s durations: measured over the middle half of a run
    of at least 32 repetitions (a short run's middle is still warming up: 6 micro-batches of a two-branch DAG had
    measured 7.27 where a rank's own work per micro-batch is 8); ``timeline``'s own where it is that long, or a
    longer run too large to validate (then at least the proven bound); None where the longer run fails."""
    copies, m = repetend.copies, timeline.schedule.num_microbatches
    longer = 32 * copies
    if m >= longer or len(problem.tasks) * longer > _STEADY_ACTIONS:
        measured = _measured_period(timeline, copies)
        floor = period_lower_bound(problem, memory_limit=problem.memory_limit)
        return None if measured is None else max(measured, floor)
    try:
        longer_run = validate(unroll(problem, repetend, longer, name=name), ordered=True)
    except ScheduleError:
        return None
    return _measured_period(longer_run, copies)


def solve_periodic(
    problem: Problem,
    num_microbatches: int,
    *,
    memory_limit: float | None = None,
    time_limit: float = 10.0,
    workers: int = 2,
    progress: Progress | None = None,
    name: str = "search",
) -> SearchResult:
    """Shortest steady-state period under the memory limit, unrolled to ``num_microbatches``.

    ``memory_limit`` overrides ``problem.memory_limit``. The unrolled lists are re-simulated as
    soon as possible (same order, same memory, never later), which compresses warm-up and
    cool-down. Where no repetend is found or its unrolled schedule fails validation (warm-up or
    cool-down over the limit, e.g. a rank whose memory per micro-batch does not sum to 0), the
    list schedule stands in, improved by the exact search when small (:data:`FALLBACK_EXACT_INTERVALS`);
    its result says so (mode ``exact``, or ``periodic`` with the list schedule's measured period).
    Bounds: :func:`~pipeloom.search.common.lower_bound` and ``period_lower_bound`` under the limit.
    Raises SearchError (naming the smallest known working limit) when nothing fits.
    """
    begin = time.perf_counter()
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise SearchError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    limit = limit_of(problem, memory_limit)
    limited = replace(problem, memory_limit=limit)
    ip = coarsen(to_integers(limited))
    failure: SearchError | None
    try:
        reserve = _RESERVE + _FALLBACK_PASSES * SECONDS_PER_ACTION * len(problem.tasks) * num_microbatches
        repetend = solve_repetend(ip, time_limit=max(0.05, time_limit - reserve), workers=workers,
                                  progress=progress)
    except SearchError as error:  # out of time before any repetend
        repetend, failure = None, error
    else:  # None only when a memory limit rules out every repetend
        failure = None if repetend is not None else SearchError(f"memory limit {limit:g} admits no periodic schedule")
    if repetend is not None:
        schedule = unroll(limited, repetend, num_microbatches, name=name)
        try:
            timeline = validate(schedule, ordered=True)
        except ScheduleError as error:
            failure = SearchError(f"the unrolled periodic schedule fails validation "
                                  f"({str(error).splitlines()[0].split('; raise')[0]})")
        else:
            period = repetend.period / repetend.copies / ip.time_scale
            if not ip.exact:  # a coarse grid: measure the real steady state instead, on a run long enough for one
                period = _steady_period(limited, repetend, timeline, name) or period
            return _result(timeline, period, ip.time_scale, begin)
    fallback = _fallback(limited, num_microbatches, name=name, begin=begin, workers=workers,
                         time_limit=time_limit - (time.perf_counter() - begin))
    if fallback is not None:
        return fallback
    raise _no_schedule(ip, num_microbatches, failure, begin=begin, time_limit=time_limit, workers=workers)


def _result(timeline: Timeline, period: float, time_scale: float, begin: float) -> SearchResult:
    """A periodic-mode result for a validated ``timeline``: bounds under its problem's limit,
    ``optimal`` when the makespan meets the lower bound."""
    problem = timeline.schedule.problem
    bound = lower_bound(problem, timeline.schedule.num_microbatches, memory_limit=problem.memory_limit)
    makespan = timeline.makespan
    return SearchResult(
        schedule=timeline.schedule,
        status=status_word(meets_bound(makespan, bound)),
        mode="periodic",
        makespan=makespan,
        lower_bound=bound,
        seconds=time.perf_counter() - begin,
        peak_memory=timeline.peak_memory,
        period=period,
        period_lower_bound=period_lower_bound(problem, memory_limit=problem.memory_limit),
        time_scale=time_scale,
    )


def _fallback(problem: Problem, num_microbatches: int, *, name: str, begin: float, workers: int,
              time_limit: float) -> SearchResult | None:
    """The best valid schedule without a repetend: the exact search (warm-started from the list
    schedule) when tasks x micro-batches <= :data:`FALLBACK_EXACT_INTERVALS`, else the list
    schedule; None when neither meets the limit or ``time_limit`` (seconds left) runs out."""
    if time_limit < 0.05:
        return None
    if len(problem.tasks) * num_microbatches <= FALLBACK_EXACT_INTERVALS:
        try:
            found = solve_exact(problem, num_microbatches, time_limit=time_limit, workers=workers, name=name)
        except SearchError:
            return None
        period = _measured_period(validate(found.schedule, ordered=True), 1)
        return replace(found, seconds=time.perf_counter() - begin, period=period,
                       period_lower_bound=period_lower_bound(problem, memory_limit=problem.memory_limit))
    try:
        deadline = time.perf_counter() + time_limit
        timeline = validate(list_schedule(problem, num_microbatches, name=name, deadline=deadline), ordered=True)
    except SearchError:
        return None
    period = _measured_period(timeline, 1)
    return _result(timeline, timeline.makespan / num_microbatches if period is None else period, 1.0, begin)


def _no_schedule(ip: IntegerProblem, num_microbatches: int, failure: SearchError | None, *, begin: float,
                 time_limit: float, workers: int) -> SearchError:
    """The error when nothing fits: why, and the smallest limit known to work, as exact mode words
    it (:func:`~pipeloom.search.greedy.feasible_limit_note`): the least of the list scheduler's and,
    when every rank's memory per micro-batch sums to 0 (else the repetend bounds no other rank),
    the least a one-copy repetend needs."""
    problem, smallest = ip.problem, None
    deadline = begin + time_limit  # both look-ups below stay within the time limit
    if deadline - time.perf_counter() > 0.05 and all(
            sum(m for m, task in zip(ip.memory, problem.tasks) if q in task.ranks) == 0
            for q in range(problem.num_ranks)):
        smallest = smallest_limit(ip, time_limit=deadline - time.perf_counter(), workers=workers)
    known = feasible_limit_note(problem, num_microbatches, periodic_limit=smallest, deadline=deadline)
    return SearchError(f"{failure}, nor does the list schedule; {known}; raise the limit")
