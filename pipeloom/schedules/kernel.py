"""The list-scheduling kernel: simulate while ordering on one event clock, with pluggable rules.

Problem data (:class:`ListProblem`) plus rules give per-rank action lists. :func:`list_schedule_kernel`
starts the globally earliest candidate (priority, admission: Chimera's list order, the search's
greedy); :func:`rank_schedule_kernel` wakes free ranks in time order and lets a rule scan their
candidates (ZB-V's and interleaved zero bubble's policies, whose patience and W-fill look at the
next known ready time). The library has no other list scheduler.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Protocol

from pipeloom.ir import Action

__all__ = [
    "ListProblem", "ListResult", "ListRules", "ListTask", "RankRules", "RankState", "list_schedule_kernel",
    "rank_schedule_kernel",
]

_new_action = tuple.__new__
"""``_new_action(Action, (stage, kind, microbatch))`` is ``Action(stage, kind, microbatch)`` without the
Python-level NamedTuple constructor: the kernel builds every action of a schedule (393k for zbv at
p=64, m=1024), and the fields are ints and a kind string taken from checked ListTasks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ListTask:
    """One task of every micro-batch: an action on its ranks with a duration and dependencies."""

    stage: int
    """The IR action's stage."""
    kind: str
    """The IR action's kind (F, B, I, W, ...)."""
    ranks: tuple[int, ...]
    """Ranks it occupies (all of them, from its start to its end)."""
    duration: float
    """Time it takes."""
    memory: float = 0.0
    """Signed change of the memory held on each of its ranks when it starts (for admission rules)."""
    deps: tuple[tuple[int, float], ...] = ()
    """(task index, communication latency) of each task of the same micro-batch it waits for."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError(f"list task {self.stage}{self.kind} has no ranks; give it at least one")
        if self.duration < 0:
            raise ValueError(
                f"list task {self.stage}{self.kind} has duration {self.duration:g}; it must be >= 0"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ListProblem:
    """The problem data the kernel schedules: tasks per micro-batch on ranks, and their count."""

    num_ranks: int
    """Ranks 0 .. num_ranks-1."""
    num_microbatches: int
    """Every task runs micro-batches 0 .. num_microbatches-1, in that order (FIFO per task)."""
    tasks: tuple[ListTask, ...]
    """The tasks of one micro-batch; deps point into this tuple and must form a DAG."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        for task in self.tasks:
            if any(not 0 <= r < self.num_ranks for r in task.ranks):
                raise ValueError(
                    f"list task {task.stage}{task.kind} names a rank outside 0..{self.num_ranks - 1}"
                )
            if any(not 0 <= d < len(self.tasks) for d, _ in task.deps):
                raise ValueError(f"list task {task.stage}{task.kind} depends on a task index out of range")


class ListRules(Protocol):
    """How the kernel chooses: a static priority and a stateful admission rule."""

    def priority(self, task: int, microbatch: int) -> tuple:
        """Order among candidates that can start at the same time; smaller first."""

    def admits(self, task: int, microbatch: int) -> bool:
        """Whether (task, micro-batch) may start now; a refused candidate waits for a later step."""

    def started(self, task: int, microbatch: int) -> None:
        """Called after (task, micro-batch) starts, so the rule can update its own state."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ListResult:
    """Per-rank action lists, as far as the kernel got."""

    ranks: tuple[tuple[Action, ...], ...]
    """Each rank's actions in start order."""
    makespan: float
    """Latest end of a placed action."""
    placed: int
    """Actions placed; ``total`` when complete."""
    total: int
    """Tasks times micro-batches."""
    timed_out: bool = False
    """Whether the deadline passed first (otherwise an incomplete result means no candidate was admitted)."""

    @property
    def complete(self) -> bool:
        return self.placed == self.total


