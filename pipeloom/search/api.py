"""One call to search a schedule: pick exact or periodic mode, warm-start from the built-in
schedules that fit the problem, and never answer worse than the best of them.

User problem files are read by :mod:`pipeloom.search.problem_file` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Literal

from pipeloom.errors import PipeloomError, require_type
from pipeloom.problem import MAX_INTERVALS, Problem
from pipeloom.search.budget import Budget
from pipeloom.search.builtins import PROBE_SIZES, builtin_candidates
from pipeloom.search.common import lower_bound, to_integers
from pipeloom.search.constructions import BLOCK_PLACEMENTS, insert_all_rank_tasks, split_each_backward
from pipeloom.search.errors import SearchError
from pipeloom.search.memory_bounds import limit_of
from pipeloom.search.problem_file import check_task_count
from pipeloom.search.result import Mode, SearchProgress, SearchResult, Status
from pipeloom.search.transforms import merge_backward, without_all_rank_tasks, without_idle_ranks
from pipeloom.sim import Timeline
from pipeloom.validate import validate

__all__ = [
    "AUTO_EXACT_INTERVALS",
    "BUILTIN_SHARE",
    "CONSTRUCTION_SHARE",
    "SearchMode",
    "search",
    "search_plan",
]

SearchMode = Literal["auto", "exact", "periodic"]

AUTO_EXACT_INTERVALS = 400
"""Auto mode adds the exact model (warm-started from the periodic schedule) when tasks x
micro-batches, its interval count, is at most this. Measured on the Tessel placements at 4 ranks,
limit 6, 10 s (docs/search.md): the periodic schedule costs ~0.1 s and is within a few percent
from about 250 intervals on, while up to ~500 the exact model still improves it (xshape M=32:
282 -> 267) or proves it optimal; beyond that it rarely finishes and the periodic schedule,
whose gap shrinks as 1/M, is the better use of the time."""

BUILTIN_SHARE = 0.3
"""Share of :func:`search`'s time limit that building the built-in candidates may take; entries
(and variants) whose estimated build-and-validate time does not fit are skipped."""

CONSTRUCTION_SHARE = 0.3
"""Share of the time left that each construction's search of another problem may take."""

MAX_HINTS = 3
"""The exact model is hinted with the fastest this many built-ins and constructions (each hint is
validated again there)."""

MIN_INNER_SECONDS = 0.05
"""A construction's search or a solver given less time than this is not started."""


# ---------------------------------------------------------------------------------- searching

logger = logging.getLogger(__name__)


def search_plan(problem: Problem, num_microbatches: int, mode: SearchMode = "auto") -> tuple[Mode, ...]:
    """The solvers :func:`search` runs, in order. ``periodic``: the periodic model. ``auto``: the
    periodic model, then (at most ``AUTO_EXACT_INTERVALS`` (task, micro-batch) intervals) the
    exact model warm-started from it. ``exact``: the exact model, after the periodic model above
    ``AUTO_EXACT_INTERVALS`` intervals (a full-time warm start the exact model could not match)."""
    if mode not in ("auto", "exact", "periodic"):
        raise PipeloomError(f"unknown search mode {mode!r}; choose auto, exact or periodic")
    small = len(problem.tasks) * num_microbatches <= AUTO_EXACT_INTERVALS
    if mode == "periodic":
        return ("periodic",)
    if mode == "exact":
        return ("exact",) if small else ("periodic", "exact")
    return ("periodic", "exact") if small else ("periodic",)


