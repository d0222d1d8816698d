"""Schedules built from another problem's schedule, which the search must never lose to:
a full-backward schedule with every B split into I then W, and a schedule of the problem without
its all-rank blocks with the blocks put back. Each result is validated before it is returned.
"""

from __future__ import annotations

import math

from pipeloom.errors import ScheduleError
from pipeloom.ir import Action, Comm, Overlap, Schedule
from pipeloom.problem import Problem
from pipeloom.search.paths import topological_order
from pipeloom.search.transforms import Reduced
from pipeloom.sim import Timeline, simulate
from pipeloom.validate import validate

__all__ = ["BLOCK_PLACEMENTS", "insert_all_rank_tasks", "split_each_backward"]

BLOCK_PLACEMENTS = ("ends", "late", "early")
"""Where :func:`insert_all_rank_tasks` puts the all-rank tasks (see there)."""


def split_each_backward(schedule: Schedule, problem: Problem, *, name: str | None = None) -> Timeline | None:
    """``schedule`` (of :func:`~pipeloom.search.transforms.merge_backward` of ``problem``) with each
    ``sB j`` replaced by ``sI j`` immediately followed by ``sW j``, validated on ``problem`` in
    ordered mode; None when it breaks a rule there (e.g. the memory limit).

    Never slower than ``schedule``: I ends before B did and W where B did, so every action can start
    no later than before.
    """
    ranks = tuple(tuple(part for action in actions for part in _split_backward(action)) for actions in schedule.ranks)
    split = Schedule(name=name or schedule.name, problem=problem, num_microbatches=schedule.num_microbatches,
                     ranks=ranks)
    return _checked(split)


def _split_backward(action: Action | Overlap | Comm) -> tuple[Action | Overlap | Comm, ...]:
    """``sI j`` then ``sW j`` for a full backward ``sB j``; any other action as it is."""
    if type(action) is Action and action.kind == "B":
        return Action(action.stage, "I", action.microbatch), Action(action.stage, "W", action.microbatch)
    return (action,)


def insert_all_rank_tasks(schedule: Schedule, problem: Problem, reduced: Reduced, *, where: str = "ends",
                          name: str | None = None) -> Timeline | None:
    """``schedule`` (of ``reduced.problem``) on ``problem``, with the all-rank tasks put back,
    validated on ``problem`` in ordered mode; None when it breaks a rule there.

    Every action gets a time: a kept action its start in ``schedule``'s timeline; an all-rank copy
    ``(t, j)`` a time between the finish of what it waits for (``early``) and the start of the first
    action waiting for it (``late``). ``where="ends"`` puts the all-rank tasks that wait for no kept
    task before everything and those no kept task waits for after everything (as many micro-batches
    as there are: a forward block on all ranks costs the same wherever it goes) and the rest late.
    Each rank runs its actions by (time, topological position, micro-batch): one order on all ranks,
    consistent with every dependency, so the lists cannot deadlock; where the all-rank tasks hold
    no memory, each one adds its duration to the makespan at most once the rest is dense.
    """
    if where not in BLOCK_PLACEMENTS:
        raise ValueError(f"where must be one of {', '.join(BLOCK_PLACEMENTS)}, got {where!r}")
    timeline = simulate(schedule)
    stage_of = reduced.stages
    times = {(stage_of[action.stage], action.kind, action.microbatch): (start, end)
             for action, (start, end) in timeline.action_times().items() if type(action) is Action}
    tasks = problem.tasks
    order = topological_order(problem)
    position = {t: p for p, t in enumerate(order)}
    removed = set(reduced.removed)
    index = {task.key: i for i, task in enumerate(tasks)}
    users: list[list[int]] = [[] for _ in tasks]
    for i, task in enumerate(tasks):
        for dep in task.deps:
            users[index[dep]].append(i)
    heads, tails = _ends(problem, removed, users)
    keyed: list[tuple[float, int, int, int]] = []  # (time, position, micro-batch, task)
    for j in range(schedule.num_microbatches):
        when = _block_times(problem, order, users, removed, times, j, where, heads, tails)
        for t, task in enumerate(tasks):
            start = when[t] if t in removed else times[(task.stage, task.kind, j)][0]
            keyed.append((start, position[t], j, t))
    keyed.sort()
    ranks: list[list[Action]] = [[] for _ in range(problem.num_ranks)]
    for _, _, j, t in keyed:
        task = tasks[t]
        for rank in task.ranks:
            ranks[rank].append(Action(task.stage, task.kind, j))
    built = Schedule(name=name or schedule.name, problem=problem, num_microbatches=schedule.num_microbatches,
                     ranks=tuple(tuple(actions) for actions in ranks))
    return _checked(built)


def _ends(problem: Problem, removed: set[int], users: list[list[int]]) -> tuple[set[int], set[int]]:
    """Removed tasks with only removed ancestors (heads) and only removed descendants (tails)."""
    tasks = problem.tasks
    index = {task.key: i for i, task in enumerate(tasks)}
    order = topological_order(problem)
    heads: set[int] = set()
    for t in order:
        if t in removed and all(index[dep] in heads for dep in tasks[t].deps):
            heads.add(t)
    tails: set[int] = set()
    for t in reversed(order):
        if t in removed and all(user in tails for user in users[t]):
            tails.add(t)
    return heads, tails


def _block_times(problem: Problem, order: list[int], users: list[list[int]], removed: set[int],
                 times: dict, j: int, where: str, heads: set[int], tails: set[int]) -> dict[int, float]:
    """Time of each all-rank copy ``(t, j)`` (see :func:`insert_all_rank_tasks`)."""
    tasks = problem.tasks
    index = {task.key: i for i, task in enumerate(tasks)}

    def kept(t: int) -> tuple[float, float]:
        task = tasks[t]
        return times[(task.stage, task.kind, j)]

    early: dict[int, float] = {}
    for t in order:
        if t in removed:
            early[t] = max((early[d] if d in removed else kept(d)[1]
                            for d in (index[dep] for dep in tasks[t].deps)), default=0.0)
    if where == "early":
        return early
    late: dict[int, float] = {}
    for t in reversed(order):
        if t in removed:
            after = [late[u] if u in removed else kept(u)[0] for u in users[t]]
            late[t] = max(early[t], min(after)) if after else early[t]
    if where == "late":
        return late
    return {t: -math.inf if t in heads else math.inf if t in tails else late[t] for t in late}


def _checked(schedule: Schedule) -> Timeline | None:
    """The ordered-mode validation's timeline, or None when the schedule breaks a rule."""
    try:
        return validate(schedule, ordered=True)
    except ScheduleError:
        return None
