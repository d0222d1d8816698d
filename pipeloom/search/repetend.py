"""The CP-SAT model of one steady-state period (Tessel's "repetend", with CP-SAT instead of Z3).

Micro-batch ``j = R * i + c`` runs task t at ``i * T + o_{c,t}`` with ``o_{c,t} = k * T + r``,
``0 <= r < T`` (a task may wrap around the period's end): every rank repeats the same pattern every
T, and k counts the periods a micro-batch has been in flight when t runs. Solved by
:mod:`pipeloom.search.periodic`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import ortools  # noqa: F401  (import OR-Tools before anything that may load SciPy)
from ortools.sat.python import cp_model

from pipeloom import graph
from pipeloom.problem import Problem
from pipeloom.search.common import IntegerProblem, period_lower_bound
from pipeloom.search.paths import topological_order

__all__ = ["GRID", "Repetend", "RepetendModel", "coarsen", "solver_period_bound", "steady_state_peak", "tie_position"]

GRID = 24
"""Solver time units given to the longest task: finer grids only slow the search down, since the
unrolled order is re-simulated with the real durations anyway."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Repetend:
    """A steady state in integer solver units with R micro-batches per period: micro-batch
    ``j = R * i + c`` runs task t at ``i * period + offsets[c][t]``."""

    period: int
    """T, integer time units (``IntegerProblem.time_scale`` per real unit) for R micro-batches."""
    offsets: tuple[tuple[int, ...], ...]
    """``offsets[c][t] = k * T + r`` with ``0 <= r < T``; one row per copy c in 0..R-1."""
    period_bound: int
    """Proven lower bound on T among repetends of R copies under the memory limit."""

    @property
    def copies(self) -> int:
        """R, micro-batches per period."""
        return len(self.offsets)

    def phase(self, copy: int, task: int) -> tuple[int, int]:
        """``(k, r)``: in-flight periods and phase of ``task`` in ``copy``."""
        return divmod(self.offsets[copy][task], self.period)


def coarsen(ip: IntegerProblem, grid: int = GRID) -> IntegerProblem:
    """``ip`` on a grid where the longest task takes about ``grid`` units (unchanged when it is
    shorter): ``d' = max(1, round(d * f))`` for ``d > 0``, same for latencies, ``f = grid / max d``."""
    longest = max(ip.durations)
    if longest <= grid:
        return ip
    f = grid / longest

    def scaled(value: int) -> int:
        return 0 if value == 0 else max(1, round(value * f))

    return replace(
        ip, time_scale=ip.time_scale * f, exact=False, durations=tuple(map(scaled, ip.durations)),
        deps=tuple(tuple((d, scaled(lat)) for d, lat in deps) for deps in ip.deps),
    )


def tie_position(problem: Problem) -> list[int]:
    """Topological position per task: ties in phase go by it, as in ``schedule_from_starts``."""
    position = [0] * len(problem.tasks)
    for p, t in enumerate(topological_order(problem)):
        position[t] = p
    return position


def _sequential(ip: IntegerProblem) -> tuple[list[int], int]:
    """One micro-batch alone, tasks in topological order as soon as possible: (starts, span).

    Copies of it back to back (``T = R * span``, copy c at offset ``c * span``) form a feasible
    repetend whenever one micro-batch's own memory fits: the hint and the period's upper bound.
    """
    problem = ip.problem
    free = [0] * problem.num_ranks
    starts = [0] * len(problem.tasks)
    for t in topological_order(problem):
        ready = max((starts[d] + ip.durations[d] + lat for d, lat in ip.deps[t]), default=0)
        start = max([ready] + [free[q] for q in problem.tasks[t].ranks])
        starts[t] = start
        for q in problem.tasks[t].ranks:
            free[q] = start + ip.durations[t]
    return starts, max(1, max(s + d for s, d in zip(starts, ip.durations)))


