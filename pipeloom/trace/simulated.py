"""Trace documents of a run that behaves like simulated timelines: to try the trace tools without a
GPU, and as the tests' oracle (the simulator's own times must come back)."""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.ir import task_actions
from pipeloom.sim import Timeline
from pipeloom.trace.errors import TraceFormatError
from pipeloom.trace.format import step_record, trace_document

__all__ = ["simulated_run_trace"]


def simulated_run_trace(timelines: Sequence[Timeline], *, unit_ns: int = 1_000_000,
                        start_ns: int = 1_700_000_000_000_000_000, gap_ns: int = 1_000_000) -> list[dict]:
    """The trace documents (one per rank) of a run whose step ``k`` behaves like ``timelines[k]``.

    All timelines must simulate the same action lists (e.g. one schedule re-costed per step). One
    schedule time unit lasts ``unit_ns``; steps follow each other ``gap_ns`` apart. Each idle gap
    before an action becomes a ``wait`` event, and each action whose output another rank uses is
    followed by a zero-length ``send`` event, as the engine records them.
    """
    if not timelines:
        raise TraceFormatError("simulated_run_trace needs at least one timeline (one per step)")
    schedule = timelines[0].schedule
    if any(t.schedule.ranks != schedule.ranks for t in timelines):
        raise TraceFormatError("the timelines simulate different action lists; give one schedule's timelines")
    ranks: list[list[dict]] = [[] for _ in range(schedule.num_ranks)]
    origin = start_ns
    for step, timeline in enumerate(timelines):
        end = origin + round(timeline.makespan * unit_ns)
        for rank, steps in enumerate(ranks):
            steps.append(step_record(step, origin, end, _simulated_events(timeline, rank, origin, unit_ns)))
        origin = end + gap_ns
    return [trace_document(rank=rank, world_size=schedule.num_ranks, schedule=schedule, steps=steps)
            for rank, steps in enumerate(ranks)]


def _simulated_events(timeline: Timeline, rank: int, origin: int, unit_ns: int) -> list[tuple[str, str, int, int]]:
    """One rank's ``(name, kind, start_ns, end_ns)`` events of one simulated step: waits in the gaps,
    computes, sends to other ranks."""

    def ns(time: float) -> int:
        return origin + round(time * unit_ns)

    problem = timeline.schedule.problem
    users: dict[tuple[int, str], set[int]] = {}
    for task in problem.tasks:
        for dep in task.deps:
            users.setdefault(dep, set()).update(q for q in task.ranks if q not in problem.task(dep).ranks)
    events, free = [], 0.0
    for action, start, end in timeline.events(rank):
        if start > free:
            events.append((f"RECV for {action}", "wait", ns(free), ns(start)))
        events.append((str(action), "compute", ns(start), ns(end)))
        for q in sorted(set().union(*(users.get(part.task, ()) for part in task_actions(problem, action)))):
            events.append((f"SEND {action} to {q}", "send", ns(end), ns(end)))
        free = end
    return events
