"""Lower bounds from a memory limit: memory x time held per micro-batch, the window a rank holds
memory in, and the chain a single take/give pair forms on a rank.

Memory follows the simulator (docs/design.md §3): a task's change applies on each of its ranks at its
start, held memory is the running sum along the rank's list, and a rank runs one action at a time.
"""

from __future__ import annotations

import math

from pipeloom.problem import Problem
from pipeloom.search.paths import head_tail, start_distances, topological_order

__all__ = [
    "held_memory_time",
    "limit_of",
    "memory_bound",
    "memory_period_bound",
    "memory_time_per_microbatch",
    "release_chain_bound",
    "single_pairs",
]


def memory_time_per_microbatch(problem: Problem) -> list[float]:
    """Per rank, the least memory x time one micro-batch occupies there, whatever the schedule,
    counted from a take's start to its give's start.

    Memory a task takes (m_p > 0 at its start s_p) is given back by later tasks (m_n < 0). For any
    flow f matching taken to given-back memory, the area is sum f(p, n) (s_n - s_p); choosing f only
    between a task and its descendants makes every term >= f(p, n) * dist(p, n), the longest path
    from p's start to n's start. A rank whose memory cannot be matched that way (or does not
    return to zero) gets 0, which bounds nothing.
    """
    tasks = problem.tasks
    order = topological_order(problem)
    areas = []
    for rank in range(problem.num_ranks):
        on_rank = [i for i in order if rank in tasks[i].ranks]
        taken = {i: tasks[i].memory for i in on_rank if tasks[i].memory > 0}
        reach = {p: start_distances(problem, p) for p in taken}
        area = 0.0
        for n in (i for i in on_rank if tasks[i].memory < 0):
            need = -tasks[n].memory
            for dist, p in sorted(((reach[p][n], p) for p in taken if n in reach[p]), reverse=True):
                moved = min(need, taken[p])
                area += moved * dist
                taken[p] -= moved
                need -= moved
                if need <= 1e-12:
                    break
            if need > 1e-9:
                area = 0.0
                break
        if any(left > 1e-9 for left in taken.values()):
            area = 0.0
        areas.append(area)
    return areas


def held_memory_time(problem: Problem) -> list[float]:
    """Per rank r, ``area_r + sum |m_n| d_n`` over the tasks n on r that give memory back
    (``area_r`` of :func:`memory_time_per_microbatch`; 0 where that is 0).

    Count a give's memory as held until its task *ends*: held'(t) = held(t) + |m_n| while n runs.
    That never exceeds the room either: r runs nothing else while n runs, so held(t) there is the
    running sum just after n, and held'(t) the sum just before n, which met the limit. Each matched
    pair then holds f(p, n) for at least dist(p, n) + d_n.
    """
    tasks = problem.tasks
    areas = memory_time_per_microbatch(problem)
    return [
        area + sum(-task.memory * task.duration for task in tasks if rank in task.ranks and task.memory < 0)
        if area > 0 else 0.0
        for rank, area in enumerate(areas)
    ]


def limit_of(problem: Problem, memory_limit: float | None) -> float | None:
    """The memory limit a search function works under: ``memory_limit`` when given, else (None)
    the problem's own limit (itself None when the problem has none: no limit).

    This is the one meaning of a ``memory_limit`` argument next to a Problem throughout
    :mod:`pipeloom.search`; to search without the problem's limit, pass
    ``dataclasses.replace(problem, memory_limit=None)``. Functions that build a problem
    (:func:`~pipeloom.search.placements.placement`, ``PlacementBuilder.build``) take the new
    problem's own limit instead, where None is no limit, as in ``Problem(memory_limit=None)``."""
    return problem.memory_limit if memory_limit is None else float(memory_limit)


def _rooms(problem: Problem, memory_limit: float | None) -> list[float] | None:
    """Per rank, ``limit - static``; None without a limit."""
    limit = limit_of(problem, memory_limit)
    if limit is None:
        return None
    static = problem.static_memory or (0.0,) * problem.num_ranks
    return [limit - s for s in static]


