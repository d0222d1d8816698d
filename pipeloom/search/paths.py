"""Longest paths inside one micro-batch's task graph: topological order, heads, tails and the
start-to-start distances the lower bounds build on. Only :mod:`pipeloom.problem` is used."""

from __future__ import annotations

import heapq

from pipeloom.problem import Problem

__all__ = ["head_tail", "start_distances", "topological_order"]


def topological_order(problem: Problem) -> list[int]:
    """Task indices with every dependency before its user (stable: ties keep definition order).

    The order of passes over the tasks in definition order, each placing every task whose
    dependencies are placed (those placed earlier in the same pass included), in O(tasks + deps):
    a task that becomes ready during a pass joins it when it comes later in definition order than
    the task that freed it, else the next pass."""
    tasks = problem.tasks
    index = {task.key: i for i, task in enumerate(tasks)}
    waiting = [len({index[dep] for dep in task.deps}) for task in tasks]
    users: list[list[int]] = [[] for _ in tasks]
    for i, task in enumerate(tasks):
        for dep in {index[dep] for dep in task.deps}:
            users[dep].append(i)
    placed: list[int] = []
    current = [i for i, count in enumerate(waiting) if count == 0]
    while current:
        heapq.heapify(current)
        later: list[int] = []
        while current:
            i = heapq.heappop(current)
            placed.append(i)
            for user in users[i]:
                waiting[user] -= 1
                if waiting[user] == 0 and user > i:
                    heapq.heappush(current, user)
                elif waiting[user] == 0:
                    later.append(user)
        current = later
    return placed


def _latency(problem: Problem, dep: int, user: int) -> float:
    """The latency of edge ``dep -> user``: 0 on the same rank set, else the problem's."""
    tasks = problem.tasks
    return 0.0 if set(tasks[dep].ranks) == set(tasks[user].ranks) else problem.comm_latency


def head_tail(problem: Problem) -> tuple[list[float], list[float]]:
    """Per task: longest path from the micro-batch's start to the task's start (head) and from the
    task's end to the micro-batch's end (tail), latencies included."""
    tasks = problem.tasks
    index = {task.key: i for i, task in enumerate(tasks)}
    order = topological_order(problem)
    head = [0.0] * len(tasks)
    for i in order:
        for dep in tasks[i].deps:
            d = index[dep]
            head[i] = max(head[i], head[d] + tasks[d].duration + _latency(problem, d, i))
    tail = [0.0] * len(tasks)
    for i in reversed(order):
        for dep in tasks[i].deps:
            d = index[dep]
            tail[d] = max(tail[d], tasks[i].duration + tail[i] + _latency(problem, d, i))
    return head, tail


def start_distances(problem: Problem, source: int) -> dict[int, float]:
    """Longest path from the start of task ``source`` to the start of each of its descendants (and
    itself, 0) within one micro-batch, latencies included."""
    tasks = problem.tasks
    index = {task.key: i for i, task in enumerate(tasks)}
    users: list[list[int]] = [[] for _ in tasks]
    for i, task in enumerate(tasks):
        for dep in task.deps:
            users[index[dep]].append(i)
    dist = {source: 0.0}
    for i in topological_order(problem):
        if i in dist:
            for user in users[i]:
                reach = dist[i] + tasks[i].duration + _latency(problem, i, user)
                if reach > dist.get(user, -1.0):
                    dist[user] = reach
    return dist