def solver_period_bound(ip: IntegerProblem, limits: Sequence[int | None]) -> float:
    """:func:`~pipeloom.search.common.period_lower_bound` in solver units (``ip``'s durations,
    latencies and memory, rank q's room ``limits[q]`` above its static memory): the least time per
    micro-batch of any steady state, so ``T >= R * bound`` for R copies."""
    latency = max((lat for deps in ip.deps for _, lat in deps), default=0)
    tasks = tuple(replace(task, duration=float(d), memory=float(m))
                  for task, d, m in zip(ip.problem.tasks, ip.durations, ip.memory))
    limit, static = None, None
    rooms = [room for room in limits if room is not None]
    if len(rooms) == len(limits):  # every rank limited: room_q = limit - static_q
        limit = float(max(rooms))
        static = tuple(limit - room for room in rooms)
    solver_units = replace(ip.problem, tasks=tasks, comm_latency=float(latency), memory_limit=limit,
                           static_memory=static)
    return period_lower_bound(solver_units)


def _heads(ip: IntegerProblem) -> list[int]:
    """Longest path (integer units) from a micro-batch's start to each task's start."""
    return graph.head_tail(topological_order(ip.problem), ip.deps, ip.durations, 0)[0]


class RepetendModel:
    """CP-SAT model of one period holding R copies of the micro-batch's tasks.

    Data: durations d_t, memory changes m_t, deps with latency, per-rank limits L_q. A slot
    ``s = (c, t)`` is task t of copy c; its variables are the phase r_s, the offset o_s and the
    one-hot in-flight count k_s. T is a variable, ``R * P <= T`` with P the least time per
    micro-batch (:func:`solver_period_bound`); its objective is minimised.
    """

    def __init__(self, ip: IntegerProblem, *, copies: int, limits: Sequence[int | None],
                 minimise_memory: bool = False, period_max: int | None = None) -> None:
        self.ip, self.problem, self.copies = ip, ip.problem, copies
        self.n = len(ip.durations)
        self.slots = [(c, t) for c in range(copies) for t in range(self.n)]
        self.on_rank = [[(c, t) for c in range(copies) for t, task in enumerate(self.problem.tasks) if q in task.ranks]
                        for q in range(self.problem.num_ranks)]
        position = tie_position(self.problem)
        self.key = {(c, t): (position[t], c) for c, t in self.slots}
        """Tie order of slots starting at the same phase (as :func:`unroll` orders them)."""
        self.sequential, self.span = _sequential(ip)
        latency = max((lat for deps in ip.deps for _, lat in deps), default=0)
        self.bound = solver_period_bound(ip, limits)
        """Least time per micro-batch (busiest rank's work, memory-time area / room): T >= R * bound."""
        self.period_low = max(1, math.ceil(copies * self.bound * (1 - 1e-12)))
        self.period_high = max(self.period_low, copies * self.span, sum(ip.durations) * copies + self.n * latency)
        if period_max is not None:
            self.period_high = min(self.period_high, period_max)
        self.k_max = min(self.n * copies, math.ceil(2 * self.span / self.period_low)) + 1
        self.model = cp_model.CpModel()
        self._variables()
        self._window()
        self._periods()
        self._precedence()
        self._microbatch_order()
        self._no_overlap()
        self._phase_order()
        self.peak = self._memory(limits, minimise_memory)
        self.model.minimize(self.period if self.peak is None else self.peak)
        self._hint()

    def minimise_span(self, repetend: Repetend) -> None:
        """Second objective at a fixed period: ``min max_s (o_s + d_s) - min_t o_{0,t}``, the latency
        of a repetend; the warm-up and cool-down that re-simulation cannot remove grow with it."""
        m = self.model
        m.add(self.period == repetend.period)
        first = m.new_int_var(0, (self.k_max + 1) * self.period_high, "first")
        last = m.new_int_var(0, (self.k_max + 2) * self.period_high, "last")
        m.add_min_equality(first, [self.offset[0, t] for t in range(self.n)])
        m.add_max_equality(last, [self.offset[s] + self.ip.durations[s[1]] for s in self.slots])
        m.minimize(last - first)
        m.clear_hints()
        for c, row in enumerate(repetend.offsets):
            for t, o in enumerate(row):
                k, r = repetend.phase(c, t)
                m.add_hint(self.offset[c, t], o)
                m.add_hint(self.phase[c, t], r)
                for value, x in enumerate(self.in_period[c, t]):
                    m.add_hint(x, value == k)

    def _variables(self) -> None:
        m, hi = self.model, self.period_high
        head = _heads(self.ip)
        self.period = m.new_int_var(self.period_low, hi, "T")
        self.phase = {s: m.new_int_var(0, hi - 1, f"r{s}") for s in self.slots}
        self.offset = {s: m.new_int_var(head[s[1]], (self.k_max + 1) * hi, f"o{s}") for s in self.slots}
        self.in_period = {s: [m.new_bool_var(f"x{s},{k}") for k in range(self.k_max + 1)] for s in self.slots}
        self.flight = {s: sum(k * x for k, x in enumerate(xs)) for s, xs in self.in_period.items()}
        """k_s as a linear expression of its one-hot literals."""

    def _window(self) -> None:
        """Phases lie in one period: ``0 <= r_s <= T - 1`` (so o_s splits uniquely into k_s, r_s);
        ``d_t <= T``; a task may wrap around the period's end (see :meth:`_no_overlap`)."""
        for (_c, t), r in self.phase.items():
            self.model.add(r + 1 <= self.period)
            self.model.add(self.ip.durations[t] <= self.period)

    def _periods(self) -> None:
        """``o_s = k_s * T + r_s`` with k_s one-hot: ``x_{s,k} => o_s = k * T + r_s``,
        ``sum_k x_{s,k} = 1``; some slot has ``k_s = 0`` (shifting every k_s by one changes nothing)."""
        for s, xs in self.in_period.items():
            self.model.add_exactly_one(xs)
            for k, x in enumerate(xs):
                self.model.add(self.offset[s] == k * self.period + self.phase[s]).only_enforce_if(x)
        self.model.add_bool_or([xs[0] for xs in self.in_period.values()])

    def _precedence(self) -> None:
        """``o_{c,t} >= o_{c,d} + d_d + latency(d, t)`` for each dep d of t (same micro-batch)."""
        for c, t in self.slots:
            for d, lat in self.ip.deps[t]:
                self.model.add(self.offset[c, t] >= self.offset[c, d] + self.ip.durations[d] + lat)

    def _microbatch_order(self) -> None:
        """Each task runs its micro-batches in order: ``o_{c,t} <= o_{c+1,t}`` and
        ``o_{R-1,t} <= o_{0,t} + T`` (micro-batch R*i + R-1 before R*(i+1))."""
        last = self.copies - 1
        for t in range(self.n):
            for c in range(last):
                self.model.add(self.offset[c, t] <= self.offset[c + 1, t])
            if last:
                self.model.add(self.offset[last, t] <= self.offset[0, t] + self.period)

    def _no_overlap(self) -> None:
        """Per rank q, cyclic: the arcs ``[r_s, r_s + d_s) mod T`` of its slots are disjoint, i.e. the
        intervals ``[r_s, r_s + d_s)`` and ``[r_s + T, r_s + T + d_s)`` of all of them are (two arcs
        meet on the circle iff one of the copy pairs meets on the line, given ``d_s <= T``)."""
        shifted: dict[tuple[int, int], cp_model.IntVar] = {}
        for q, slots in enumerate(self.on_rank):
            intervals = []
            for s in slots:
                d = self.ip.durations[s[1]]
                if d == 0:
                    continue  # a zero-length action occupies nothing; re-simulation places it
                if s not in shifted:
                    shifted[s] = self.model.new_int_var(0, 2 * self.period_high, f"z{s}")
                    self.model.add(shifted[s] == self.phase[s] + self.period)
                intervals.append(self.model.new_fixed_size_interval_var(self.phase[s], d, f"i{s},{q}"))
                intervals.append(self.model.new_fixed_size_interval_var(shifted[s], d, f"j{s},{q}"))
            if len(intervals) > 2:
                self.model.add_no_overlap(intervals)

    def _phase_order(self) -> None:
        """For slots s, u sharing a rank with key_s < key_u: ``b_{s,u} = [(r_s, key_s) < (r_u, key_u)]``
        (``b => r_s <= r_u``, ``not b => r_s >= r_u + 1``): the order the rank starts them in each
        period, ties by topological position as when unrolling."""
        self.before: dict[tuple[tuple[int, int], tuple[int, int]], cp_model.LinearExprT] = {}
        pairs = {(min(s, u, key=self.key.__getitem__), max(s, u, key=self.key.__getitem__))
                 for slots in self.on_rank for s in slots for u in slots if s != u}
        for s, u in sorted(pairs):
            b = self.model.new_bool_var(f"b{s},{u}")
            self.model.add(self.phase[u] >= self.phase[s]).only_enforce_if(b)
            self.model.add(self.phase[s] >= self.phase[u] + 1).only_enforce_if(~b)
            self.before[s, u] = b
            self.before[u, s] = 1 - b

    def _memory(self, limits: Sequence[int | None], minimise: bool) -> cp_model.IntVar | None:
        """Held memory on rank q right after slot u starts, in steady state (balanced ranks,
        ``sum_t m_t = 0``): ``M_q(u) = m_u + sum_{s != u} m_s * b_{s,u} - sum_s m_s * k_s <= L_q``
        (micro-batch i of slot s has started by time n*T + r_u iff ``i <= n - k_s - 1 + [s before u]``,
        and the n terms cancel). Peaks follow a positive change: only events with ``m_u > 0``."""
        memory = self.ip.memory
        static = self.problem.static_memory or (0.0,) * self.problem.num_ranks
        peak = None
        if minimise:
            peak = self.model.new_int_var(0, sum(abs(m) for m in memory) * self.copies * (self.k_max + 2), "peak")
        for q, slots in enumerate(self.on_rank):
            limit = limits[q]
            if sum(memory[t] for _, t in slots) != 0 or (limit is None and peak is None):
                continue  # unbalanced ranks grow with M: left to the final validation
            held = -sum(memory[s[1]] * self.flight[s] for s in slots)
            for u in slots:
                if memory[u[1]] <= 0:
                    continue
                level = held + memory[u[1]] + sum(memory[s[1]] * self.before[s, u] for s in slots if s != u)
                if peak is not None:
                    self.model.add(level + round(static[q] * self.ip.memory_scale) <= peak)
                elif limit is not None:
                    self.model.add(level <= limit)
        return peak

    def _hint(self) -> None:
        """Warm start: one micro-batch at a time (``T = R * span``, copy c at ``c * span``, ``k = 0``)."""
        period = max(self.copies * self.span, self.period_low)
        if period > self.period_high:
            return
        self.model.add_hint(self.period, period)
        for c, t in self.slots:
            start = c * self.span + self.sequential[t]
            self.model.add_hint(self.phase[c, t], start)
            self.model.add_hint(self.offset[c, t], start)
            for k, x in enumerate(self.in_period[c, t]):
                self.model.add_hint(x, k == 0)

    def repetend(self, solver: cp_model.CpSolver) -> Repetend:
        bound = max(self.period_low, math.ceil(solver.best_objective_bound - 1e-9))
        offsets = tuple(tuple(solver.value(self.offset[c, t]) for t in range(self.n)) for c in range(self.copies))
        return Repetend(period=solver.value(self.period), offsets=offsets, period_bound=bound)