def memory_bound(problem: Problem, num_microbatches: int, *, memory_limit: float | None = None) -> float:
    """Per rank r under a memory limit, the larger of
    ``min head(take) + M * area_r / room_r + min (d + tail)(give)`` and
    ``min head(take) + M * held_r / room_r + min tail(give)`` (0 without a limit).

    With ``area_r > 0`` (:func:`memory_time_per_microbatch`) every unit of memory a task takes on r
    is given back by a descendant in its micro-batch, so the memory held at time t is the sum over
    matched pairs (p, n) with ``s_p <= t < s_n`` (changes apply at the start): it is 0 before the first
    taking task starts (at or after the least head among r's tasks with memory > 0) and after the last
    giving task starts (at the latest ``makespan - d_n - tail_n`` for one of r's tasks with memory < 0),
    and at most ``room_r = limit - static_r`` in between. That window holds ``M * area_r`` of
    memory x time, so it lasts at least ``M * area_r / room_r``. The second form counts each give
    until its end (:func:`held_memory_time`): the window ends at the last give's end, ``tail_n``
    before the makespan.
    """
    rooms = _rooms(problem, memory_limit)
    if rooms is None:
        return 0.0
    head, tail = head_tail(problem)
    held = held_memory_time(problem)
    bound = 0.0
    for rank, area in enumerate(memory_time_per_microbatch(problem)):
        room = rooms[rank]
        if area <= 0 or room <= 0:
            continue
        on_rank = [(i, task) for i, task in enumerate(problem.tasks) if rank in task.ranks]
        fill = min(head[i] for i, task in on_rank if task.memory > 0)
        drain = min(task.duration + tail[i] for i, task in on_rank if task.memory < 0)
        drain_after_end = min(tail[i] for i, task in on_rank if task.memory < 0)
        m = num_microbatches
        bound = max(bound, fill + m * area / room + drain, fill + m * held[rank] / room + drain_after_end)
    return bound


def single_pairs(problem: Problem, memory_limit: float | None = None) -> dict[int, tuple[int, int, int]]:
    """Ranks whose memory changes come from one pair: ``rank -> (p, n, c)`` where p is the only task
    on the rank taking memory (a > 0), n the only one giving it back (exactly a), n descends from p,
    and ``c = floor(room / a)`` >= 1 copies of p fit in the room at once. Only under a limit."""
    rooms = _rooms(problem, memory_limit)
    if rooms is None:
        return {}
    tasks = problem.tasks
    pairs = {}
    for rank in range(problem.num_ranks):
        takes = [i for i, task in enumerate(tasks) if rank in task.ranks and task.memory > 0]
        gives = [i for i, task in enumerate(tasks) if rank in task.ranks and task.memory < 0]
        if len(takes) != 1 or len(gives) != 1:
            continue
        (p,), (n,) = takes, gives
        amount = tasks[p].memory
        if abs(amount + tasks[n].memory) > 1e-12 * max(1.0, amount) or n not in start_distances(problem, p):
            continue
        copies = math.floor(rooms[rank] / amount + 1e-9)
        if copies >= 1:
            pairs[rank] = (p, n, copies)
    return pairs


def release_chain_bound(problem: Problem, num_microbatches: int, *, memory_limit: float | None = None) -> float:
    """Per rank r of :func:`single_pairs` ``(p, n, c)``: ``t_{M-1} + H + tail_n`` with
    ``H = dist(p, n) + d_n`` and ``t_i = head_p + max(i d_p, (i // c) H + (i % c) d_p)``
    (0 where no rank qualifies).

    Let t_k be the start of the k-th copy of p on r (in r's list, which is time order). Right
    after the (k+c)-th starts, at most c copies are held, so at least k+1 copies of n came before it
    in r's list, and ended before it. They belong to k+1 distinct micro-batches, one of whose p
    started at or after t_k; its n starts >= dist(p, n) later and runs d_n. So
    ``t_{k+c} >= t_k + H``; with ``t_{k+1} >= t_k + d_p`` and ``t_0 >= head_p`` the least solution
    is the formula. The last copy's micro-batch still needs ``H + tail_n`` after t_{M-1}.
    """
    head, tail = head_tail(problem)
    tasks = problem.tasks
    bound = 0.0
    last = num_microbatches - 1
    for p, n, copies in single_pairs(problem, memory_limit).values():
        cycle = start_distances(problem, p)[n] + tasks[n].duration
        step = tasks[p].duration
        start = head[p] + max(last * step, (last // copies) * cycle + (last % copies) * step)
        bound = max(bound, start + cycle + tail[n])
    return bound


def memory_period_bound(problem: Problem, *, memory_limit: float | None = None) -> float:
    """No steady state admits micro-batches faster than one per this much time under the memory
    limit: per rank ``held_r / room_r`` (:func:`held_memory_time`) and, for a rank of
    :func:`single_pairs`, ``H / c`` (:func:`release_chain_bound`'s cycle); 0 without a limit."""
    rooms = _rooms(problem, memory_limit)
    if rooms is None:
        return 0.0
    bound = max([0.0] + [held / room for held, room in zip(held_memory_time(problem), rooms)
                         if held > 0 and room > 0])
    for p, n, copies in single_pairs(problem, memory_limit).values():
        cycle = start_distances(problem, p)[n] + problem.tasks[n].duration
        bound = max(bound, cycle / copies)
    return bound
