"""One call to search a schedule: pick exact or periodic mode, warm-start from the built-in
schedules that fit the problem, and never answer worse than the best of them.

Also reads user problem files (the ``tasks`` part of the schedule JSON plus machine facts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from pipeloom.errors import PipeloomError, ScheduleFormatError
from pipeloom.ir import FORMAT, Schedule, schedule_from_json
from pipeloom.ir.files import read_text
from pipeloom.problem import Costs, Problem
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.search.common import SearchError, lower_bound, to_integers, topological_order
from pipeloom.search.result import SearchProgress, SearchResult
from pipeloom.sim import Timeline
from pipeloom.validate import validate

__all__ = [
    "AUTO_EXACT_INTERVALS",
    "MAX_INTERVALS",
    "SearchMode",
    "builtin_candidates",
    "load_problem",
    "problem_from_json",
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

MAX_INTERVALS = 10_000_000
""":func:`search` refuses, before building anything, a problem of more (task, micro-batch)
intervals (= actions of the schedule) than this; ``pipeloom show`` uses it too (a schedule that
size already takes gigabytes to hold and simulate)."""

BUILTIN_SHARE = 0.5
"""Share of :func:`search`'s time limit that building the built-in candidates may take; entries
not reached by then are skipped."""

_PROBLEM_KEYS = {"num_ranks", "tasks", "comm_latency", "memory_limit", "static_memory"}


# ---------------------------------------------------------------------------------- searching


def search_plan(problem: Problem, num_microbatches: int, mode: SearchMode = "auto") -> tuple[str, ...]:
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

    ``memory_limit`` overrides the problem's own limit; ``time_limit`` bounds the whole call.
    The solvers of :func:`search_plan` run in turn (exact gets every earlier schedule and every
    fitting built-in as hints). The answer is the fastest of their schedules and of the built-in
    schedules that fit the problem (:func:`builtin_candidates`) and meet the limit, so never
    worse than the library; a built-in that wins is named ``"{name} (={builtin})"`` and has no
    period. The lower bound is the best any solver proved (at least the closed-form
    :func:`~pipeloom.search.common.lower_bound`). Raises the solver's SearchError when no
    schedule meets the limit, and PipeloomError, before any work, above :data:`MAX_INTERVALS`
    (task, micro-batch) intervals. Building the built-ins may take ``BUILTIN_SHARE`` of the time.
    """
    _check_arguments(num_microbatches, time_limit, workers)
    _check_size(problem, num_microbatches)
    started = time.perf_counter()
    limit = problem.memory_limit if memory_limit is None else memory_limit
    target = problem if limit == problem.memory_limit else dataclasses.replace(problem, memory_limit=limit)
    plan = search_plan(target, num_microbatches, mode)
    to_integers(target, num_microbatches=num_microbatches if "exact" in plan else 1)  # int64 range, up front
    builtins = dict(builtin_candidates(target, num_microbatches, deadline=started + BUILTIN_SHARE * time_limit))
    results: list[SearchResult] = []
    failure: SearchError | None = None
    for step, solver in enumerate(plan):
        left = time_limit - (time.perf_counter() - started)
        share = left if step == len(plan) - 1 else left / 4  # periodic first: it is quick
        options = {"memory_limit": limit, "time_limit": max(0.05 * time_limit, share), "workers": workers,
                       "progress": progress, "name": name}
        try:
            if solver == "exact":
                from pipeloom.search.exact import solve_exact

                hints = tuple(t.schedule for t in builtins.values()) + tuple(r.schedule for r in results)
                results.append(solve_exact(target, num_microbatches, hints=hints, **options))
            else:
                from pipeloom.search.periodic import solve_periodic

                results.append(solve_periodic(target, num_microbatches, **options))
        except SearchError as error:
            failure = error
        if results and results[-1].status == "optimal":
            break
    if not results and not builtins:
        assert failure is not None
        raise failure
    return _best(target, num_microbatches, results, builtins, mode=plan[-1], name=name,
                 seconds=time.perf_counter() - started)


def _check_arguments(num_microbatches: int, time_limit: float, workers: int) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise PipeloomError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise PipeloomError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PipeloomError(f"workers must be a positive integer, got {workers!r}")


def _check_size(problem: Problem, num_microbatches: int) -> None:
    """Refuse more than :data:`MAX_INTERVALS` intervals before building anything."""
    intervals = len(problem.tasks) * num_microbatches
    if intervals > MAX_INTERVALS:
        raise PipeloomError(
            f"{len(problem.tasks)} tasks x {num_microbatches:,} micro-batches = {intervals:,} actions, over "
            f"the search cap of {MAX_INTERVALS:,}; use fewer micro-batches (a periodic schedule's time "
            f"per micro-batch does not depend on M) or fewer ranks"
        )


