"""Longest paths inside one micro-batch's task graph: topological order, heads, tails and the
start-to-start distances the lower bounds build on, over :mod:`pipeloom.graph`."""

from __future__ import annotations

from pipeloom import graph
from pipeloom.problem import Problem

__all__ = ["dep_indices", "head_tail", "start_distances", "topological_order"]


def dep_indices(problem: Problem) -> list[list[int]]:
    """Per task (index into ``problem.tasks``): the indices of its deps, in the order given."""
    index = {task.key: i for i, task in enumerate(problem.tasks)}
    return [[index[dep] for dep in task.deps] for task in problem.tasks]


def topological_order(problem: Problem) -> list[int]:
    """Task indices with every dependency before its user (stable: ties keep definition order).

    The order of passes over the tasks in definition order, each placing every task whose
    dependencies are placed (those placed earlier in the same pass included), in O(tasks + deps):
    see :func:`pipeloom.graph.topological_order`."""
    return graph.topological_order(dep_indices(problem))


def _latency(problem: Problem, dep: int, user: int) -> float:
    """The latency of edge ``dep -> user``: 0 on the same rank set, else the problem's."""
    tasks = problem.tasks
    return 0.0 if set(tasks[dep].ranks) == set(tasks[user].ranks) else problem.comm_latency


def head_tail(problem: Problem) -> tuple[list[float], list[float]]:
    """Per task: longest path from the micro-batch's start to the task's start (head) and from the
    task's end to the micro-batch's end (tail), latencies included."""
    preds = dep_indices(problem)
    edges = [[(d, _latency(problem, d, i)) for d in deps] for i, deps in enumerate(preds)]
    durations = [task.duration for task in problem.tasks]
    return graph.head_tail(graph.topological_order(preds), edges, durations, 0.0)


def start_distances(problem: Problem, source: int) -> dict[int, float]:
    """Longest path from the start of task ``source`` to the start of each of its descendants (and
    itself, 0) within one micro-batch, latencies included."""
    tasks = problem.tasks
    preds = dep_indices(problem)
    users: list[list[int]] = [[] for _ in tasks]
    for i, deps in enumerate(preds):
        for dep in deps:
            users[dep].append(i)
    dist = {source: 0.0}
    for i in graph.topological_order(preds):
        if i in dist:
            for user in users[i]:
                reach = dist[i] + tasks[i].duration + _latency(problem, i, user)
                if reach > dist.get(user, -1.0):
                    dist[user] = reach
    return dist