def list_schedule_kernel(
    problem: ListProblem, rules: ListRules, *, deadline: float | None = None
) -> ListResult:
    """Start, step after step, the candidate of least ``(start, rules.priority)`` that ``rules.admits``.

    A candidate is a task's next micro-batch once every dependency has started (its end is known):
    ``start = max(end_dep + latency over deps, free time of each of its ranks)``. Candidates wait in
    a heap under a key that can only be too early (a rank's free time only grows): a popped key
    that is out of date goes back with its current start, so the first up-to-date admitted entry
    is the least, O(log n) per action; refused entries go back unchanged. ``deadline`` (a
    :func:`time.perf_counter` value) is checked every 64 steps.
    """
    tasks, num_mb = problem.tasks, problem.num_microbatches
    users: list[list[int]] = [[] for _ in tasks]
    for t, task in enumerate(tasks):
        for d, _ in task.deps:
            users[d].append(t)
    finish = [[0.0] * num_mb for _ in tasks]
    next_mb, ready, queued = [0] * len(tasks), [0.0] * len(tasks), [False] * len(tasks)
    free = [0.0] * problem.num_ranks
    lists: list[list[Action]] = [[] for _ in range(problem.num_ranks)]
    heap: list[tuple[float, tuple, int, int]] = []

    def start_time(t: int) -> float:
        return max([ready[t]] + [free[r] for r in tasks[t].ranks])

    def push_if_ready(t: int) -> None:
        mb = next_mb[t]
        if queued[t] or mb >= num_mb:
            return
        at = 0.0
        for dep, latency in tasks[t].deps:
            if next_mb[dep] <= mb:
                return
            at = max(at, finish[dep][mb] + latency)
        ready[t], queued[t] = at, True
        heapq.heappush(heap, (start_time(t), rules.priority(t, mb), t, mb))

    for t in range(len(tasks)):
        push_if_ready(t)
    total, makespan, timed_out = len(tasks) * num_mb, 0.0, False
    for step in range(total):
        if deadline is not None and step % 64 == 0 and time.perf_counter() > deadline:
            timed_out = True
            break
        waiting, chosen = [], None
        while heap:
            entry = heapq.heappop(heap)
            start, priority, t, mb = entry
            now = start_time(t)
            if now > start:
                heapq.heappush(heap, (now, priority, t, mb))
            elif rules.admits(t, mb):
                chosen = entry
                break
            else:
                waiting.append(entry)
        for entry in waiting:
            heapq.heappush(heap, entry)
        if chosen is None:
            break
        start, _, t, mb = chosen
        task = tasks[t]
        queued[t] = False
        finish[t][mb] = end = start + task.duration
        makespan = max(makespan, end)
        next_mb[t] = mb + 1
        action = Action(task.stage, task.kind, mb)
        for r in task.ranks:
            free[r] = end
            lists[r].append(action)
        rules.started(t, mb)
        for u in (t, *users[t]):
            push_if_ready(u)
    return ListResult(ranks=tuple(map(tuple, lists)), makespan=makespan, placed=sum(next_mb), total=total,
                      timed_out=timed_out)


class RankRules(Protocol):
    """How a free rank chooses in :func:`rank_schedule_kernel` (priority and admission in one scan)."""

    def choose(self, state: RankState, rank: int, now: float) -> float | None:
        """Place rank ``rank``'s next action(s) with ``state.place`` and return None, or place nothing
        and return when to wake it (``inf``: only when a neighbour places what it waits for)."""