def _best(problem: Problem, num_microbatches: int, results: list[SearchResult],
          builtins: dict[str, Timeline], *, mode: str, name: str, seconds: float) -> SearchResult:
    """The fastest of the solvers' results unless a built-in is strictly faster, with the best
    proven lower bound and its status. Ties go to a result that knows its period (exact mode
    handing back the periodic schedule it was hinted with), then to the later solver."""
    bound = max([lower_bound(problem, num_microbatches)] + [r.lower_bound for r in results])
    found = min(reversed(results), key=lambda r: (r.makespan, r.period is None), default=None)
    winner = min(builtins, key=lambda key: builtins[key].makespan, default=None)
    if found is not None and (winner is None or found.makespan <= builtins[winner].makespan):
        return dataclasses.replace(found, lower_bound=bound, seconds=seconds,
                                   status=_status(found.makespan, bound))
    assert winner is not None  # search() re-raises when no solver and no built-in succeeded
    timeline = builtins[winner]
    return SearchResult(
        schedule=dataclasses.replace(timeline.schedule, name=f"{name} (={winner})"),
        status=_status(timeline.makespan, bound),
        mode=mode,  # type: ignore[arg-type]
        makespan=timeline.makespan,
        lower_bound=bound,
        seconds=seconds,
        peak_memory=timeline.peak_memory,
        period=None,
        period_lower_bound=next((r.period_lower_bound for r in results if r.period_lower_bound), None),
        time_scale=results[0].time_scale if results else 1.0,
    )


def _status(makespan: float, bound: float) -> str:
    """``optimal`` when the makespan meets the proven bound (up to float rounding)."""
    return "optimal" if makespan <= bound * (1 + 1e-9) + 1e-12 else "feasible"


# --------------------------------------------------------------------------- built-in schedules


def _structure(problem: Problem) -> dict:
    """What a schedule's validity depends on: each task's rank set and everything it transitively
    waits for (so an edge implied by a path does not matter; durations and memory do not either)."""
    before: dict = {}
    for i in topological_order(problem):
        task = problem.tasks[i]
        before[task.key] = frozenset(task.deps).union(*(before[dep] for dep in task.deps))
    return {task.key: (frozenset(task.ranks), before[task.key]) for task in problem.tasks}


def _costs_like(problem: Problem, stages_per_rank: int) -> Costs | None:
    """Per-rank-share costs whose stage 0 matches ``problem``'s (a built-in's order may use them)."""
    try:
        v = stages_per_rank
        forward = problem.task((0, "F"))
        if problem.splits_backward:
            i, w = problem.task((0, "I")), problem.task((0, "W"))
            return Costs(f=forward.duration * v, b=i.duration * v, w=w.duration * v,
                         comm=problem.comm_latency, memory=forward.memory * v, w_memory=-w.memory * v)
        back = problem.task((0, "B"))
        return Costs(f=forward.duration * v, b=back.duration * v, w=0.0, comm=problem.comm_latency,
                     memory=forward.memory * v)
    except ValueError:  # no such task, or negative costs: default costs only
        return None


def builtin_candidates(problem: Problem, num_microbatches: int, *,
                       deadline: float | None = None) -> Iterator[tuple[str, Timeline]]:
    """``(name, timeline)`` of every built-in schedule whose task structure (rank sets and
    transitive deps, see :func:`_structure`) is ``problem``'s,
    re-targeted to ``problem`` (its durations, memory and limit) and valid in ordered mode.

    Each registry entry is first built at a few micro-batches (:func:`_probe`) to compare its
    structure, which does not depend on M; only a matching entry is built at ``num_microbatches``,
    with default costs and with costs read off ``problem``'s stage 0, each with and without the
    memory limit (memory-aware generators adapt to it); the fastest valid variant represents the
    entry. Entries (and an entry's further variants) not started by ``deadline`` (a
    :func:`time.perf_counter` value) are skipped.
    """
    wanted = _structure(problem)
    stages_per_rank, extra = divmod(problem.num_stages, problem.num_ranks)
    limit = problem.memory_limit
    for info in REGISTRY.values():
        if deadline is not None and time.perf_counter() >= deadline:
            return
        if info.splits_backward != problem.splits_backward:
            continue
        options = {}
        if "stages_per_rank" in info.options:
            if extra or stages_per_rank < 1:
                continue
            options["stages_per_rank"] = stages_per_rank
        if not _probe(info.name, problem, num_microbatches, wanted, options):
            continue
        timelines = []
        costs_options = [Costs(), _costs_like(problem, stages_per_rank or 1)]
        for costs in dict.fromkeys(c for c in costs_options if c is not None):
            for cap in dict.fromkeys((None, limit)):
                if timelines and deadline is not None and time.perf_counter() >= deadline:
                    break  # out of time: keep the variants built so far
                built = _build(info.name, problem, num_microbatches, costs, cap, options)
                if built is not None and _structure(built.problem) != wanted:
                    break  # another placement: no cost or limit changes that
                timelines.append(_retarget(built, problem) if built is not None else None)
            else:
                continue
            break
        valid = [timeline for timeline in timelines if timeline is not None]
        if valid:
            yield info.name, min(valid, key=lambda timeline: timeline.makespan)


