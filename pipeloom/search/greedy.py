"""Memory-aware list scheduling: a valid, deadlock-free schedule for any problem in one pass.

It warm-starts the exact search and stands in where no built-in schedule fits the placement.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from pipeloom import graph
from pipeloom.ir import Schedule
from pipeloom.problem import Problem
from pipeloom.schedules.kernel import ListProblem, ListTask, list_schedule_kernel
from pipeloom.search.cpsat import integer_scale, to_units
from pipeloom.search.errors import SearchError
from pipeloom.search.memory_bounds import limit_of
from pipeloom.search.paths import dep_indices, head_tail, topological_order

__all__ = ["feasible_limit_note", "list_schedule", "microbatch_peak_memory"]

_EPS = 1e-9


def microbatch_peak_memory(problem: Problem) -> tuple[float, ...]:
    """Per rank: the most memory one micro-batch can hold there, whatever order its tasks run in.

    Started tasks always form a dependency-closed set D (a task starts after its deps), so the
    micro-batch holds ``sum_{t in D, r in ranks(t)} memory_t`` on rank r; this is the maximum of that
    sum over closed sets (never below 0: the empty set), a max-weight closure found by a min cut
    (:func:`pipeloom.graph.max_weight_closure`). Static memory is not included.
    """
    tasks = problem.tasks
    preds = dep_indices(problem)
    ancestors = graph.ancestors(preds, graph.topological_order(preds))  # bit d: d runs before t
    weighted: list[list[int]] = [[] for _ in range(problem.num_ranks)]
    for t, task in enumerate(tasks):
        if task.memory != 0:
            for rank in task.ranks:
                weighted[rank].append(t)
    peaks = []
    for nodes in weighted:
        # zero-weight tasks only link the weighted ones: close over the ancestry among these alone
        deps = [[j for j, a in enumerate(nodes) if ancestors[t] >> a & 1] for t in nodes]
        peaks.append(_max_closure([tasks[t].memory for t in nodes], deps))
    return tuple(peaks)


def _max_closure(weights: list[float], deps: list[list[int]]) -> float:
    """``max over D closed under deps of sum(weights[D])`` (at least 0): the closure of the weights
    in integer units (exact where a power of ten up to 10**6 makes them whole, else the positive
    ones total 2**40 units), summed in real units."""
    positive = sum(w for w in weights if w > 0)
    scale, exact = integer_scale(weights, top=positive, fitted=2**40)
    closed = graph.max_weight_closure(to_units(weights, scale, exact=exact), deps)
    return max(0.0, sum(weights[t] for t in closed))


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
    limit = limit_of(problem, memory_limit)
    if limit != problem.memory_limit:
        problem = replace(problem, memory_limit=limit)
    rules = _AdmissionRules(problem, limit)
    result = list_schedule_kernel(_list_problem(problem, num_microbatches), rules, deadline=deadline)
    if result.timed_out:
        raise SearchError(f"the list scheduler ran out of time after {result.placed:,} of {result.total:,} "
                          "actions; raise the time limit")
    if not result.complete:
        raise SearchError(rules.stuck_message(result.placed, result.total))
    return Schedule(name=name, problem=problem, num_microbatches=num_microbatches, ranks=result.ranks)


def _list_problem(problem: Problem, num_microbatches: int) -> ListProblem:
    """The kernel's problem data: a dep across a change of ranks pays ``problem.comm_latency``."""
    tasks = problem.tasks
    index = {task.key: i for i, task in enumerate(tasks)}
    return ListProblem(
        num_ranks=problem.num_ranks,
        num_microbatches=num_microbatches,
        tasks=tuple(
            ListTask(stage=task.stage, kind=task.kind, ranks=task.ranks, duration=task.duration,
                     memory=task.memory,
                     deps=tuple((index[d], 0.0 if set(tasks[index[d]].ranks) == set(task.ranks)
                                 else problem.comm_latency) for d in task.deps))
            for task in tasks
        ),
    )


