"""Exact mode: one CP-SAT model over every (task, micro-batch), minimising the makespan under the
memory limit, warm-started from the list schedule and the caller's hints; returns a proven bound.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import ortools  # noqa: F401 - import OR-Tools before anything that may load SciPy
from ortools.sat.python import cp_model

from pipeloom import graph
from pipeloom.errors import ScheduleError
from pipeloom.ir import Action, Schedule
from pipeloom.problem import Problem
from pipeloom.search.common import IntegerProblem, lower_bound, schedule_from_starts, to_integers
from pipeloom.search.cpsat import found_solution, meets_bound, status_word
from pipeloom.search.errors import SearchError
from pipeloom.search.greedy import feasible_limit_note, list_schedule
from pipeloom.search.memory_bounds import limit_of
from pipeloom.search.paths import topological_order
from pipeloom.search.repetend import coarsen
from pipeloom.search.result import SearchProgress, SearchResult
from pipeloom.search.steady import solve_repetend, unroll
from pipeloom.sim import simulate
from pipeloom.validate import validate

__all__ = ["MAX_EXACT_INTERVALS", "PERIODIC_SHARE", "solve_exact"]

MAX_EXACT_INTERVALS = 20_000
"""Above this many (task, micro-batch) intervals :func:`solve_exact` builds no CP-SAT model (it
would take minutes and gigabytes just to build): it answers the best of the list schedule, the
hints and the periodic warm start, status ``feasible`` unless it meets the lower bound."""

PERIODIC_SHARE = 0.1
"""Share of the time limit the periodic warm start (a repetend unrolled) may take."""

Starts = dict[tuple[int, int], int]

logger = logging.getLogger(__name__)


class _Model:
    """The exact scheduling model, in integer time and memory units.

    Data: tasks t with duration d_t, memory change m_t, ranks R_t and deps (u, lat_ut); micro-batches
    j = 0..M-1; horizon H (the best known schedule's makespan); per-rank limit L_r; a floor F that
    no schedule beats (the analytic lower bound, 0 when scaling rounded values).
    Variables: start s_tj, interval [s_tj, s_tj + d_t) (one per (t, j), shared by all ranks of t),
    makespan C. Objective: minimise C.
    """

    def __init__(self, integer: IntegerProblem, num_microbatches: int, horizon: int, floor: int = 0) -> None:
        self.integer, self.num_mb, self.horizon, self.floor = integer, num_microbatches, horizon, floor
        self.tasks = range(len(integer.durations))
        self.microbatches = range(num_microbatches)
        self.model = cp_model.CpModel()
        self._variables()
        self._no_overlap()
        self._precedences()
        self._microbatch_order()
        self._memory()
        self._objective()

    def _heads_tails(self) -> tuple[list[int], list[int]]:
        """Longest dependency path before each task's start (head) and after its end (tail)."""
        ip = self.integer
        return graph.head_tail(topological_order(ip.problem), ip.deps, ip.durations, 0)

    def _variables(self) -> None:
        """``head_t + j d_t <= s_tj <= H - tail_t - (M - j) d_t`` (earlier copies of t run first)."""
        d, m, h = self.integer.durations, self.num_mb, self.horizon
        head, tail = self._heads_tails()
        self.start, self.end, self.interval = {}, {}, {}
        for t in self.tasks:
            for j in self.microbatches:
                low = head[t] + j * d[t]
                high = max(low, h - tail[t] - (m - j) * d[t])
                s = self.model.new_int_var(low, high, f"s_{t}_{j}")
                self.start[t, j] = s
                self.end[t, j] = s + d[t]
                self.interval[t, j] = self.model.new_fixed_size_interval_var(s, d[t], f"x_{t}_{j}")
        self.makespan = self.model.new_int_var(min(self.floor, h), h, "makespan")

    def _no_overlap(self) -> None:
        """For each rank r: the intervals of {(t, j) : r in R_t} do not overlap."""
        for rank in range(self.integer.problem.num_ranks):
            on_rank = [t for t in self.tasks if rank in self.integer.problem.tasks[t].ranks]
            if on_rank:
                self.model.add_no_overlap([self.interval[t, j] for t in on_rank for j in self.microbatches])

    def _precedences(self) -> None:
        """``s_tj >= s_uj + d_u + lat_ut`` for every dep u of t, every micro-batch j."""
        for t in self.tasks:
            for u, lat in self.integer.deps[t]:
                for j in self.microbatches:
                    self.model.add(self.start[t, j] >= self.end[u, j] + lat)

    def _microbatch_order(self) -> None:
        """``s_t,j+1 >= s_tj + d_t``: each task's micro-batches in order.

        Loses nothing: relabelling each task's copies by start time (in dependency order) keeps every
        precedence, every rank's busy times and memory; it breaks the M! symmetry and gives the
        micro-batch-ordered B/W that exact gradients need.
        """
        for t in self.tasks:
            for j in self.microbatches[:-1]:
                self.model.add(self.start[t, j + 1] >= self.end[t, j])

    def _memory(self) -> None:
        """Per limited rank r, at every time τ: ``sum_{(t, j): r in R_t, s_tj <= τ} m_t <= L_r``
        (memory changes when an action starts); a reservoir constraint."""
        ip = self.integer
        for rank, limit in enumerate(ip.limits):
            if limit is None:
                continue
            events = [
                (self.start[t, j], ip.memory[t])
                for t in self.tasks
                if rank in ip.problem.tasks[t].ranks and ip.memory[t] != 0
                for j in self.microbatches
            ]
            if not events:
                continue
            lowest = min(0, sum(change for _, change in events if change < 0))
            times, changes = zip(*events)
            self.model.add_reservoir_constraint(list(times), list(changes), lowest, limit)

    def _objective(self) -> None:
        """``C >= s_t,M-1 + d_t`` for every t (the last copy of each task ends last), ``C >= F``
        (redundant: F bounds every schedule, so it only lets the solver stop as soon as it meets
        F); minimise C."""
        for t in self.tasks:
            self.model.add(self.makespan >= self.end[t, self.num_mb - 1])
        self.model.minimize(self.makespan)

    def hint(self, starts: Starts) -> None:
        """Warm start from a known schedule's integer start times."""
        for key, value in starts.items():
            self.model.add_hint(self.start[key], value)
        self.model.add_hint(self.makespan, max(
            value + self.integer.durations[t] for (t, _), value in starts.items()
        ))

    def starts(self, solver: cp_model.CpSolver) -> Starts:
        """Start times of the solver's solution."""
        return {key: solver.value(var) for key, var in self.start.items()}


class _Progress(cp_model.CpSolverSolutionCallback):
    """Reports (best, bound) in real units on every improving solution."""

    def __init__(self, report: Callable[[SearchProgress], None], began: float, integer: IntegerProblem,
                 floor: float) -> None:
        super().__init__()
        self.report, self.began, self.floor = report, began, floor
        self.scale, self.exact = integer.time_scale, integer.exact

    def on_solution_callback(self) -> None:
        bound = self.floor
        if self.exact:
            bound = max(bound, self.BestObjectiveBound() / self.scale)
        self.report(SearchProgress(
            seconds=time.perf_counter() - self.began,
            best=self.ObjectiveValue() / self.scale,
            bound=bound,
            phase="exact",
        ))


def solve_exact(
    problem: Problem,
    num_microbatches: int,
    *,
    memory_limit: float | None = None,
    time_limit: float = 10.0,
    workers: int = 2,
    hints: Sequence[Schedule] = (),
    progress: Callable[[SearchProgress], None] | None = None,
    name: str = "search",
) -> SearchResult:
    """The fastest schedule of ``problem`` for ``num_microbatches`` under the memory limit.

    ``memory_limit`` overrides the problem's own. The model's horizon is the best valid schedule
    among the list schedule and ``hints`` (invalid or over-limit hints are skipped), which also
    warm-starts the solver. The result re-simulates the solver's order; its lower bound is the
    analytic :func:`~pipeloom.search.common.lower_bound` under the effective limit (its memory-time
    term included), raised to the solver's bound where scaling was exact.
    Above :data:`MAX_EXACT_INTERVALS` intervals no model is built: the best of those warm starts
    is the answer (SearchError if there is none).
    Raises SearchError when no schedule meets the limit (naming the smallest feasible limit
    when it is known).
    """
    began = time.perf_counter()
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise SearchError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    limit = limit_of(problem, memory_limit)
    if limit != problem.memory_limit:
        problem = replace(problem, memory_limit=limit)
    integer = to_integers(problem, memory_limit=limit, num_microbatches=num_microbatches)
    if any(cap is not None and cap < 0 for cap in integer.limits):
        raise SearchError(
            f"memory limit {limit:g} is below the static memory of a rank "
            f"({max(problem.static_memory or (0.0,)):g}); raise the limit"
        )
    deadline = began + time_limit
    known, greedy_error = _known_schedules(problem, num_microbatches, hints, name, deadline=deadline)
    best = min(known, key=lambda pair: pair[1], default=None)
    analytic = lower_bound(problem, num_microbatches, memory_limit=limit)
    if best is not None and best[1] <= analytic * (1 + 1e-12):
        return _result(best[0], best[1], analytic, began, integer)  # already optimal
    periodic = _periodic_schedule(problem, num_microbatches, name, PERIODIC_SHARE * time_limit, workers)
    if periodic is not None and (best is None or periodic[1] < best[1]):
        best = periodic
        if best[1] <= analytic * (1 + 1e-12):
            return _result(best[0], best[1], analytic, began, integer)
    intervals = len(problem.tasks) * num_microbatches
    if intervals > MAX_EXACT_INTERVALS:
        if best is None:
            raise SearchError(
                f"{intervals:,} intervals (tasks x micro-batches) are too many for the exact model "
                f"(at most {MAX_EXACT_INTERVALS:,}) and no list, periodic or hinted schedule meets the "
                f"memory limit {limit:g}; use --mode periodic, fewer micro-batches or a higher limit"
            )
        return _result(best[0], best[1], analytic, began, integer)

    status, starts, proven = _solve(integer, num_microbatches, best, analytic, deadline, workers,
                                    progress and _Progress(progress, began, integer, analytic))
    logger.debug("%s: CP-SAT status %s after %.1f s, bound %s", name, status, time.perf_counter() - began,
                 proven)
    if starts is not None:
        found = _checked(problem, num_microbatches, name, starts)
        if found is not None and (best is None or found[1] <= best[1]):
            best = found
    if best is None:
        raise SearchError(_no_schedule_message(problem, num_microbatches, status, time_limit, greedy_error,
                                               deadline=deadline))
    bound = analytic if proven is None else max(analytic, proven)
    return _result(best[0], best[1], min(bound, best[1]), began, integer)


def _solve(
    integer: IntegerProblem,
    num_microbatches: int,
    best: tuple[Schedule, float] | None,
    analytic: float,
    deadline: float,
    workers: int,
    callback: cp_model.CpSolverSolutionCallback | None,
) -> tuple[cp_model.CpSolverStatus, Starts | None, float | None]:
    """Build and solve the model within the best known makespan, warm-started from it, with the
    analytic lower bound as the makespan's floor where scaling was exact; the solver gets the time
    left until ``deadline`` (a :func:`time.perf_counter` value) once the model is built, and does
    not run (status UNKNOWN) when none is left.

    Returns the solver status, the solution's start times (None without one) and the proven
    lower bound in real units (None when scaling rounded values, as it then bounds another problem).
    """
    if best is not None:
        hint_starts = _integer_starts(best[0], integer)
        horizon = max(value + integer.durations[t] for (t, _), value in hint_starts.items())
    else:
        hint_starts = None
        horizon = _serial_horizon(integer, num_microbatches)
    floor = math.ceil(analytic * integer.time_scale * (1 - 1e-9)) if integer.exact else 0
    model = _Model(integer, num_microbatches, horizon, floor)
    if hint_starts is not None:
        model.hint(hint_starts)
    left = deadline - time.perf_counter()  # building the model counts
    if left <= 0.01:
        return cp_model.UNKNOWN, None, None
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = left
    solver.parameters.num_workers = max(1, int(workers))
    status = solver.solve(model.model, callback)
    if not found_solution(status):
        return status, None, None
    proven = None
    if integer.exact:
        value = solver.objective_value if status == cp_model.OPTIMAL else solver.best_objective_bound
        proven = value / integer.time_scale
    return status, model.starts(solver), proven


def _known_schedules(
    problem: Problem, num_microbatches: int, hints: Sequence[Schedule], name: str, *, deadline: float
) -> tuple[list[tuple[Schedule, float]], SearchError | None]:
    """``(schedule, makespan)`` of the list schedule (if done by ``deadline``) and each valid hint,
    renamed ``name``, under ``problem`` (its limit); the list scheduler's error when it found none."""
    known = []
    greedy_error = None
    try:
        known.append(_checked_schedule(list_schedule(problem, num_microbatches, name=name, deadline=deadline)))
    except SearchError as error:
        greedy_error = error
    for hint in hints:
        other = hint.problem
        if (hint.num_microbatches != num_microbatches or other.tasks != problem.tasks
                or other.num_ranks != problem.num_ranks or other.comm_latency != problem.comm_latency
                or other.static_memory != problem.static_memory):
            continue
        try:
            known.append(_checked_schedule(replace(hint, name=name, problem=problem)))
        except ScheduleError:
            continue
    return known, greedy_error


def _periodic_schedule(
    problem: Problem, num_microbatches: int, name: str, time_limit: float, workers: int
) -> tuple[Schedule, float] | None:
    """The periodic mode's repetend unrolled to ``num_microbatches`` (a warm start that is often
    optimal already), with its makespan; None when none is found in ``time_limit`` or it fails
    validation (e.g. its warm-up exceeds the limit)."""
    try:
        repetend = solve_repetend(coarsen(to_integers(problem)), time_limit=time_limit, workers=workers)
        if repetend is None:
            return None
        return _checked_schedule(unroll(problem, repetend, num_microbatches, name=name))
    except (SearchError, ScheduleError):
        return None


def _checked_schedule(schedule: Schedule) -> tuple[Schedule, float]:
    """The schedule and its makespan, after the full (ordered, memory-limited) validation."""
    return schedule, validate(schedule, ordered=True).makespan


def _checked(problem: Problem, num_microbatches: int, name: str, starts: Starts) -> tuple[Schedule, float] | None:
    """The order the solver's start times give, re-simulated; None if it does not validate.

    Actions of zero duration can share a start time with another action of their rank; the
    reservoir sees only the sum of their memory changes there, so if the default tie order (by
    dependency position) overshoots the limit, the order freeing memory first is tried.
    """
    memory = [task.memory for task in problem.tasks]
    for nudge in (0.0, 0.25):
        shifted = {(t, j): start + (nudge if memory[t] > 0 else 0.0) for (t, j), start in starts.items()}
        schedule = schedule_from_starts(problem, name=name, num_microbatches=num_microbatches, starts=shifted)
        try:
            return _checked_schedule(schedule)
        except ScheduleError:
            continue
    return None


def _integer_starts(schedule: Schedule, integer: IntegerProblem) -> Starts:
    """Start times of ``schedule`` re-simulated with the integer durations and latency."""
    problem = integer.problem
    scaled = replace(
        problem,
        tasks=tuple(replace(task, duration=float(d)) for task, d in zip(problem.tasks, integer.durations)),
        comm_latency=float(round(problem.comm_latency * integer.time_scale)),
        memory_limit=None,
    )
    timeline = simulate(replace(schedule, problem=scaled))
    return {
        (problem.index(action.task), action.microbatch): round(start)
        for action, (start, _) in timeline.action_times().items() if type(action) is Action
    }


def _serial_horizon(integer: IntegerProblem, num_microbatches: int) -> int:
    """A makespan every feasible order beats: all actions one after another, each after its latency."""
    latency = max((lat for deps in integer.deps for _, lat in deps), default=0)
    return num_microbatches * sum(d + latency for d in integer.durations)


def _no_schedule_message(problem: Problem, num_microbatches: int, status: cp_model.CpSolverStatus, time_limit: float,
                         greedy: SearchError | None, *, deadline: float) -> str:
    """Why no schedule came back, with the smallest feasible limit as far as it is known."""
    limit = problem.memory_limit
    known = feasible_limit_note(problem, num_microbatches, deadline=deadline)
    if status == cp_model.INFEASIBLE:
        return (
            f"no schedule keeps every rank within the memory limit {limit:g} (proven by the exact "
            f"search); {known}; raise the limit"
        )
    return (
        f"the exact search found no schedule within the memory limit {limit:g} in {time_limit:g} s "
        f"({greedy}); {known}; raise the limit or the time limit"
    )


def _result(schedule: Schedule, makespan: float, bound: float, began: float, integer: IntegerProblem) -> SearchResult:
    optimal = meets_bound(makespan, bound)
    return SearchResult(
        schedule=schedule,
        status=status_word(optimal),
        mode="exact",
        makespan=makespan,
        lower_bound=makespan if optimal else bound,
        seconds=time.perf_counter() - began,
        peak_memory=simulate(schedule).peak_memory,
        time_scale=integer.time_scale,
    )
