"""Chrome / Perfetto trace (Trace Event Format, JSON object form) of a simulated timeline.

One process per rank (``pid = rank``, named ``rank N``; Perfetto's collapsed preview of pid 0 can
look odd, see google/perfetto#394, but its expanded tracks are right), one thread per stage the rank holds, one
complete event (``"ph": "X"``) per action (a lowered schedule's sends and receives too, category
``communication``, on their stage's thread) and a ``memory held`` counter (``"ph": "C"``) per rank.
Cross-rank dependencies are flow events (``"ph": "s"`` on the producer's slice, ``"ph": "f"`` with
``"bp": "e"`` on the consumer's, one ``id`` per pair, category ``dependency``): Perfetto draws them as
arrows from the action that made the data to the one on another rank that waits for it.
Times are integer microseconds: ``ts = round(time * time_unit_us)``, with ``time_unit_us`` (the
microseconds one schedule time unit becomes) stored in ``otherData`` and each event's ``args``
keeping the original start and end. Rounding both ends keeps back-to-back actions exactly
adjacent, so no two slices of a thread ever overlap.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeloom.ir import OVERLAP_F_B, Action, Comm, Overlap, task_actions
from pipeloom.sim import Timeline
from pipeloom.viz.style import KIND_NAMES, action_kind, action_stage, peak

__all__ = ["default_time_unit_us", "flow_events", "perfetto_events", "write_perfetto"]

_MAX_US = 2.0**53 / 1000  # keeps ts in nanoseconds (how Perfetto stores it) exact in int64 and float


def default_time_unit_us(timeline: Timeline) -> float:
    """Microseconds per schedule time unit: the smallest power of ten >= 1000 (1 unit = 1 ms)
    that makes the shortest action at least 1000 us long, so integer rounding costs < 0.05%; below 1000 where
    the makespan would pass Perfetto's exact range at 1 ms a unit (a timeline of 1e15-unit tasks had written
    timestamps above int64)."""
    shortest = min(
        (end - start for rank in range(timeline.num_ranks)
         for _, start, end in timeline.events(rank) if end > start),
        default=1.0,
    )
    power = 3  # 10**3 us a unit, lower where the makespan needs it
    while timeline.makespan * 10.0**power > _MAX_US:
        power -= 1
    while shortest * 10.0**power < 1000 and timeline.makespan * 10.0**(power + 1) <= _MAX_US:
        power += 1
    return 10**power if power >= 0 else 10.0**power  # an exact power of ten: an int from 1 us on


def _metadata(timeline: Timeline, tids: dict[tuple[int, int], int]) -> list[dict[str, Any]]:
    """process_name / thread_name (and sort-index hints for chrome://tracing) events."""
    events: list[dict[str, Any]] = []
    for rank in range(timeline.num_ranks):
        pid = rank
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": rank}})
    for (rank, stage), tid in tids.items():
        pid = rank
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"stage {stage}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": stage}})
    return events


def _thread_ids(timeline: Timeline) -> dict[tuple[int, int], int]:
    """``(rank, stage) -> tid``, positive and unique over the whole trace (tid 0 is special too)."""
    tids: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(timeline.schedule.ranks):
        for stage in sorted({action_stage(action) if type(action) is not Comm else action.stage
                             for action in actions}):
            tids[(rank, stage)] = len(tids) + 1
    return tids


def _rank_events(timeline: Timeline, rank: int, tids: dict[tuple[int, int], int], scale: float) -> list[dict]:
    """The complete events of one rank, then its memory counter (only where the value changes)."""
    pid = rank
    events: list[dict[str, Any]] = []
    for action, start, end in timeline.events(rank):
        ts = round(start * scale)
        if type(action) is Overlap:  # one event on its forward stage's thread, naming both parts
            stage, kind = action.forward.stage, OVERLAP_F_B
            args = {"stage": stage, "kind": kind, "parts": [str(part) for part in action.parts]}
        else:
            stage, kind = action.stage, action.kind
            args = {"stage": stage, "kind": kind, "microbatch": action.microbatch}
        category = KIND_NAMES.get(action_kind(action) if type(action) is not Comm else "", "communication")
        events.append({
            "name": str(action), "cat": category, "ph": "X", "pid": pid,
            "tid": tids[(rank, stage)], "ts": ts, "dur": max(0, round(end * scale) - ts),
            "args": {**args, "start": start, "end": end},
        })
    counter_tid = min((tid for (r, _), tid in tids.items() if r == rank), default=None)
    last = None
    for time, held in timeline.memory_curve(rank):
        if held == last:
            continue
        last = held
        event = {"name": "memory", "ph": "C", "pid": pid, "ts": round(time * scale), "args": {"held": held}}
        if counter_tid is not None:
            event["tid"] = counter_tid
        events.append(event)
    return events