class RankState:
    """What :func:`rank_schedule_kernel`'s rules read and how they place: per task its next
    micro-batch, end times and ready time, per rank its free time and held memory."""

    __slots__ = ("problem", "next_mb", "finish", "ready_at", "free", "held", "lists", "makespan", "last_end",
                 "_pending", "_heap", "_deps", "_spec", "_users", "_last_mb")

    def __init__(self, problem: ListProblem) -> None:
        for task in problem.tasks:
            if len(task.ranks) != 1:
                raise ValueError(f"rank_schedule_kernel runs one-rank tasks; {task.stage}{task.kind} "
                                 f"is on ranks {list(task.ranks)} (use list_schedule_kernel)")
        self.problem = problem
        num_tasks, p = len(problem.tasks), problem.num_ranks
        self.next_mb = [0] * num_tasks
        self.finish = [[0.0] * problem.num_microbatches for _ in range(num_tasks)]
        self.free, self.held, self.last_end, self._pending = [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p
        self.lists: list[list[Action]] = [[] for _ in range(p)]
        self.makespan = 0.0
        rank = [task.ranks[0] for task in problem.tasks]
        self._deps = [task.deps for task in problem.tasks]
        self._spec = [(t.stage, t.kind, t.duration, t.memory, r) for t, r in zip(problem.tasks, rank, strict=True)]
        # Per task, its users with the rank to wake (-1 on the same rank: that rank decides next anyway).
        users: list[list[tuple[int, int]]] = [[] for _ in problem.tasks]
        for user, task in enumerate(problem.tasks):
            for d, _ in task.deps:
                users[d].append((user, rank[user] if rank[d] != rank[user] else -1))
        self._users = [tuple(found) for found in users]
        self.ready_at = [self._deps_done(t) for t in range(num_tasks)]
        """``ready_at[task]``: :meth:`ready`, kept up to date by :meth:`place` (rules read it in their scan)."""
        self._heap: list[tuple[float, int]] = []
        self._last_mb = problem.num_microbatches - 1

    def ready(self, task: int) -> float | None:
        """When ``task``'s next micro-batch's deps are done (latency included); None if one has not
        started or every micro-batch of ``task`` is placed."""
        return self.ready_at[task]

    def _deps_done(self, task: int) -> float | None:
        """:meth:`ready` computed from the deps' end times."""
        next_mb, finish = self.next_mb, self.finish
        mb, at = next_mb[task], 0.0
        for dep, latency in self._deps[task]:
            if next_mb[dep] <= mb:
                return None
            end = finish[dep][mb] + latency
            if end > at:
                at = end
        return at

    def place(self, task: int, start: float) -> float:
        """Start ``task``'s next micro-batch at ``start`` on its rank; returns its end. The ready
        times this changes are updated: the task's own next one and those of the users whose next
        micro-batch is this one; such a user on another rank wakes it at that time if earlier."""
        stage, kind, duration, memory, r = self._spec[task]
        next_mb, ready_at, pending = self.next_mb, self.ready_at, self._pending
        mb = next_mb[task]
        next_mb[task] = mb + 1
        self.finish[task][mb] = end = start + duration
        self.last_end[r] = end
        self.held[r] += memory
        self.lists[r].append(_new_action(Action, (stage, kind, mb)))
        if end > self.makespan:
            self.makespan = end
        deps_done = self._deps_done
        ready_at[task] = deps_done(task) if mb < self._last_mb else None
        for user, n in self._users[task]:
            if next_mb[user] == mb:
                ready_at[user] = ready = deps_done(user)
                if n >= 0 and ready is not None and ready < pending[n]:
                    free = self.free[n]
                    ready = free if free > ready else ready
                    if ready < pending[n]:
                        pending[n] = ready
                        heapq.heappush(self._heap, (ready, n))
        return end


def rank_schedule_kernel(problem: ListProblem, rules: RankRules, *, rank_order_ties: bool = False) -> ListResult:
    """Wake ranks in time order; a free rank lets ``rules.choose`` place its next action(s).

    Rank r decides at time t only after every rank's decision before t (a heap of (t, r)), so
    every action starting before t is placed and "ready at t" is exact. A rank that placed goes on
    deciding at its new free time unless another rank wakes earlier; one that placed nothing
    sleeps until the time ``choose`` returns or until a neighbour completes the deps of its next
    action (a wake-up superseded by an earlier one is dropped). One-rank tasks only.

    Ranks deciding at the same time see each other's placements, so their order matters:
    by default the rank that just placed decides again first; ``rank_order_ties`` makes them
    decide in rank order (the placing rank waits behind a lower rank due at its new free time).
    """
    state = RankState(problem)
    heap, pending, free = state._heap, state._pending, state.free
    heap.extend((0.0, r) for r in range(problem.num_ranks))
    pop, push, choose = heapq.heappop, heapq.heappush, rules.choose
    while heap:
        t, r = pop(heap)
        if t != pending[r]:
            continue  # superseded by an earlier wake-up
        while True:
            wake = choose(state, r, t)
            if wake is not None:
                pending[r] = wake
                if wake < math.inf:
                    push(heap, (wake, r))
                break
            free[r] = pending[r] = t = state.last_end[r]
            if heap and (heap[0] < (t, r) if rank_order_ties else heap[0][0] < t):
                push(heap, (t, r))
                break
    return ListResult(ranks=tuple(map(tuple, state.lists)), makespan=state.makespan,
                      placed=sum(state.next_mb), total=len(problem.tasks) * problem.num_microbatches)
