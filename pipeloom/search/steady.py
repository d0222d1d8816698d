"""Solving and unrolling repetends (:mod:`pipeloom.search.repetend`): the shortest period under
the memory limit, the least memory any repetend needs, and the per-rank lists of M micro-batches
one repetend gives. Periodic mode and the exact search's warm start both build on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import ortools  # noqa: F401  (import OR-Tools before anything that may load SciPy)
from ortools.sat.python import cp_model

from pipeloom.ir import Schedule
from pipeloom.problem import Problem
from pipeloom.search.common import IntegerProblem, schedule_from_starts
from pipeloom.search.cpsat import found_solution
from pipeloom.search.errors import SearchError
from pipeloom.search.repetend import Repetend, RepetendModel
from pipeloom.search.result import SearchProgress

__all__ = ["Progress", "smallest_limit", "solve_repetend", "unroll"]

Progress = Callable[[SearchProgress], None]
"""Called with each improving solution."""


class _Reporter(cp_model.CpSolverSolutionCallback):
    """Relays each improving solution to ``progress`` in real units."""

    def __init__(self, progress: Progress, scale: float, begin: float, phase: str) -> None:
        super().__init__()
        self.progress, self.scale, self.begin, self.phase_name = progress, scale, begin, phase

    def on_solution_callback(self) -> None:
        self.progress(SearchProgress(seconds=time.perf_counter() - self.begin,
                                     best=self.objective_value / self.scale,
                                     bound=self.best_objective_bound / self.scale, phase=self.phase_name))


def _solve(model: RepetendModel, *, time_limit: float, workers: int, progress: Progress | None,
           scale: float, phase: str) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit)
    solver.parameters.num_workers = max(1, workers)
    callback = _Reporter(progress, scale, time.perf_counter(), phase) if progress else None
    status = solver.solve(model.model, callback)
    return solver, status


def _better(a: Repetend | None, b: Repetend) -> bool:
    """Whether b's time per micro-batch ``T / R`` beats a's."""
    return a is None or b.period * a.copies < a.period * b.copies


def solve_repetend(ip: IntegerProblem, *, copies: Sequence[int] = (1, 2, 3), time_limit: float = 10.0,
                   workers: int = 2, progress: Progress | None = None) -> Repetend | None:
    """The repetend with the least time per micro-batch ``T / R`` under ``ip.limits``, trying R in
    ``copies`` in turn (each a share of ``time_limit``, each asked to beat the best so far); stops at the
    period lower bound (work and memory-time area per micro-batch). None when a limit admits no repetend at
    all (decided with R = 1)."""
    begin, best = time.perf_counter(), None
    for i, r in enumerate(copies):
        left = time_limit - (time.perf_counter() - begin)
        if left <= 0.05 and best is not None:
            break
        cap = None if best is None else (best.period * r - 1) // best.copies
        model = RepetendModel(ip, copies=r, limits=ip.limits, period_max=cap)
        if cap is not None and cap < model.period_low:
            continue
        left = time_limit - (time.perf_counter() - begin)  # building the model counts
        if left <= 0.01:
            break
        solver, status = _solve(model, time_limit=left / (len(copies) - i), workers=workers,
                                progress=progress, scale=ip.time_scale * r, phase=f"period ({r} per period)")
        if found_solution(status):
            found = model.repetend(solver)
            if _better(best, found):
                best = found
            if found.period <= r * model.bound * (1 + 1e-12):
                break  # T / R reached the period lower bound: no R does better
        elif status == cp_model.INFEASIBLE and best is None:
            return None
    if best is None:
        raise SearchError(f"no periodic schedule found within {time_limit:g} s; raise the time limit")
    left = time_limit - (time.perf_counter() - begin)
    if left > 0.05:
        best = _shortest_latency(ip, best, time_limit=min(left, time_limit / 4), workers=workers)
    return best


def _shortest_latency(ip: IntegerProblem, best: Repetend, *, time_limit: float, workers: int) -> Repetend:
    """The same period with the least micro-batch latency (see :meth:`RepetendModel.minimise_span`)."""
    began = time.perf_counter()
    model = RepetendModel(ip, copies=best.copies, limits=ip.limits, period_max=best.period)
    model.minimise_span(best)
    left = time_limit - (time.perf_counter() - began)  # building the model counts
    if left <= 0.01:
        return best
    solver, status = _solve(model, time_limit=left, workers=workers, progress=None, scale=1.0, phase="latency")
    if not found_solution(status):
        return best
    found = model.repetend(solver)
    return replace(found, period_bound=best.period_bound)


def smallest_limit(ip: IntegerProblem, *, time_limit: float, workers: int) -> float | None:
    """The lowest per-rank peak (static included, real units) any one-copy repetend reaches, if found."""
    model = RepetendModel(ip, copies=1, limits=(None,) * ip.problem.num_ranks, minimise_memory=True)
    solver, status = _solve(model, time_limit=time_limit, workers=workers, progress=None, scale=1.0, phase="memory")
    if not found_solution(status) or model.peak is None:  # minimise_memory makes the peak variable
        return None
    return solver.value(model.peak) / ip.memory_scale


def unroll(problem: Problem, repetend: Repetend, num_microbatches: int, *, name: str = "periodic") -> Schedule:
    """Per-rank lists of ``starts[(t, R*i + c)] = i * T + o_{c,t}`` in start order (ties: topological
    position, then micro-batch), for micro-batches 0..M-1: O(M log M) time."""
    period, rows = repetend.period, repetend.copies
    starts = {
        (t, j): (j // rows) * period + repetend.offsets[j % rows][t]
        for t in range(len(problem.tasks)) for j in range(num_microbatches)
    }
    return schedule_from_starts(problem, name=name, num_microbatches=num_microbatches, starts=starts)