class _AdmissionRules:
    """Priority (least start first, then longest tail, older micro-batch, topological position)
    and the memory admission rule of :func:`list_schedule`, with the state that rule keeps."""

    def __init__(self, problem: Problem, limit: float | None) -> None:
        tasks = problem.tasks
        self.problem, self.limit = problem, limit
        _, tail = head_tail(problem)
        position = {t: p for p, t in enumerate(topological_order(problem))}
        self.rank_priority = [(-tail[t], position[t]) for t in range(len(tasks))]
        num_ranks = problem.num_ranks
        self.hold = microbatch_peak_memory(problem)
        static = problem.static_memory or (0.0,) * num_ranks
        self.net = [sum(t.memory for t in tasks if r in t.ranks) for r in range(num_ranks)]
        self.count_on = [sum(1 for t in tasks if r in t.ranks) for r in range(num_ranks)]
        self.committed = list(static)
        self.admitted: list[set[int]] = [set() for _ in range(num_ranks)]
        self.started_on: list[defaultdict[int, int]] = [defaultdict(int) for _ in range(num_ranks)]
        if limit is not None:
            need = [static[r] + self.hold[r] for r in range(num_ranks)]
            worst = max(range(num_ranks), key=need.__getitem__)
            if need[worst] > limit + _EPS * max(1.0, abs(limit)):
                raise SearchError(
                    f"memory limit {limit:g} is below {need[worst]:g}, what rank {worst} holds with one "
                    f"micro-batch's worst-case activations (static {static[worst]:g} + {self.hold[worst]:g}); "
                    f"the list scheduler needs a limit of at least {max(need):g}"
                )

    def priority(self, t: int, mb: int) -> tuple[float, int, int]:
        """Longest tail first (critical path), then the older micro-batch, then topological order."""
        tail, position = self.rank_priority[t]
        return (tail, mb, position)

    def admits(self, t: int, mb: int) -> bool:
        """Whether starting (t, mb) keeps ``committed_r + hold_r <= limit`` on each rank it newly admits."""
        task = self.problem.tasks[t]
        if self.limit is None or task.memory <= 0:
            return True
        bound = self.limit + _EPS * max(1.0, abs(self.limit))
        return all(
            mb in self.admitted[r] or self.committed[r] + self.hold[r] <= bound for r in task.ranks
        )

    def started(self, t: int, mb: int) -> None:
        """Commit ``hold_r`` on admission; on the micro-batch's last task on r, trade it for ``net_r``."""
        task = self.problem.tasks[t]
        for r in task.ranks:
            if task.memory > 0 and mb not in self.admitted[r]:
                self.admitted[r].add(mb)
                self.committed[r] += self.hold[r]
            self.started_on[r][mb] += 1
            if self.started_on[r][mb] == self.count_on[r]:  # the micro-batch is done on r
                del self.started_on[r][mb]
                if mb in self.admitted[r]:
                    self.admitted[r].discard(mb)
                    self.committed[r] -= self.hold[r]
                self.committed[r] += self.net[r]

    def stuck_message(self, placed: int, total: int) -> str:
        growing = [r for r in range(self.problem.num_ranks) if self.net[r] > _EPS]
        detail = (
            f"; each micro-batch leaves {self.net[growing[0]]:g} more memory on rank {growing[0]}, "
            "so no limit fits every micro-batch count"
            if growing else ""
        )
        return (
            f"the list scheduler cannot start any action within the memory limit {self.limit:g} "
            f"after {placed} of {total} actions{detail}; "
            "raise the limit or use fewer micro-batches"
        )


def feasible_limit_note(problem: Problem, num_microbatches: int, *, periodic_limit: float | None = None,
                        deadline: float | None = None) -> str:
    """The smallest memory limit known to work, for the error when none is met (exact and
    periodic mode alike): the least of ``periodic_limit`` (the least a repetend needs, when the
    caller knows it) and what the list scheduler needs running micro-batches on each rank one after
    another (per rank: static memory, what the micro-batches before the last leave held, and one
    micro-batch's peak) when it meets that (by ``deadline``, a :func:`time.perf_counter` value);
    "unknown" when neither is known. Where that is also what every schedule holds at its end (memory
    never freed), it is the smallest feasible limit, said as such."""
    static = problem.static_memory or (0.0,) * problem.num_ranks
    net = [sum(task.memory for task in problem.tasks_on(r)) for r in range(problem.num_ranks)]
    enough = max(s + h + (num_microbatches - 1) * max(0.0, n)
                 for s, h, n in zip(static, microbatch_peak_memory(problem), net))
    known = [] if periodic_limit is None else [(periodic_limit, "a periodic schedule")]
    try:
        list_schedule(problem, num_microbatches, memory_limit=enough, deadline=deadline)
    except SearchError:
        pass
    else:
        known.append((enough, "the list schedule"))
    if not known:
        return "the smallest feasible limit is unknown"
    value, source = min(known)
    held_at_end = max(s + num_microbatches * n for s, n in zip(static, net))
    if value <= held_at_end * (1 + 1e-12):
        return (f"the smallest feasible limit is {value:g} (every schedule holds that at its end, and "
                f"{source} meets it)")
    return (f"the smallest limit known to work is {value:g} ({source} meets it), so the smallest "
            f"feasible limit is at most {value:g}")