def _probe(name: str, problem: Problem, num_microbatches: int, wanted: dict, options: dict) -> bool:
    """Whether built-in ``name`` may fit ``problem``: built at ``2p`` then ``4p`` micro-batches (at
    most ``num_microbatches``), its structure must be ``wanted``. True when neither size builds
    (the family may only accept the full count; the full build decides)."""
    p = problem.num_ranks
    for small in dict.fromkeys(min(num_microbatches, k * p) for k in (2, 4)):
        built = _build(name, problem, small, Costs(), None, options)
        if built is not None:
            return _structure(built.problem) == wanted
    return True


def _build(name: str, problem: Problem, num_microbatches: int, costs: Costs, cap: float | None,
           options: dict) -> Schedule | None:
    """Built-in ``name`` for ``problem``'s shape; None when the family refuses it."""
    try:
        built = build_schedule(name, problem.num_ranks, num_microbatches, costs=costs,
                               memory_limit=cap, **options)
    except (ValueError, ImportError):  # the family refuses this shape or limit
        return None
    if built.num_microbatches != num_microbatches or built.num_ranks != problem.num_ranks:
        return None  # two-replica schedules count micro-batch pairs
    return built


def _retarget(built: Schedule, problem: Problem) -> Timeline | None:
    """``built``'s lists run on ``problem`` (its durations, memory, limit), validated in ordered
    mode; None when they break a rule there (e.g. the memory limit)."""
    name, num_microbatches = built.name, built.num_microbatches
    schedule = Schedule(name=name, problem=problem, num_microbatches=num_microbatches, ranks=built.ranks)
    try:
        return validate(schedule, ordered=True)
    except ValueError:  # over the limit (or another order rule) on this problem's costs
        return None


# ------------------------------------------------------------------------------- problem files


def problem_from_json(text: str) -> Problem:
    """A problem from JSON: ``num_ranks`` and ``tasks`` (as in the schedule format), optional
    ``comm_latency``, ``memory_limit`` and ``static_memory``; a whole schedule file also works
    (its problem is taken, its rank lists ignored)."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ScheduleFormatError(f"malformed JSON: {error}") from None
    if not isinstance(document, dict):
        raise ScheduleFormatError("a problem file must hold a JSON object with num_ranks and tasks")
    if "format" in document:
        return schedule_from_json(text).problem
    unknown = set(document) - _PROBLEM_KEYS
    if unknown:
        raise ScheduleFormatError(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_PROBLEM_KEYS)}")
    for key in ("num_ranks", "tasks"):
        if key not in document:
            raise ScheduleFormatError(f"problem: missing key {key!r}")
    ranks = document["num_ranks"]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1_000_000:
        raise ScheduleFormatError(f"problem.num_ranks: expected a positive integer, got {ranks!r}")
    wrapped = {**document, "format": FORMAT, "name": "problem", "num_microbatches": 1,
               "ranks": [[] for _ in range(ranks)]}
    try:
        return schedule_from_json(json.dumps(wrapped)).problem
    except ScheduleFormatError as error:
        message = str(error)
        raise ScheduleFormatError("problem." + message[len("schedule."):] if message.startswith("schedule.")
                                  else message) from None


def load_problem(path: str | Path) -> Problem:
    """:func:`problem_from_json` of a UTF-8 file; errors name the file."""
    path = Path(path)
    text = read_text(path)
    try:
        return problem_from_json(text)
    except ScheduleFormatError as error:
        raise ScheduleFormatError(f"{path}: {error}") from None
