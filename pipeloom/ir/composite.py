"""What a compute action stands for in a problem's task graph: the tasks it completes, its duration
and its memory change. A plain action is one task; an overlapped pair (:class:`Overlap`) is both of its
parts; a full backward ``B`` on a stage whose backward is split (tasks I and W) is that stage's I and W
run together (docs/semantics.md, "Composite actions").
"""

from __future__ import annotations

import dataclasses

from pipeloom.errors import ProblemError, ScheduleError
from pipeloom.ir.core import Action, Comm, Overlap, Schedule, compute_parts
from pipeloom.problem import Problem

__all__ = ["action_duration", "action_memory", "has_pairs", "is_split_full_backward", "pair_duration",
           "paired_forward_backward", "part_tasks", "priced_overlap", "sequential_pairs", "task_actions",
           "without_overlap"]


def is_split_full_backward(problem: Problem, action: Action) -> bool:
    """Whether ``action`` is a ``B`` of a stage that has I and W tasks and no B task."""
    stage = action.stage
    return (action.kind == "B" and not problem.has_task((stage, "B"))
            and problem.has_task((stage, "I")) and problem.has_task((stage, "W")))


def part_tasks(problem: Problem, part: Action) -> tuple[Action, ...]:
    """The task actions one plain action completes: itself, or ``sIm sWm`` for a B on a split stage."""
    if part.kind == "B" and is_split_full_backward(problem, part):
        return (part._replace(kind="I"), part._replace(kind="W"))
    return (part,)


def task_actions(problem: Problem, action: Action | Overlap | Comm) -> tuple[Action, ...]:
    """Every (task, micro-batch) ``action`` completes, in running order: ``(0F7;7B3)OVERLAP_F_B`` on
    a split stage 7 gives ``0F7 7I3 7W3``; none for communication. Each names a task of ``problem``
    when the action is one the validator accepts."""
    return tuple(task for part in compute_parts(action) for task in part_tasks(problem, part))


def _part_duration(problem: Problem, part: Action) -> float:
    return sum(problem.task(task.task).duration for task in part_tasks(problem, part))


def _part_comm(problem: Problem, part: Action) -> float:
    return sum(problem.task(task.task).comm for task in part_tasks(problem, part))


def pair_duration(times: tuple[float, float], comms: tuple[float, float], *, fraction: float = 0.0,
                  overhead: float = 0.0, slowdown: float = 0.0) -> float:
    """How long an overlapped pair occupies its rank, from its parts' ``times`` (forward, backward) and
    the communication inside them (``comms``): one device runs one compute at a time, so the pair takes
    F + B less what each part's communication hides under the other part's compute
    (``min(comm_F, B - comm_B) + min(comm_B, F - comm_F)``), less ``fraction`` of the shorter part (compute
    run at once, as two devices would), never under ``max(F, B)``; plus ``overhead``. ``fraction`` 1 with
    no communication is the longer part alone. ``slowdown``: the share of each hidden second the compute beside
    it loses (the communication's kernels hold SMs and memory bandwidth while they run), so hiding a second of
    communication saves ``1 - slowdown`` of it."""
    (f, b), (f_comm, b_comm) = times, comms
    hidden = min(f_comm, b - b_comm) + min(b_comm, f - f_comm)
    return max(f + b - hidden * (1.0 - slowdown) - fraction * min(f, b), f, b) + overhead


def priced_overlap(problem: Problem) -> bool:
    """Whether ``problem`` prices an overlapped pair below F + B: a measured ``pair_time``, an
    ``overlap_fraction`` or communication inside tasks that a pair may hide."""
    return (problem.pair_time is not None or problem.overlap_fraction > 0
            or any(task.comm > 0 for task in problem.tasks))


def without_overlap(problem: Problem) -> Problem:
    """``problem`` with its overlapped pairs priced F + B (+ overhead): no overlap fraction, no measured
    pair time, no communication inside tasks to hide; ``problem`` itself when it prices none."""
    if not priced_overlap(problem):
        return problem
    tasks = tuple(dataclasses.replace(task, comm=0.0) for task in problem.tasks)
    return dataclasses.replace(problem, tasks=tasks, overlap_fraction=0.0, pair_time=None)


def has_pairs(schedule: Schedule) -> bool:
    """Whether ``schedule`` holds an overlapped pair."""
    return any(type(action) is Overlap for row in schedule.ranks for action in row)


def action_duration(problem: Problem, action: Action | Overlap, *, overlap_overhead: float | None = None) -> float:
    """How long ``action`` occupies its rank: its task's duration; I + W for a B on a split stage;
    for an overlapped pair the problem's measured ``pair_time`` if given, else :func:`pair_duration`
    with the problem's ``overlap_fraction`` and ``overlap_overhead`` (``overlap_overhead`` given: that
    one). ScheduleError when it names no task of the problem."""
    try:
        if type(action) is Overlap:
            if problem.pair_time is not None:
                return problem.pair_time
            overhead = problem.overlap_overhead if overlap_overhead is None else overlap_overhead
            times = (_part_duration(problem, action.forward), _part_duration(problem, action.backward))
            comms = (_part_comm(problem, action.forward), _part_comm(problem, action.backward))
            return pair_duration(times, comms, fraction=problem.overlap_fraction, overhead=overhead)
        return _part_duration(problem, action)
    except ProblemError as error:  # no such task
        raise ScheduleError(f"{action} is not an action of this schedule's problem: {error}") from None


def action_memory(problem: Problem, action: Action | Overlap | Comm) -> float:
    """The memory change of ``action`` when it starts: the sum over the tasks it completes (0 for
    communication)."""
    return sum(problem.task(task.task).memory for task in task_actions(problem, action))


def sequential_pairs(schedule: Schedule) -> Schedule:
    """``schedule`` with every overlapped pair replaced by its two parts, forward then backward: how
    pipeloom's runtime runs a pair (one after the other on one device), so what the planner prices.
    A schedule without pairs is returned as it is."""
    if not has_pairs(schedule):
        return schedule
    ranks = tuple(tuple(part for action in row
                        for part in (action.parts if type(action) is Overlap else (action,)))
                  for row in schedule.ranks)
    return dataclasses.replace(schedule, ranks=ranks)


def paired_forward_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every full backward that its rank runs right before a forward of another micro-batch made
    one overlapped pair with that forward: Megatron-Core's combined 1F1B with ``overlap_moe_expert_parallel_comm``,
    where each part's expert all-to-all hides under the other part's compute. The pair takes the backward's place,
    so it holds no more than the backward-then-forward it replaces; a forward and a backward of the same micro-batch
    stay apart, and pairing each backward with the forward after it (not the one before) keeps interleaved 1F1B
    free of deadlock (a pair of a rank waiting on its neighbour's pair, which waits on it). A split backward (I, W)
    and actions already paired are left as they are."""
    rows = []
    for row in schedule.ranks:
        out: list = []
        for action in row:
            last = out[-1] if out else None
            if (type(action) is Action and action.kind == "F" and type(last) is Action and last.kind == "B"
                    and last.microbatch != action.microbatch):
                out[-1] = Overlap(action, last)
            else:
                out.append(action)
        rows.append(tuple(out))
    return dataclasses.replace(schedule, ranks=tuple(rows))
