"""Memory-aware list scheduling: a valid, deadlock-free schedule for any problem in one pass.

It warm-starts the exact search and stands in where no built-in schedule fits the placement.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, replace

from pipeloom.ir import Action, Schedule
from pipeloom.problem import Problem
from pipeloom.search.common import SearchError, head_tail, topological_order

__all__ = ["list_schedule", "microbatch_peak_memory"]

_EPS = 1e-9


def microbatch_peak_memory(problem: Problem) -> tuple[float, ...]:
    """Per rank: the most memory one micro-batch can hold there, whatever order its tasks run in.

    Started tasks always form a dependency-closed set D (a task starts after its deps), so the
    micro-batch holds ``sum_{t in D, r in ranks(t)} memory_t`` on rank r; this is the maximum of that
    sum over closed sets (never below 0: the empty set), a max-weight closure found by a min cut.
    Static memory is not included.
    """
    index = {task.key: i for i, task in enumerate(problem.tasks)}
    deps = [[index[dep] for dep in task.deps] for task in problem.tasks]
    return tuple(
        _max_closure([task.memory if rank in task.ranks else 0.0 for task in problem.tasks], deps)
        for rank in range(problem.num_ranks)
    )


def _max_closure(weights: list[float], deps: list[list[int]]) -> float:
    """``max over D closed under deps of sum(weights[D])`` = positive weight - max flow.

    Network: source -> t (capacity w_t > 0), t -> sink (capacity -w_t > 0), t -> dep (infinite);
    the source side of a minimum cut is the best closed set (Edmonds-Karp; the graphs are tiny).
    """
    source, sink = len(weights), len(weights) + 1
    capacity: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for t, weight in enumerate(weights):
        if weight > 0:
            capacity[source][t] += weight
        elif weight < 0:
            capacity[t][sink] += -weight
        for dep in deps[t]:
            capacity[t][dep] = math.inf
    positive = sum(w for w in weights if w > 0)
    flow = 0.0
    while True:
        parent: dict[int, int] = {source: source}
        queue = deque([source])
        while queue and sink not in parent:
            u = queue.popleft()
            for v, cap in list(capacity[u].items()):
                if cap > _EPS and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return max(0.0, positive - flow)
        path, v = [], sink
        while v != source:
            path.append((parent[v], v))
            v = parent[v]
        push = min(capacity[u][v] for u, v in path)
        for u, v in path:
            capacity[u][v] -= push
            capacity[v][u] += push
        flow += push


def list_schedule(
    problem: Problem,
    num_microbatches: int,
    *,
    memory_limit: float | None = None,
    name: str = "greedy",
    deadline: float | None = None,
) -> Schedule:
    """A time-aware list schedule: simulate while ordering, starting the best ready action first.

    Each step starts, among the actions the memory rule admits, the one that can start earliest;
    ties go to the longest tail (critical path first), then the older micro-batch. Each task's
    micro-batches run in increasing order, so B/W are ordered and admissions on a rank are too.

    Memory rule (no memory deadlock): a micro-batch is *admitted* on rank r by its first task that
    raises memory there, and only when ``committed_r + hold_r <= limit``, where ``hold_r`` is the most
    one micro-batch can hold on r (:func:`microbatch_peak_memory`) and ``committed_r`` is static
    memory + ``hold_r`` per admitted unfinished micro-batch + the net change of finished ones. Held
    memory never exceeds ``committed_r``, so an admitted micro-batch can always finish, and the
    oldest unfinished one can always be admitted: the schedule runs to the end.

    ``memory_limit`` overrides the problem's limit (the schedule's problem carries the one used).
    Raises SearchError naming the smallest limit this rule needs when the limit is below it, and
    when ``deadline`` (a :func:`time.perf_counter` value) passes before the schedule is complete
    (a pass costs O(tasks) per action: seconds for hundreds of thousands of actions).
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise SearchError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    limit = problem.memory_limit if memory_limit is None else float(memory_limit)
    if limit != problem.memory_limit:
        problem = replace(problem, memory_limit=limit)
    builder = _ListScheduler(problem, num_microbatches, limit)
    builder.run(deadline)
    return Schedule(
        name=name,
        problem=problem,
        num_microbatches=num_microbatches,
        ranks=tuple(tuple(actions) for actions in builder.lists),
    )


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A ready (task, micro-batch) and when it could start."""

    start: float
    priority: tuple[float, int, int]
    task: int
    microbatch: int


class _ListScheduler:
    """The state of one list-scheduling pass (see :func:`list_schedule` for the rules)."""

    def __init__(self, problem: Problem, num_microbatches: int, limit: float | None) -> None:
        tasks = problem.tasks
        index = {task.key: i for i, task in enumerate(tasks)}
        self.problem, self.num_mb, self.limit = problem, num_microbatches, limit
        self.deps = [
            [(index[d], 0.0 if set(tasks[index[d]].ranks) == set(task.ranks) else problem.comm_latency)
             for d in task.deps]
            for task in tasks
        ]
        _, tail = head_tail(problem)
        position = {t: p for p, t in enumerate(topological_order(problem))}
        self.priority = [(-tail[t], position[t]) for t in range(len(tasks))]
        num_ranks = problem.num_ranks
        self.hold = microbatch_peak_memory(problem)
        static = problem.static_memory or (0.0,) * num_ranks
        self.net = [sum(t.memory for t in tasks if r in t.ranks) for r in range(num_ranks)]
        self.count_on = [sum(1 for t in tasks if r in t.ranks) for r in range(num_ranks)]
        self.next_mb = [0] * len(tasks)
        self.users: list[list[int]] = [[] for _ in tasks]
        for t, deps in enumerate(self.deps):
            for d, _ in deps:
                self.users[d].append(t)
        self.ready = [0.0] * len(tasks)
        """Per task: when its queued micro-batch's deps are done (latency included)."""
        self.queued = [False] * len(tasks)
        """Per task: whether its next micro-batch waits in :meth:`run`'s heap."""
        self.finish: dict[tuple[int, int], float] = {}
        self.free = [0.0] * num_ranks
        self.committed = list(static)
        self.admitted: list[set[int]] = [set() for _ in range(num_ranks)]
        self.started = [defaultdict(int) for _ in range(num_ranks)]
        self.lists: list[list[Action]] = [[] for _ in range(num_ranks)]
        if limit is not None:
            need = [static[r] + self.hold[r] for r in range(num_ranks)]
            worst = max(range(num_ranks), key=need.__getitem__)
            if need[worst] > limit + _EPS * max(1.0, abs(limit)):
                raise SearchError(
                    f"memory limit {limit:g} is below {need[worst]:g}, what rank {worst} holds with one "
                    f"micro-batch's worst-case activations (static {static[worst]:g} + {self.hold[worst]:g}); "
                    f"the list scheduler needs a limit of at least {max(need):g}"
                )

    def run(self, deadline: float | None = None) -> None:
        """Start one action per step until every (task, micro-batch) has started (SearchError
        once ``deadline`` has passed, checked every 64 steps).

        Each step starts the ready candidate with the least ``(start, priority)`` that the
        admission rule allows. Candidates wait in a heap under a key that can only be too early
        (a rank's free time only grows): a popped key that is out of date goes back with its
        current start, so the first up-to-date admitted one is the least: O(log) per action.
        """
        heap: list[tuple[float, tuple[float, int, int], int, int]] = []
        for t in range(len(self.problem.tasks)):
            self._push_if_ready(heap, t)
        total = len(self.problem.tasks) * self.num_mb
        for step in range(total):
            if deadline is not None and step % 64 == 0 and time.perf_counter() > deadline:
                raise SearchError(f"the list scheduler ran out of time after {step:,} of {total:,} "
                                  "actions; raise the time limit")
            waiting, chosen = [], None
            while heap:
                entry = heapq.heappop(heap)
                start, priority, t, mb = entry
                now = self._start_time(t)
                if now > start:
                    heapq.heappush(heap, (now, priority, t, mb))
                elif self._admits(t, mb):
                    chosen = _Candidate(start, priority, t, mb)
                    break
                else:
                    waiting.append(entry)
            for entry in waiting:
                heapq.heappush(heap, entry)
            if chosen is None:
                raise SearchError(self._stuck_message())
            self.queued[chosen.task] = False
            self._start(chosen)
            for t in (chosen.task, *self.users[chosen.task]):
                self._push_if_ready(heap, t)

    def _push_if_ready(self, heap: list, t: int) -> None:
        """Queue task ``t``'s next micro-batch once every dep of it has started (finish known)."""
        mb = self.next_mb[t]
        if self.queued[t] or mb >= self.num_mb:
            return
        ready = 0.0
        for dep, latency in self.deps[t]:
            done = self.finish.get((dep, mb))
            if done is None:
                return
            ready = max(ready, done + latency)
        self.ready[t] = ready
        self.queued[t] = True
        heapq.heappush(heap, (self._start_time(t), (self.priority[t][0], mb, self.priority[t][1]), t, mb))

    def _start_time(self, t: int) -> float:
        """When task ``t``'s queued micro-batch could start: its deps done, its ranks free."""
        return max([self.ready[t]] + [self.free[r] for r in self.problem.tasks[t].ranks])

    def _admits(self, t: int, mb: int) -> bool:
        """Whether starting (t, mb) keeps the admission rule on each of its ranks."""
        task = self.problem.tasks[t]
        if self.limit is None or task.memory <= 0:
            return True
        bound = self.limit + _EPS * max(1.0, abs(self.limit))
        return all(
            mb in self.admitted[r] or self.committed[r] + self.hold[r] <= bound for r in task.ranks
        )

    def _start(self, candidate: _Candidate) -> None:
        t, mb = candidate.task, candidate.microbatch
        task = self.problem.tasks[t]
        end = candidate.start + task.duration
        self.finish[(t, mb)] = end
        self.next_mb[t] += 1
        for r in task.ranks:
            self.free[r] = end
            self.lists[r].append(Action(task.stage, task.kind, mb))
            if task.memory > 0 and mb not in self.admitted[r]:
                self.admitted[r].add(mb)
                self.committed[r] += self.hold[r]
            self.started[r][mb] += 1
            if self.started[r][mb] == self.count_on[r]:  # the micro-batch is done on r
                del self.started[r][mb]
                if mb in self.admitted[r]:
                    self.admitted[r].discard(mb)
                    self.committed[r] -= self.hold[r]
                self.committed[r] += self.net[r]

    def _stuck_message(self) -> str:
        growing = [r for r in range(self.problem.num_ranks) if self.net[r] > _EPS]
        detail = (
            f"; each micro-batch leaves {self.net[growing[0]]:g} more memory on rank {growing[0]}, "
            "so no limit fits every micro-batch count"
            if growing else ""
        )
        return (
            f"the list scheduler cannot start any action within the memory limit {self.limit:g} "
            f"after {sum(self.next_mb)} of {len(self.next_mb) * self.num_mb} actions{detail}; "
            "raise the limit or use fewer micro-batches"
        )