def flow_events(timeline: Timeline, tids: dict[tuple[int, int], int], scale: float) -> list[dict[str, Any]]:
    """One flow (an ``s`` and an ``f`` event) per cross-rank dependency between two actions: from the
    action that completes a task (an overlapped pair or a split stage's B completes several) to each
    action on another rank set that needs it in the same micro-batch. Each end sits at the start of
    its slice, so it binds to that slice and no neighbour; ``f`` binds to its enclosing slice
    (``"bp": "e"``)."""
    problem = timeline.schedule.problem
    where: dict[Action, tuple[Any, int, int]] = {}  # task action -> (drawn action, rank, ts)
    for rank in range(timeline.num_ranks):
        for action, start, _ in timeline.events(rank):
            if type(action) is not Comm:
                for part in task_actions(problem, action):
                    where.setdefault(part, (action, rank, round(start * scale)))
    events: list[dict[str, Any]] = []
    seen: set[tuple[Any, Any]] = set()
    for part, (action, rank, ts) in where.items():
        task = problem.task(part.task)
        for dep in task.deps:
            producer = Action(dep[0], dep[1], part.microbatch)
            if producer not in where or set(problem.task(dep).ranks) == set(task.ranks):
                continue
            source, source_rank, source_ts = where[producer]
            if (source, action) in seen or source == action:
                continue
            seen.add((source, action))
            flow = len(seen)
            name = f"{source} -> {action}"
            events.append({"name": name, "cat": "dependency", "ph": "s", "id": flow, "pid": source_rank,
                           "tid": tids[(source_rank, _stage(source))], "ts": source_ts})
            events.append({"name": name, "cat": "dependency", "ph": "f", "bp": "e", "id": flow, "pid": rank,
                           "tid": tids[(rank, _stage(action))], "ts": ts})
    return events


def _stage(action: Action | Overlap) -> int:
    """The stage whose thread shows ``action`` (a pair's forward stage)."""
    return action.forward.stage if type(action) is Overlap else action.stage


def perfetto_events(timeline: Timeline, *, time_unit_us: float | None = None) -> dict[str, Any]:
    """The trace as a JSON-ready dict ``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``.

    ``time_unit_us`` is how many microseconds one schedule time unit becomes (default:
    :func:`default_time_unit_us`). Every ``X`` event's ``dur`` is ``round(end * s) - round(start * s)``.
    """
    scale = default_time_unit_us(timeline) if time_unit_us is None else time_unit_us
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"time_unit_us must be a positive finite number of microseconds, got {scale!r}")
    if timeline.makespan * scale > _MAX_US:
        raise ValueError(f"time_unit_us {scale:g} makes the makespan {timeline.makespan * scale:.3g} us, past the "
                         f"{_MAX_US:.3g} us Perfetto keeps exact; give a smaller time_unit_us")
    tids = _thread_ids(timeline)
    events = _metadata(timeline, tids)
    for rank in range(timeline.num_ranks):
        events.extend(_rank_events(timeline, rank, tids, scale))
    events.extend(flow_events(timeline, tids, scale))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "pipeloom",
            "schedule": timeline.schedule.name,
            "time_unit_us": scale,
            "time_note": "ts and dur are microseconds = schedule time units * time_unit_us",
            "makespan": timeline.makespan,
            "bubble_ratio": timeline.bubble_ratio,
            "peak_memory": peak(timeline),
        },
    }


def write_perfetto(timeline: Timeline, path: str | Path, *, time_unit_us: float | None = None) -> None:
    """Write :func:`perfetto_events` as JSON to ``path``; open it in ui.perfetto.dev or chrome://tracing."""
    trace = perfetto_events(timeline, time_unit_us=time_unit_us)
    Path(path).write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False) + "\n")
