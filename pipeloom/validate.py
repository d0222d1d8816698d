"""Checks that a schedule is valid for its problem (docs/design.md §3), with errors that point at the step.

``validate`` checks completeness, duplicates, foreign actions, deadlock, the memory limit and,
on request, the "ordered" rule (B/W of a stage in micro-batch order) the exact runtime needs; in a
lowered schedule also its communication (:func:`pipeloom.lowering.check_comms`).
"""

from __future__ import annotations

from itertools import islice

from pipeloom.errors import MemoryLimitError, OrderError, ScheduleError, require_type
from pipeloom.ir import Action, Comm, Overlap, Schedule, format_grid, task_actions
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
    require_type("schedule", schedule, Schedule, "a pipeloom Schedule (e.g. build_schedule('1f1b', 4, 8) or "
                 "load_schedule(path))")
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
    actions are left to :func:`pipeloom.lowering.check_comms`).

    A composite action counts as the tasks it completes (:func:`pipeloom.ir.task_actions`): an
    overlapped pair as its two parts, a ``B`` on a split stage as its I and W; each of them must be
    the rank's and run on that rank alone.
    """
    problem = schedule.problem
    num_mb = schedule.num_microbatches
    owned: list[set] = [set() for _ in schedule.ranks]  # one pass over the tasks, not one per rank
    for task in problem.tasks:
        for rank in task.ranks:
            if rank < len(owned):
                owned[rank].add(task.key)
    for r, actions in enumerate(schedule.ranks):
        own = owned[r]
        seen: set[Action] = set()
        for step, action in enumerate(actions):
            if type(action) is Comm:
                continue
            if type(action) is Action and action.task in own and 0 <= action.microbatch < num_mb:
                if action in seen:  # a task of this rank's, in range: the one check left, done here
                    _fail(schedule, r, step, f"{action} runs twice on rank {r}")
                seen.add(action)
                continue
            composite = type(action) is Overlap or not problem.has_task(action.task)
            for part in task_actions(problem, action):
                _check_part(schedule, r, step, action, part, own, composite)
                if part in seen:
                    twice = f"{part} (in {action})" if composite else str(action)
                    _fail(schedule, r, step, f"{twice} runs twice on rank {r}")
                seen.add(part)
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


def _check_part(schedule: Schedule, r: int, step: int, action: Action | Overlap, part: Action,
                own: set, composite: bool) -> None:
    """``part`` (a task ``action`` completes) is a task of rank ``r`` in the micro-batch range; a
    composite's parts run on rank ``r`` alone."""
    problem = schedule.problem
    where = f"{action}" if not composite or part == action else f"{action} (its part {part})"
    key = part.task
    if key not in own:
        if problem.has_task(key):
            ranks = list(problem.task(key).ranks)
            _fail(schedule, r, step, f"{where} belongs to ranks {ranks}, not rank {r}")
        _fail(schedule, r, step, f"{where} names task {key[0]}{key[1]}, which the problem does not have")
    if composite and len(problem.task(key).ranks) != 1:
        _fail(schedule, r, step, f"{where}: task {key[0]}{key[1]} runs on ranks {list(problem.task(key).ranks)}; "
              "the parts of a composite action (an overlapped pair, a B on a split stage) must each run on "
              "one rank: write them as separate actions")
    if not 0 <= part.microbatch < schedule.num_microbatches:
        _fail(schedule, r, step,
              f"{where} uses micro-batch {part.microbatch}, outside 0..{schedule.num_microbatches - 1}")


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
    """B and W actions of each stage run in increasing micro-batch order on every rank (a pair's
    backward part counts; a B on a split stage counts as its W)."""
    problem = schedule.problem
    for r, actions in enumerate(schedule.ranks):
        last: dict[tuple[int, str], tuple[int, int]] = {}
        for step, action in enumerate(actions):
            if type(action) is Comm:
                continue
            if type(action) is Overlap or (action.kind == "B" and not problem.has_task(action.task)):
                parts = task_actions(problem, action)
            else:
                parts = (action,)
            for part in parts:
                if part.kind not in ("B", "W"):
                    continue
                key = part.task
                previous = last.get(key)
                if previous is not None and part.microbatch < previous[0]:
                    _fail(
                        schedule, r, step,
                        f"{action} runs after {part.stage}{part.kind}{previous[0]} (step {previous[1]}); "
                        "gradient-producing actions of a stage must run in micro-batch order for exact gradients",
                        OrderError,
                    )
                last[key] = (part.microbatch, step)
