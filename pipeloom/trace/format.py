"""The runtime's per-rank trace format ``pipeloom.runtime-trace/1`` (docs/trace.md): its records and
the writer the engine uses. One file per rank, ``<folder>/rank<R>.json``; times are ``time.time_ns()``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeloom.ir import Schedule, schedule_to_json

__all__ = [
    "CLOCK",
    "EVENT_KINDS",
    "TRACE_FORMAT",
    "RunTrace",
    "StepTrace",
    "TraceEvent",
    "rank_file",
    "step_record",
    "trace_document",
    "write_run_trace",
    "write_trace_file",
]

TRACE_FORMAT = "pipeloom.runtime-trace/1"
"""The ``format`` tag of a per-rank trace file this version reads and writes."""
CLOCK = "unix_ns"
"""The ``clock`` of every time in a trace file: ``time.time_ns()`` values."""
EVENT_KINDS = ("compute", "wait", "send", "post")
"""Event kinds kept when reading; any other kind (``loss``, ``sync``, ...) is skipped."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceEvent:
    """One timed interval on one rank; times are ``time.time_ns()`` values."""

    name: str
    """Action text (``0F1``) for compute events; free text for the others."""
    kind: str
    """``compute``, ``wait`` (blocked on a receive), ``send`` (posting a send) or ``post`` (posting a
    receive ahead of its action)."""
    start_ns: int
    """Start, nanoseconds since the epoch."""
    end_ns: int
    """End, nanoseconds since the epoch (>= start_ns)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTrace:
    """One rank's record of one ``engine.step`` call."""

    step: int
    """Step number as the engine counted it."""
    start_ns: int
    """Start of the ``engine.step`` call on this rank."""
    end_ns: int
    """End of the ``engine.step`` call on this rank."""
    events: tuple[TraceEvent, ...]
    """Compute, wait, send and post events, in the order the file lists them."""

    def of_kind(self, kind: str) -> tuple[TraceEvent, ...]:
        """The events of ``kind``; ``compute`` ones follow the rank's action list."""
        return tuple(event for event in self.events if event.kind == kind)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunTrace:
    """Every rank's trace of one run, checked against the schedule the run executed."""

    schedule: Schedule
    """The schedule the engine ran (its durations are the planned ones, in the plan's units)."""
    paths: tuple[Path, ...]
    """``paths[r]`` is the file rank r wrote."""
    steps: tuple[int, ...]
    """Step numbers that every rank recorded, increasing."""
    ranks: tuple[tuple[StepTrace, ...], ...]
    """``ranks[r][i]`` is rank r's record of step ``steps[i]``."""
    notes: tuple[str, ...] = ()
    """What was left out while reading (e.g. a step only some ranks recorded)."""

    @property
    def world_size(self) -> int:
        """Number of ranks of the run."""
        return len(self.ranks)


# ------------------------------------------------------------------------------------- writing


def step_record(step: int, start_ns: int, end_ns: int, events: Iterable[tuple[str, str, int, int]]) -> dict:
    """One entry of a document's ``steps``: a step's bounds and its ``(name, kind, start_ns, end_ns)``
    events, in the order they happened."""
    return {
        "step": step, "start_ns": start_ns, "end_ns": end_ns,
        "events": [{"name": n, "kind": k, "start_ns": a, "end_ns": b} for n, k, a, b in events],
    }


def trace_document(*, rank: int, world_size: int, schedule: Schedule, steps: list[dict]) -> dict:
    """One rank's trace document: the format tag, the clock, the schedule run and its ``steps``
    (:func:`step_record` entries)."""
    return {
        "format": TRACE_FORMAT, "rank": rank, "world_size": world_size,
        "clock": CLOCK, "schedule": json.loads(schedule_to_json(schedule)),
        "steps": steps,
    }


def rank_file(folder: str | os.PathLike, rank: int) -> Path:
    """``folder/rank<R>.json``, the file rank ``rank`` writes."""
    return Path(folder) / f"rank{rank}.json"


def write_trace_file(document: dict, path: str | os.PathLike) -> Path:
    """Write one document as JSON to ``path`` (its folder is created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document) + "\n", encoding="utf-8")
    return path


def write_run_trace(documents: Sequence[dict], folder: str | os.PathLike) -> list[Path]:
    """Write each document to ``folder/rank<R>.json`` (the folder is created); returns the paths."""
    return [write_trace_file(document, rank_file(folder, document["rank"])) for document in documents]