def search(
    problem: Problem,
    num_microbatches: int,
    *,
    mode: SearchMode = "auto",
    memory_limit: float | None = None,
    time_limit: float = 30.0,
    workers: int = 2,
    progress: Callable[[SearchProgress], None] | None = None,
    name: str = "search",
) -> SearchResult:
    """The fastest schedule found for ``num_microbatches`` micro-batches of ``problem``.

    ``memory_limit`` overrides the problem's own limit. The answer is the fastest of, in this
    order (each step skipped once the best so far meets the lower bound):

    1. the built-in schedules that fit the problem (:func:`builtin_candidates`), in at most
       ``BUILTIN_SHARE`` of the time;
    2. the constructions (:mod:`pipeloom.search.constructions`), each from a search of another
       problem in ``CONSTRUCTION_SHARE`` of the time left: with all-rank tasks, that search's answer
       for the problem without them with them put back; with a split backward, the answer for the
       full-backward twin with each B split into I then W;
    3. the solvers of :func:`search_plan` with the time left (exact gets every schedule so far as hints);
    4. the built-ins step 1 had no time for, in the time the solvers left.

    Ties go to the solver. ``time_limit`` bounds the whole call, every phase included: steps that
    cannot be stopped half-way (building and validating a whole schedule) are skipped when their
    estimated time does not fit (:class:`~pipeloom.search.budget.Budget`). The result's ``origin``
    says which step won; a built-in or construction that wins is named ``"{name} (={origin})"``
    and has no period. The lower bound is the best any solver proved (at least the closed-form
    :func:`~pipeloom.search.common.lower_bound`). Raises SearchError when no schedule meets the
    limit or none could be built in the time, and PipeloomError, before any work, above
    :data:`MAX_INTERVALS` (task, micro-batch) intervals.
    """
    require_type("problem", problem, Problem, "a Problem: placement(name, ranks) for a catalogue placement "
                 "(e.g. search(placement('mshape', 8), 128)), load_problem(path) or stage_graph(...)")
    _check_arguments(num_microbatches, time_limit, workers)
    _check_size(problem, num_microbatches)
    started = time.perf_counter()
    budget = Budget(deadline=started + time_limit)
    limit = limit_of(problem, memory_limit)
    # the problem's own checks first (a negative limit is a bad argument, not a limit the static memory is over)
    target = problem if limit == problem.memory_limit else dataclasses.replace(problem, memory_limit=limit)
    _check_static(problem, limit)
    compact = without_idle_ranks(target)
    if compact is not None:  # searched on the ranks that hold tasks, the others given back empty
        found = search(compact[0], num_microbatches, mode=mode, time_limit=time_limit, workers=workers,
                       progress=progress, name=name)
        return found.on_ranks(target, compact[1])
    plan = search_plan(target, num_microbatches, mode)
    to_integers(target, num_microbatches=num_microbatches if "exact" in plan else 1)  # int64 range, up front
    run = _Search(target, num_microbatches, plan=plan, budget=budget, workers=workers, name=name,
                  mode=mode, progress=progress)
    for step in (run.builtins, run.constructions, run.solvers, run.late_builtins):
        if not run.done():
            step()
    return run.answer(seconds=time.perf_counter() - started, time_limit=time_limit)