def steady_state_peak(ip: IntegerProblem, repetend: Repetend) -> tuple[float, ...]:
    """Per-rank peak held memory of the steady state, real units, static memory included.

    With ``k_s, r_s = divmod(o_s, T)`` for each slot s = (copy, task) of rank q in phase order
    (ties by topological position, then copy), the held memory right after u starts is
    ``sum_{s <= u} m_s - sum_s m_s * k_s``; the peak is the largest of those and of the level
    before the period's first start (``- sum_s m_s * k_s``, the level after its last too when the
    rank is balanced). Unbalanced ranks (``sum_t m_t != 0``) have no steady state: ``inf``.
    """
    problem, position = ip.problem, tie_position(ip.problem)
    static = problem.static_memory or (0.0,) * problem.num_ranks
    peaks = []
    for q in range(problem.num_ranks):
        slots = [(c, t) for c in range(repetend.copies) for t, task in enumerate(problem.tasks) if q in task.ranks]
        if sum(ip.memory[t] for _, t in slots) != 0:
            peaks.append(math.inf)
            continue
        order = sorted(slots, key=lambda s: (repetend.phase(*s)[1], position[s[1]], s[0]))
        level = -sum(ip.memory[t] * repetend.phase(c, t)[0] for c, t in slots)
        peak = level
        for _, t in order:
            level += ip.memory[t]
            peak = max(peak, level)
        peaks.append(peak / ip.memory_scale + static[q])
    return tuple(peaks)
