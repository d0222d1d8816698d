"""Problem transforms the search's constructions and bounds start from: the full-backward twin of a
split-backward problem, the problem left when the all-rank blocks are taken out, and the problem on the ranks its
tasks use.

Only :mod:`pipeloom.problem` is used here (no solver, no simulator), so the bounds in
:mod:`pipeloom.search.common` can build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeloom.problem import Problem, Task, TaskKey

__all__ = ["Reduced", "all_rank_tasks", "merge_backward", "without_all_rank_tasks", "without_idle_ranks"]


def merge_backward(problem: Problem) -> Problem | None:
    """The full-backward twin of a split-backward ``problem``: each I and its W become one B of
    duration ``d_I + d_W`` and memory ``m_I + m_W``, with I's deps; whatever waited for I or W waits
    for B. None when the problem does not split its backward, or a W is not I's plain follower (W
    must exist for every I, on the same ranks, and wait for I alone)."""
    if not problem.splits_backward:
        return None
    keys = {task.key for task in problem.tasks}
    for task in problem.tasks:
        if task.kind == "I" and (task.stage, "W") not in keys:
            return None
        if task.kind == "W":
            if (task.stage, "I") not in keys:
                return None
            partner = problem.task((task.stage, "I"))
            if task.deps != (partner.key,) or set(task.ranks) != set(partner.ranks):
                return None

    def renamed(key: TaskKey) -> TaskKey:
        return (key[0], "B") if key[1] in ("I", "W") else key

    tasks = []
    for task in problem.tasks:
        if task.kind == "W":
            continue
        deps = tuple(dict.fromkeys(renamed(dep) for dep in task.deps))
        if task.kind == "I":
            partner = problem.task((task.stage, "W"))
            tasks.append(Task(stage=task.stage, kind="B", ranks=task.ranks, deps=deps,
                              duration=task.duration + partner.duration, memory=task.memory + partner.memory))
        else:
            tasks.append(replace(task, deps=deps))
    return replace(problem, tasks=tuple(tasks))


def all_rank_tasks(problem: Problem) -> tuple[int, ...]:
    """Indices of the tasks that occupy every rank (Tessel's "all" blocks); none on one rank."""
    if problem.num_ranks < 2:
        return ()
    return tuple(i for i, task in enumerate(problem.tasks) if len(set(task.ranks)) == problem.num_ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduced:
    """A problem with its all-rank tasks taken out, and how to map it back."""

    problem: Problem
    """The remaining tasks, stages renumbered 0, 1, ... in order, deps rewired through removed tasks
    (a task that waited for a removed one waits for what that one waited for)."""
    stages: tuple[int, ...]
    """Original stage of each reduced stage."""
    removed: tuple[int, ...]
    """Indices (in the original problem) of the all-rank tasks taken out."""
    work: float
    """Duration of the removed tasks per micro-batch: time every rank stands still for them."""


def without_all_rank_tasks(problem: Problem) -> Reduced | None:
    """``problem`` without its all-rank tasks (:class:`Reduced`); None when it has none, or only those."""
    removed = all_rank_tasks(problem)
    if not removed or len(removed) == len(problem.tasks):
        return None
    gone = {problem.tasks[i].key for i in removed}
    through: dict[TaskKey, tuple[TaskKey, ...]] = {}

    def kept_deps(key: TaskKey) -> tuple[TaskKey, ...]:
        """The kept tasks ``key`` waits for, looking through removed ones (memoised)."""
        if key not in through:
            found: list[TaskKey] = []
            for dep in problem.task(key).deps:
                found.extend(kept_deps(dep) if dep in gone else (dep,))
            through[key] = tuple(dict.fromkeys(found))
        return through[key]

    kept = [task for task in problem.tasks if task.key not in gone]
    stages = tuple(sorted({task.stage for task in kept}))
    number = {stage: i for i, stage in enumerate(stages)}

    def renumbered(key: TaskKey) -> TaskKey:
        return (number[key[0]], key[1])

    tasks = tuple(
        replace(task, stage=number[task.stage], deps=tuple(renumbered(dep) for dep in kept_deps(task.key)))
        for task in kept
    )
    return Reduced(
        problem=replace(problem, tasks=tasks),
        stages=stages,
        removed=removed,
        work=sum(problem.tasks[i].duration for i in removed),
    )


def without_idle_ranks(problem: Problem) -> tuple[Problem, tuple[int, ...]] | None:
    """``problem`` on the ranks its tasks use, renumbered in order (their static memory kept), and those ranks; None
    where every rank holds a task. Ranks no task uses cost the solvers per rank and add nothing: a problem file of 2
    ranks' tasks declaring 65,536 had found no schedule and overrun its time limit by 50 s."""
    used = tuple(sorted({rank for task in problem.tasks for rank in task.ranks}))
    if not used or len(used) == problem.num_ranks:
        return None
    index = {rank: n for n, rank in enumerate(used)}
    tasks = tuple(replace(task, ranks=tuple(index[rank] for rank in task.ranks)) for task in problem.tasks)
    static = None if problem.static_memory is None else tuple(problem.static_memory[rank] for rank in used)
    return replace(problem, num_ranks=len(used), tasks=tasks, static_memory=static), used