class _Search:
    """The state of one :func:`search` call: the candidates found so far and the lower bound."""

    def __init__(self, problem: Problem, num_microbatches: int, *, plan: tuple[Mode, ...], budget: Budget,
                 workers: int, name: str, mode: SearchMode,
                 progress: Callable[[SearchProgress], None] | None) -> None:
        self.problem, self.num_mb, self.plan, self.budget = problem, num_microbatches, plan, budget
        self.workers, self.name, self.mode, self.progress = workers, name, mode, progress
        self.actions = len(problem.tasks) * num_microbatches
        # the bound's per-rank refinement may take a quarter of the time; it stays a bound when cut short
        self.bound = lower_bound(problem, num_microbatches, deadline=time.perf_counter() + budget.left() / 4)
        self.candidates: dict[str, Timeline] = {}
        """Built-ins (``builtin:NAME``) and constructions by origin."""
        self.results: list[SearchResult] = []
        self.failure: SearchError | None = None
        self.skipped: set[str] = set()
        """Built-ins step 1 left unbuilt for time."""

    def best_makespan(self) -> float:
        return min([t.makespan for t in self.candidates.values()] + [r.makespan for r in self.results],
                   default=math.inf)

    def done(self) -> bool:
        """Whether the best schedule so far meets the lower bound, or the time is up."""
        return _status(self.best_makespan(), self.bound) == "optimal" or self.budget.expired()

    def offer(self, origin: str, timeline: Timeline | None) -> None:
        if timeline is not None and (origin not in self.candidates
                                     or timeline.makespan < self.candidates[origin].makespan):
            self.candidates[origin] = timeline

    def builtins(self) -> None:
        """Step 1: the fitting built-ins, until one meets the bound."""
        share = self.budget.sub(BUILTIN_SHARE)
        for key, timeline in builtin_candidates(self.problem, self.num_mb, enough=self.bound, budget=share,
                                                skipped=self.skipped):
            self.offer(f"builtin:{key}", timeline)
            if self.done():
                break
        self.budget.seconds_per_action = share.seconds_per_action
        if not self.done() and self.budget.fits(self.actions):  # the list schedule fits any placement
            self.offer("list", self._timed(self._list_schedule))

    def late_builtins(self) -> None:
        """Step 4: the built-ins step 1 left unbuilt for time, in the time the solvers left (a
        solver that stops early, e.g. at its period's bound, must not answer slower than one)."""
        if not self.skipped:
            return
        for key, timeline in builtin_candidates(self.problem, self.num_mb, enough=self.bound, budget=self.budget,
                                                names=frozenset(self.skipped)):
            self.offer(f"builtin:{key}", timeline)
            if self.done():
                break

    def _list_schedule(self) -> Timeline | None:
        """The time-aware list schedule (:func:`~pipeloom.search.greedy.list_schedule`) within the
        time left, or None when it does not fit the memory limit or the time."""
        from pipeloom.search.greedy import list_schedule

        try:
            schedule = list_schedule(self.problem, self.num_mb, name=self.name,
                                     deadline=time.perf_counter() + self.budget.left())
            return validate(schedule, ordered=True)
        except (SearchError, PipeloomError):
            return None

    def constructions(self) -> None:
        """Step 2: the all-rank-block and split-backward constructions that apply."""
        reduced = without_all_rank_tasks(self.problem)
        inner = self._inner(reduced.problem) if reduced is not None else None
        if reduced is not None and inner is not None:
            for where in BLOCK_PLACEMENTS:
                if self.done() or not self.budget.fits(self.actions):
                    break
                self.offer(f"all-rank-blocks({inner.origin})", self._timed(
                    insert_all_rank_tasks, inner.schedule, self.problem, reduced, where=where))
        merged = merge_backward(self.problem)
        if merged is not None and not self.done():
            inner = self._inner(merged)
            if inner is not None and self.budget.fits(self.actions):
                self.offer(f"split-backward({inner.origin})",
                           self._timed(split_each_backward, inner.schedule, self.problem))

    def _inner(self, other: Problem) -> SearchResult | None:
        """A search of ``other`` in ``CONSTRUCTION_SHARE`` of the time left (less the time to
        validate what is built from it); None when there is no time or no schedule."""
        seconds = self.budget.left() * CONSTRUCTION_SHARE - self.budget.schedule_cost(self.actions)
        if seconds < MIN_INNER_SECONDS:
            return None
        try:
            return search(other, self.num_mb, mode=self.mode, time_limit=seconds, workers=self.workers,
                          name=self.name)
        except SearchError:
            return None

    def _timed(self, build: Callable[..., Timeline | None], *args, **kwargs) -> Timeline | None:
        """``build(*args, **kwargs)``, teaching the budget how long a schedule pass takes."""
        began = time.perf_counter()
        timeline = build(*args, **kwargs)
        self.budget.observe(self.actions, time.perf_counter() - began)
        return timeline

    def solvers(self) -> None:
        """Step 3: the solvers of the plan in turn, each keeping time to validate its schedule (and
        to build a built-in step 1 left for time)."""
        from pipeloom.search.exact import solve_exact
        from pipeloom.search.periodic import solve_periodic

        limit = self.problem.memory_limit
        p, m = self.problem.num_ranks, self.num_mb
        probes = sum(min(m, k * p) for k in PROBE_SIZES) / m * len(self.skipped)  # each left entry's probes first
        for step, solver in enumerate(self.plan):
            # time to validate the solver's schedule, and to probe the built-ins step 1 had no time for and build one
            left = self.budget.left() - self.budget.schedule_cost(self.actions, passes=1 + bool(self.skipped)
                                                                   * (1 + probes))
            share = left if step == len(self.plan) - 1 else left / 4  # periodic first: it is quick
            if share < MIN_INNER_SECONDS or self.done():
                break
            try:
                if solver == "exact":
                    known = sorted(self.candidates.values(), key=lambda t: t.makespan)[:MAX_HINTS]
                    hints = tuple(t.schedule for t in known) + tuple(r.schedule for r in self.results)
                    self.results.append(solve_exact(self.problem, self.num_mb, hints=hints, memory_limit=limit,
                                                    time_limit=share, workers=self.workers, progress=self.progress,
                                                    name=self.name))
                else:
                    self.results.append(solve_periodic(self.problem, self.num_mb, memory_limit=limit,
                                                       time_limit=share, workers=self.workers,
                                                       progress=self.progress, name=self.name))
            except SearchError as error:
                logger.info("%s: the %s solver found no schedule: %s", self.name, solver, error)
                self.failure = error
            else:
                found = self.results[-1]
                logger.info("%s: the %s solver: makespan %g, bound %g (%s) in %.1f s of %.1f", self.name,
                            solver, found.makespan, found.lower_bound, found.status, found.seconds, share)
            if self.results and self.results[-1].status == "optimal":
                break

    def answer(self, *, seconds: float, time_limit: float) -> SearchResult:
        """The fastest of the solvers' results unless a candidate is strictly faster (see :func:`_best`)."""
        if not self.results and not self.candidates:
            if self.failure is not None:
                raise self.failure
            raise SearchError(
                f"no schedule found within the time limit of {time_limit:g} s ({self.actions:,} actions "
                f"take about {self.budget.schedule_cost(self.actions):.2g} s to build and check on this "
                "machine); raise the time limit"
            )
        return _best(self.problem, self.num_mb, self.results, self.candidates, mode=self.plan[-1],
                     name=self.name, seconds=seconds, bound=self.bound)


