"""Shared pieces of the schedule search: integer scaling, lower bounds, orders from start times."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal

from pipeloom import graph
from pipeloom.ir import Action, Schedule
from pipeloom.problem import Problem
from pipeloom.search.cpsat import integer_scale, to_units
from pipeloom.search.errors import SearchError
from pipeloom.search.memory_bounds import (
    limit_of,
    memory_bound,
    memory_period_bound,
    release_chain_bound,
)
from pipeloom.search.paths import dep_indices, head_tail, topological_order
from pipeloom.search.transforms import without_all_rank_tasks

__all__ = [
    "MAX_SCALED",
    "IntegerProblem",
    "all_rank_bound",
    "forced_idle",
    "lower_bound",
    "period_lower_bound",
    "schedule_from_starts",
    "to_integers",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class IntegerProblem:
    """A problem with times and memory scaled to integers for CP-SAT (``int = round(real * scale)``)."""

    problem: Problem
    """The original problem."""
    time_scale: float
    """Integer time units per real time unit."""
    memory_scale: float
    """Integer memory units per real memory unit."""
    exact: bool
    """True when scaling lost nothing (every duration, latency and memory became a whole number)."""
    durations: tuple[int, ...]
    """Per task (index into ``problem.tasks``)."""
    memory: tuple[int, ...]
    """Per task: held-memory change at its start."""
    deps: tuple[tuple[tuple[int, int], ...], ...]
    """Per task: ``(dep task index, latency)`` with the latency already 0 on the same rank set."""
    limits: tuple[int | None, ...]
    """Per rank: memory the actions may add on top of its static memory (None = unlimited)."""


def _scale_for(values: list[float], resolution: int) -> tuple[float, bool]:
    """Smallest power of ten (up to ``resolution``) making every value whole, else a fitted scale."""
    top = max((abs(v) for v in values), default=1.0) or 1.0
    return integer_scale(values, top=top, fitted=resolution, most=resolution)


def _approximately(count: int) -> str:
    """``count`` to three significant digits (``{:.3g}``), also past the float range."""
    try:
        return f"{count:.3g}"
    except OverflowError:  # an int above ~1.8e308 has no float; Decimal rounds it the same way
        mantissa, _, exponent = format(Decimal(count), ".2e").partition("e")
        return f"{float(mantissa):.3g}e{exponent}"


MAX_SCALED = 2**53
"""Largest integer a scaled quantity may reach (CP-SAT works in int64 and sums these; floats stay
exact up to here). A memory limit whose scaled room exceeds it counts as unlimited; a problem whose
scaled serial time or memory traffic over all micro-batches exceeds it is refused."""


def to_integers(problem: Problem, *, memory_limit: float | None = None, resolution: int = 10**6,
                num_microbatches: int = 1) -> IntegerProblem:
    """Scale ``problem`` to integers; ``memory_limit`` overrides the problem's own limit.

    Times use one scale (durations and latency), memory another. When no power of ten up to
    ``resolution`` makes everything whole, values are rounded at ``resolution`` steps of the
    largest one and ``exact`` is False (the caller re-simulates with the real values).
    A limit whose scaled room above a rank's static memory exceeds :data:`MAX_SCALED` (no schedule
    in integer range can reach it) is None, unlimited. Raises SearchError when ``num_microbatches``
    times the scaled sum of durations and latencies (the serial makespan), or of absolute memory
    changes, exceeds :data:`MAX_SCALED`: the solvers' int64 arithmetic could overflow.
    """
    tasks = problem.tasks
    index = {task.key: i for i, task in enumerate(tasks)}
    time_scale, time_exact = _scale_for([t.duration for t in tasks] + [problem.comm_latency], resolution)
    memory_scale, memory_exact = _scale_for([t.memory for t in tasks], resolution)
    latency = round(problem.comm_latency * time_scale)
    deps = tuple(
        tuple(
            (index[dep], 0 if set(tasks[index[dep]].ranks) == set(task.ranks) else latency)
            for dep in task.deps
        )
        for task in tasks
    )
    limit = limit_of(problem, memory_limit)
    static = problem.static_memory or (0.0,) * problem.num_ranks
    rooms = [None if limit is None else (limit - static[r]) * memory_scale for r in range(problem.num_ranks)]
    limits = tuple(None if room is None or room > MAX_SCALED else math.floor(room + 1e-9) for room in rooms)
    durations = to_units([t.duration for t in tasks], time_scale)
    memory = to_units([t.memory for t in tasks], memory_scale)
    serial = num_microbatches * (sum(durations) + sum(lat for row in deps for _, lat in row))
    traffic = num_microbatches * sum(abs(m) for m in memory)
    if serial > MAX_SCALED or traffic > MAX_SCALED:
        what = "durations and latencies" if serial > MAX_SCALED else "memory changes"
        raise SearchError(
            f"the {what} of {num_microbatches:,} micro-batches scale to "
            f"{_approximately(max(serial, traffic))} integer "
            f"units, over the solvers' range of 2**53 (time scale {time_scale:g}, memory scale "
            f"{memory_scale:g}); use fewer micro-batches or values with fewer significant digits"
        )
    return IntegerProblem(
        problem=problem,
        time_scale=time_scale,
        memory_scale=memory_scale,
        exact=time_exact and memory_exact,
        durations=durations,
        memory=memory,
        deps=deps,
        limits=limits,
    )


def lower_bound(problem: Problem, num_microbatches: int, *, memory_limit: float | None = None,
                deadline: float | None = None) -> float:
    """A makespan no schedule can beat: the longest micro-batch path, and per rank r
    ``M * work_r + max(min head + min tail, idle_r)`` over the tasks on it (its first action cannot
    start before its head, its last must still be followed by its tail; ``idle_r`` is time rank r
    provably waits while other ranks work, see :func:`forced_idle`). Under a memory limit (the
    problem's, or ``memory_limit``) also ``M * area / limit`` per rank plus its fill and drain, see
    :func:`memory_bound`, and the release chain of a rank with one take/give pair,
    :func:`release_chain_bound`. Past ``deadline`` (a ``time.perf_counter()`` value) the remaining
    ranks' ``idle_r`` (O(tasks) each) is left out: the bound stays a bound, only weaker.
    """
    head, tail = head_tail(problem)
    bound = max(head[i] + task.duration + tail[i] for i, task in enumerate(problem.tasks))
    work = problem.work_per_microbatch()
    ancestry = _ancestry(problem)
    tasks_on: list[list[int]] = [[] for _ in range(problem.num_ranks)]
    for i, task in enumerate(problem.tasks):
        for rank in task.ranks:
            tasks_on[rank].append(i)
    for rank, on_rank in enumerate(tasks_on):
        if on_rank:
            ends = min(head[i] for i in on_rank) + min(tail[i] for i in on_rank)
            late = deadline is not None and time.perf_counter() > deadline
            idle = 0.0 if late else forced_idle(problem, num_microbatches, rank, ancestry=ancestry)
            bound = max(bound, num_microbatches * work[rank] + max(ends, idle))
    bound = max(bound, num_microbatches * period_lower_bound(problem, memory_limit=memory_limit))
    bound = max(bound, memory_bound(problem, num_microbatches, memory_limit=memory_limit))
    bound = max(bound, release_chain_bound(problem, num_microbatches, memory_limit=memory_limit))
    return max(bound, all_rank_bound(problem, num_microbatches, memory_limit=memory_limit, deadline=deadline))


def all_rank_bound(problem: Problem, num_microbatches: int, *, memory_limit: float | None = None,
                   deadline: float | None = None) -> float:
    """``M * A + lower_bound(rest)``: a task on every rank stops every rank, so cutting the time of
    the all-rank tasks (A per micro-batch) out of any schedule leaves a schedule of the problem
    without them (:func:`~pipeloom.search.transforms.without_all_rank_tasks`: deps rewired through
    the removed tasks), which cannot beat that problem's :func:`lower_bound`; 0 without all-rank tasks.

    Cutting time out can shrink a latency gap, so ``rest`` is bounded with latency 0; it keeps the
    memory limit only where the all-rank tasks can never hold less than 0 (then the rest holds no
    more than the whole schedule did): all of them free of memory, or one chain whose running sum
    of memory never drops below 0.
    """
    reduced = without_all_rank_tasks(problem)
    if reduced is None:
        return 0.0
    limit = limit_of(problem, memory_limit)
    keeps_limit = limit is not None and _holds_no_less_than_zero(problem, reduced.removed)
    rest = replace(reduced.problem, comm_latency=0.0, memory_limit=limit if keeps_limit else None)
    return num_microbatches * reduced.work + lower_bound(rest, num_microbatches, deadline=deadline)


def _holds_no_less_than_zero(problem: Problem, removed: tuple[int, ...]) -> bool:
    """Whether the tasks ``removed`` hold memory >= 0 in every started (dependency-closed) set: all
    of them free of memory, or each one waiting (transitively) for the one before it in topological
    order, with every running sum of their memory >= 0 (a closed set then holds a prefix)."""
    tasks = problem.tasks
    if all(tasks[i].memory == 0 for i in removed):
        return True
    order, _, ancestors = _ancestry(problem)
    chain = [i for i in order if i in set(removed)]
    held = 0.0
    for previous, current in zip([None, *chain], chain):
        if previous is not None and not ancestors[current] >> previous & 1:
            return False
        held += tasks[current].memory
        if held < -1e-12:
            return False
    return True


_EXACT_IDLE_MICROBATCHES = 64
"""Up to this many micro-batches :func:`forced_idle` walks every copy; beyond, it collapses the
middle copies (a smaller, still valid, chain)."""


def _ancestry(problem: Problem) -> tuple[list[int], list[list[int]], list[int]]:
    """(topological order, dependency indices, ancestor bitsets) of one micro-batch's tasks."""
    deps = dep_indices(problem)
    order = graph.topological_order(deps)
    return order, deps, graph.ancestors(deps, order)


def forced_idle(problem: Problem, num_microbatches: int, rank: int, *,
                ancestry: tuple[list[int], list[list[int]], list[int]] | None = None) -> float:
    """Time rank ``rank`` must stand idle in every schedule (a lower bound; 0 if none is known).

    Write u_j for copy j of task u (interval ``[s_uj, s_uj + d_u)``), r for ``rank``, and
    ``D_r(u) = {a on r : R_a and R_u share no rank}`` for a task u not on r. While u_j runs, r can
    only run copies of tasks in ``D_r(u)`` (any other task on r shares a rank with u_j). So r is
    idle throughout u_j when no copy a_i of a task in ``D_r(u)`` can overlap it:

    - ``D_r(u)`` is empty: every copy j of u;
    - every a in ``D_r(u)`` descends from u, and j = 0: ``s_ai >= s_ui + d_u >= s_u0 + d_u``
      (the micro-batch order ``s_u,i+1 >= s_ui + d_u`` loses nothing, see the exact model);
    - every a in ``D_r(u)`` is an ancestor of u, and j = M - 1: symmetrically, ``a_i`` ends by
      ``s_ui <= s_u,M-1``.

    Such idle intervals u_j and v_k never overlap when u is v or an ancestor of v, j <= k and
    (u, j) != (v, k): ``u_j`` ends before ``v_j`` starts (the dependency path) and ``v_j`` before
    ``v_k``. Rank r's idle time is disjoint from its ``M * work_r`` busy time, so the heaviest such
    chain (a longest path over the (task, copy) grid) adds to it: makespan >= M work_r + chain.
    """
    tasks = problem.tasks
    m = num_microbatches
    if m < 1 or not any(rank in task.ranks for task in tasks):
        return 0.0
    order, deps, ancestors = ancestry if ancestry is not None else _ancestry(problem)
    on_rank = [i for i, task in enumerate(tasks) if rank in task.ranks]
    first = [0.0] * len(tasks)  # weight of copy 0, copy M-1, and every other copy
    last = [0.0] * len(tasks)
    middle = [0.0] * len(tasks)
    for u, task in enumerate(tasks):
        if rank in task.ranks or task.duration <= 0:
            continue
        free = [a for a in on_rank if not set(tasks[a].ranks) & set(task.ranks)]
        if not free:
            first[u] = last[u] = middle[u] = task.duration
        elif all(ancestors[a] >> u & 1 for a in free):
            first[u] = task.duration
        elif all(ancestors[u] >> a & 1 for a in free):
            last[u] = task.duration

    def layer(previous: list[float], weight: list[float]) -> list[float]:
        """Heaviest chain ending at (t, this copy): ``w_t + max(f(t, copy before), f(dep, this copy))``."""
        current = [0.0] * len(tasks)
        for t in order:
            current[t] = weight[t] + max([previous[t], *(current[d] for d in deps[t])])
        return current

    if m == 1:
        return max(layer([0.0] * len(tasks), [max(a, b) for a, b in zip(first, last)]))
    chain = layer([0.0] * len(tasks), first)
    if m - 2 <= _EXACT_IDLE_MICROBATCHES:
        for _ in range(m - 2):
            chain = layer(chain, middle)
    else:  # copies 1..M-2 of one task t, after the best chain into t's ancestors or t
        best = [max([chain[t], *(chain[a] for a in graph.members(ancestors[t]))]) for t in range(len(tasks))]
        chain = [b + (m - 2) * w for b, w in zip(best, middle)]
    return max(layer(chain, last))


def period_lower_bound(problem: Problem, *, memory_limit: float | None = None) -> float:
    """No steady state can start micro-batches faster than one per this much time: the busiest
    rank's work per micro-batch and, under a memory limit L (above a rank's static memory),
    :func:`~pipeloom.search.memory_bounds.memory_period_bound` (memory x time held per micro-batch
    over the room, and a single take/give pair's release chain)."""
    work = max(problem.work_per_microbatch())
    return max(work, memory_period_bound(problem, memory_limit=memory_limit))


def schedule_from_starts(
    problem: Problem,
    *,
    name: str,
    num_microbatches: int,
    starts: Mapping[tuple[int, int], float],
) -> Schedule:
    """Per-rank action lists ordered by ``starts[(task index, micro-batch)]``.

    Ties go first to zero-duration tasks (one that starts where a longer action starts also ends there, so
    it runs before it), then by topological position, then micro-batch, so a dependency always comes
    first.
    """
    position = {t: p for p, t in enumerate(topological_order(problem))}
    ranks: list[list[tuple[float, bool, int, int, Action]]] = [[] for _ in range(problem.num_ranks)]
    for (t, mb), start in starts.items():
        task = problem.tasks[t]
        action = Action(task.stage, task.kind, mb)
        for rank in task.ranks:
            ranks[rank].append((start, task.duration > 0, position[t], mb, action))
    for entries in ranks:
        entries.sort()
    return Schedule(
        name=name,
        problem=problem,
        num_microbatches=num_microbatches,
        ranks=tuple(tuple(entry[4] for entry in entries) for entries in ranks),
    )
