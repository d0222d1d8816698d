"""Checks that a schedule is valid for its problem (DESIGN §3), with errors that point at the step.

``validate`` checks completeness, duplicates, foreign actions, deadlock, the memory limit and,
on request, the "ordered" rule (B/W of a stage in micro-batch order) the exact runtime needs; in a
lowered schedule also its communication (:func:`pipeloom.lowering.check_comms`).
"""

from __future__ import annotations

from itertools import islice

from pipeloom.errors import MemoryLimitError, OrderError, ScheduleError
from pipeloom.ir import Action, Comm, Schedule, format_grid
from pipeloom.lowering import check_comms
from pipeloom.sim import Timeline, simulate

__all__ = ["validate", "check_structure", "check_memory", "check_order", "is_valid"]

_TOLERANCE = 1e-9


def validate(schedule: Schedule, *, ordered: bool = False, check_memory_limit: bool = True) -> Timeline:
    """Raise a ScheduleError subclass naming action, rank and step if ``schedule`` is invalid.

    Returns the simulated :class:`~pipeloom.sim.Timeline` (the deadlock check needs it anyway).
    The structure check runs first and costs O(actions), whatever the micro-batch count claims.
    A lowered schedule's communication is checked next (CommError: unmatched send or receive,
    pair order, a receive missing before use); its replay finds deadlocks through communication.
    """
    check_structure(schedule)
    if schedule.lowered:
        check_comms(schedule)
    timeline = simulate(schedule)
    if check_memory_limit:
        check_memory(timeline)
    if ordered:
        check_order(schedule)
    return timeline


def is_valid(schedule: Schedule, *, ordered: bool = False) -> bool:
    """True when :func:`validate` accepts the schedule."""
    try:
        validate(schedule, ordered=ordered)
    except ScheduleError:
        return False
    return True


def _fail(schedule: Schedule, rank: int, step: int, message: str, error: type = ScheduleError) -> None:
    raise error(
        f"schedule {schedule.name!r}, rank {rank} step {step}: {message}\n"
        + format_grid(schedule.ranks, mark=(rank, step))
    )


def check_structure(schedule: Schedule) -> None:
    """Every (task, micro-batch) exactly once on each of its ranks, and nothing else (communication
    actions are left to :func:`pipeloom.lowering.check_comms`)."""
    problem = schedule.problem
    num_mb = schedule.num_microbatches
    for r, actions in enumerate(schedule.ranks):
        own = {task.key for task in problem.tasks if r in task.ranks}
        seen: set[Action] = set()
        for step, action in enumerate(actions):
            key = (action[0], action[1])
            if key not in own:
                if type(action) is Comm:
                    continue
                if problem.has_task(key):
                    ranks = list(problem.task(key).ranks)
                    _fail(schedule, r, step, f"{action} belongs to ranks {ranks}, not rank {r}")
                _fail(schedule, r, step, f"{action} names task {key[0]}{key[1]}, which the problem does not have")
            if not 0 <= action[2] < num_mb:
                _fail(
                    schedule, r, step,
                    f"{action} uses micro-batch {action[2]}, outside 0..{num_mb - 1}",
                )
            if action in seen:
                _fail(schedule, r, step, f"{action} runs twice on rank {r}")
            seen.add(action)
        expected = len(own) * num_mb
        if len(seen) != expected:
            # M may be huge (a file can claim 10**12 micro-batches): count the gap, list only the
            # first 6 missing actions, lazily and in sorted order (stage, kind, micro-batch).
            missing = (
                Action(stage, kind, mb)
                for stage, kind in sorted(own) for mb in range(num_mb)
                if Action(stage, kind, mb) not in seen
            )
            first = list(islice(missing, 6))
            count = expected - len(seen)
            shown = ", ".join(map(str, first)) + (", ..." if count > len(first) else "")
            _fail(
                schedule, r, len(actions),
                f"rank {r} never runs {count} action(s) it owns: {shown}",
            )


def check_memory(timeline: Timeline) -> None:
    """Raise MemoryLimitError at the first action that takes a rank above the memory limit."""
    schedule = timeline.schedule
    limit = schedule.problem.memory_limit
    if limit is None:
        return
    bound = limit + _TOLERANCE * max(1.0, abs(limit))
    for r, peak in enumerate(timeline.peak_memory):
        if peak <= bound:
            continue
        held = timeline.memory_curve(r)
        if held[0][1] > bound:
            _fail(schedule, r, 0, f"static memory {held[0][1]:g} exceeds the limit {limit:g} "
                  "before any action runs; raise the limit or lower the static memory", MemoryLimitError)
        step = next(i for i, (_, value) in enumerate(held[1:]) if value > bound)
        action = schedule.ranks[r][step]
        _fail(
            schedule, r, step,
            f"{action} raises held memory to {held[step + 1][1]:g}, above the limit {limit:g} "
            f"(peak on rank {r}: {peak:g}); raise the limit or use a schedule that holds fewer activations",
            MemoryLimitError,
        )


def check_order(schedule: Schedule) -> None:
    """B and W actions of each stage run in increasing micro-batch order on every rank."""
    for r, actions in enumerate(schedule.ranks):
        last: dict[tuple[int, str], tuple[int, int]] = {}
        for step, action in enumerate(actions):
            if action[1] not in ("B", "W"):
                continue
            key = (action[0], action[1])
            previous = last.get(key)
            if previous is not None and action[2] < previous[0]:
                _fail(
                    schedule, r, step,
                    f"{action} runs after {action[0]}{action[1]}{previous[0]} (step {previous[1]}); "
                    "gradient-producing actions of a stage must run in micro-batch order for exact gradients",
                    OrderError,
                )
            last[key] = (action[2], step)