def _check_static(problem: Problem, limit: float | None) -> None:
    """SearchError when some rank's static memory alone exceeds the memory limit: nothing can fit."""
    static = problem.static_memory
    if limit is None or not static:
        return
    rank = max(range(len(static)), key=static.__getitem__)
    if static[rank] > limit:
        raise SearchError(f"rank {rank} holds {static[rank]:g} of static memory (weights, state) before any "
                          f"action, above the memory limit {limit:g}: no schedule fits; raise the limit above "
                          f"{static[rank]:g} plus the activations the schedule holds, or lower the static memory")


def _check_arguments(num_microbatches: int, time_limit: float, workers: int) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise PipeloomError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise PipeloomError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PipeloomError(f"workers must be a positive integer, got {workers!r}")


def _check_size(problem: Problem, num_microbatches: int) -> None:
    """Refuse more than :data:`MAX_INTERVALS` intervals, or a problem of more than
    :data:`~pipeloom.search.problem_file.MAX_SEARCH_TASKS` tasks, before building anything."""
    check_task_count(len(problem.tasks))
    intervals = len(problem.tasks) * num_microbatches
    if intervals > MAX_INTERVALS:
        raise PipeloomError(
            f"{len(problem.tasks)} tasks x {num_microbatches:,} micro-batches = {intervals:,} actions, over "
            f"the search cap of {MAX_INTERVALS:,}; use fewer micro-batches (a periodic schedule's time "
            f"per micro-batch does not depend on M) or fewer ranks"
        )


def _best(problem: Problem, num_microbatches: int, results: list[SearchResult],
          candidates: dict[str, Timeline], *, mode: Mode, name: str, seconds: float,
          bound: float | None = None) -> SearchResult:
    """The fastest of the solvers' results unless a candidate (built-in or construction, by origin)
    is strictly faster, with the best proven lower bound and its status. Ties go to a result that
    knows its period (exact mode handing back the periodic schedule it was hinted with), then to
    the later solver."""
    floor = lower_bound(problem, num_microbatches) if bound is None else bound
    bound = max([floor] + [r.lower_bound for r in results])
    found = min(reversed(results), key=lambda r: (r.makespan, r.period is None), default=None)
    winner = min(candidates, key=lambda key: candidates[key].makespan, default=None)
    if found is not None and (winner is None or found.makespan <= candidates[winner].makespan):
        return dataclasses.replace(found, lower_bound=bound, seconds=seconds,
                                   status=_status(found.makespan, bound))
    assert winner is not None  # search() raises when no solver and no candidate succeeded
    timeline = candidates[winner]
    label = winner.removeprefix("builtin:")
    return SearchResult(
        schedule=dataclasses.replace(timeline.schedule, name=f"{name} (={label})"),
        status=_status(timeline.makespan, bound),
        mode=mode,
        makespan=timeline.makespan,
        lower_bound=bound,
        seconds=seconds,
        peak_memory=timeline.peak_memory,
        period=None,
        period_lower_bound=next((r.period_lower_bound for r in results if r.period_lower_bound), None),
        time_scale=results[0].time_scale if results else 1.0,
        origin=winner,
    )


def _status(makespan: float, bound: float) -> Status:
    """``optimal`` when the makespan meets the proven bound (up to float rounding)."""
    return "optimal" if makespan <= bound * (1 + 1e-9) + 1e-12 else "feasible"
