"""Reading one run's trace files (``pipeloom.runtime-trace/1``, :mod:`pipeloom.trace.format`): every
rank's file, checked against the others and against the schedule they carry, as a :class:`RunTrace`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeloom.errors import PipeloomError, shown
from pipeloom.ir import Schedule, schedule_from_json
from pipeloom.ir.jsonfields import json_failure
from pipeloom.trace.errors import TraceFormatError
from pipeloom.trace.format import CLOCK, EVENT_KINDS, TRACE_FORMAT, RunTrace, StepTrace, TraceEvent

__all__ = ["load_run_trace", "run_trace_from_documents"]

_RANK_FILE = re.compile(r"rank(\d+)\.json")
_FIX = "record the run again into an empty folder"


def _rank_number(file: Path) -> int:
    """N of a ``rank<N>.json`` file (only such names are listed)."""
    match = _RANK_FILE.fullmatch(file.name)
    assert match is not None, file
    return int(match.group(1))


def load_run_trace(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> RunTrace:
    """Read and check the ``rank*.json`` files of one run: a folder, a file, or a list of either.

    Every rank 0..world_size-1 must be present exactly once, all files must carry the same
    ``world_size`` and schedule, the compute events of each step must be the rank's actions in
    order, and each step's ``engine.step`` calls must overlap in time on all ranks (files of two
    runs do not). Steps that only some ranks recorded are left out, with a note.
    """
    return _checked_run([(path, _read_document(path)) for path in _trace_files(paths)])


def run_trace_from_documents(documents: Sequence[object]) -> RunTrace:
    """:func:`load_run_trace` for documents already in memory, e.g. every rank's
    ``engine.trace_document()`` gathered in one process; the same checks, and messages name
    document k as ``document k``."""
    if not documents:
        raise TraceFormatError("no trace documents given; pass every rank's engine.trace_document()")
    return _checked_run([(Path(f"document {k}"), _check_document(Path(f"document {k}"), document))
                         for k, document in enumerate(documents)])


def _checked_run(documents: list[tuple[Path, dict]]) -> RunTrace:
    """The :class:`RunTrace` of checked documents, each named by its path in messages."""
    by_rank = _check_ranks(documents)
    schedule = _check_schedules(by_rank)
    records = [_rank_steps(path, document, schedule) for path, document in by_rank]
    steps, notes = _common_steps(records, [path for path, _ in by_rank])
    ranks = tuple(tuple(record[n] for n in steps) for record in records)
    _check_overlap(steps, ranks, [path for path, _ in by_rank])
    return RunTrace(schedule=schedule, paths=tuple(path for path, _ in by_rank), steps=steps,
                    ranks=ranks, notes=tuple(notes))


def _trace_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The files named, a folder standing for its ``rank<N>.json`` files; each file once."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = [f for f in path.iterdir() if _RANK_FILE.fullmatch(f.name) and f.is_file()]
            if not found:
                raise TraceFormatError(f"{path}: no rank<N>.json files in this folder; record a run with "
                                       f"record={str(path)!r} (or PIPELOOM_TRACE={path})")
            files.extend(sorted(found, key=_rank_number))
        elif path.is_file():
            files.append(path)
        else:
            raise TraceFormatError(f"{path}: no such file or folder")
    if not files:
        raise TraceFormatError("no trace files given; pass the run's trace folder or its rank*.json files")
    seen: set[Path] = set()
    unique = []
    for file in files:  # a file named twice (or by its folder too) counts once
        if file.resolve() not in seen:
            seen.add(file.resolve())
            unique.append(file)
    return unique


def _read_document(path: Path) -> dict:
    """The checked top-level object of one file (format, clock, rank, world_size, schedule, steps)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise TraceFormatError(f"{path}: not UTF-8 text (byte {error.start}); pass a rank*.json trace") from None
    except OSError as error:
        raise TraceFormatError(f"{path}: cannot read it ({error.strerror or error})") from None
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise TraceFormatError(f"{path}: malformed JSON ({json_failure(error)}); was the run stopped while it was "
                               f"writing? {_FIX}") from None
    return _check_document(path, document)


def _check_document(path: Path, document: object) -> dict:
    """``document`` checked as the top-level object of a trace (format, clock, rank, world_size,
    schedule, steps)."""
    if not isinstance(document, dict):
        raise TraceFormatError(f"{path}: a trace file holds a JSON object, got {type(document).__name__}")
    _check_format(path, document)
    for key, kind in (("rank", int), ("world_size", int), ("schedule", dict), ("steps", list)):
        _field(path, document, key, kind)
    if document["world_size"] < 1 or not 0 <= document["rank"] < document["world_size"]:
        raise TraceFormatError(f"{path}: rank {document['rank']} is not in 0..world_size-1 "
                               f"(world_size {document['world_size']})")
    if document.get("clock") != CLOCK:
        raise TraceFormatError(f"{path}: clock {shown(document.get('clock'))} is not supported; "
                               f"expected {CLOCK!r} (time.time_ns() values)")
    return document


def _check_format(path: Path, document: dict) -> None:
    """The ``format`` tag, with a hint for the files people pass by mistake."""
    tag = document.get("format")
    if tag == TRACE_FORMAT:
        return
    if tag is None and "traceEvents" in document:
        hint = "it is a Chrome/Perfetto trace (e.g. one pipeloom wrote), not a runtime trace"
    elif tag is None:
        hint = "it has no 'format' key"
    elif isinstance(tag, str) and tag.startswith("pipeloom.runtime-trace/"):
        hint = f"its format {tag!r} is another version than this pipeloom reads; upgrade pipeloom"
    elif isinstance(tag, str) and tag.startswith("pipeloom.schedule/"):
        hint = "it is a schedule file, not a runtime trace"
    else:
        hint = f"its format {shown(tag)} is not a pipeloom runtime trace"
    raise TraceFormatError(f"{path}: {hint}; expected \"format\": \"{TRACE_FORMAT}\" "
                           "(pass the rank*.json files the engine writes with record=FOLDER)")


def _field(path: Path, obj: dict, key: str, kind: type, where: str = "") -> Any:
    """``obj[key]``, which must be a ``kind`` (an int is never a bool)."""
    if key not in obj:
        raise TraceFormatError(f"{path}: {where}missing key {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TraceFormatError(f"{path}: {where}{key} must be {kind.__name__}, got {shown(value)}")
    return value


def _check_ranks(documents: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The documents in rank order; every rank once, one world size."""
    first_path, first = documents[0]
    world = first["world_size"]
    by_rank: dict[int, tuple[Path, dict]] = {}
    for path, document in documents:
        if document["world_size"] != world:
            raise TraceFormatError(f"{path} has world_size {document['world_size']} but {first_path} has "
                                   f"{world}: files of different runs; {_FIX}")
        rank = document["rank"]
        if rank in by_rank:
            raise TraceFormatError(f"rank {rank} is in both {by_rank[rank][0]} and {path}: files of "
                                   f"different runs; pass one file per rank")
        by_rank[rank] = (path, document)
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        names = ", ".join(f"rank{r}.json" for r in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise TraceFormatError(f"missing {names} of the {world} ranks (world_size in {first_path}); "
                               "pass every rank's file, e.g. the whole trace folder")
    return [by_rank[r] for r in range(world)]


def _check_schedules(by_rank: list[tuple[Path, dict]]) -> Schedule:
    """The one schedule every file carries, parsed and matching the world size."""
    path0, document0 = by_rank[0]
    for path, document in by_rank[1:]:
        if document["schedule"] != document0["schedule"]:
            raise TraceFormatError(f"{path} records another schedule than {path0}: files of different "
                                   f"runs; {_FIX}")
    try:
        schedule = schedule_from_json(json.dumps(document0["schedule"]))
    except PipeloomError as error:
        raise TraceFormatError(f"{path0}: its schedule cannot be read: {error}") from None
    if schedule.num_ranks != len(by_rank):
        raise TraceFormatError(f"{path0}: the schedule has {schedule.num_ranks} ranks but the run has "
                               f"world_size {len(by_rank)}")
    return schedule


def _rank_steps(path: Path, document: dict, schedule: Schedule) -> dict[int, StepTrace]:
    """``{step number: StepTrace}`` of one file; compute events checked against the rank's list."""
    expected = [str(action) for action in schedule.ranks[document["rank"]]]
    steps: dict[int, StepTrace] = {}
    for i, entry in enumerate(document["steps"]):
        where = f"steps[{i}]: "
        if not isinstance(entry, dict):
            raise TraceFormatError(f"{path}: {where}expected an object, got {shown(entry)}")
        step = _field(path, entry, "step", int, where)
        if step in steps:
            raise TraceFormatError(f"{path}: step {step} is recorded twice; {_FIX}")
        start, end = _interval(path, entry, where)
        events = _events(path, _field(path, entry, "events", list, where), step)
        names = [event.name for event in events if event.kind == "compute"]
        if names != expected:
            raise TraceFormatError(f"{path}: step {step}: {_mismatch(names, expected, document['rank'])}; "
                                   "the file does not match the schedule it carries")
        steps[step] = StepTrace(step=step, start_ns=start, end_ns=end, events=events)
    return steps


def _interval(path: Path, obj: dict, where: str) -> tuple[int, int]:
    start, end = _field(path, obj, "start_ns", int, where), _field(path, obj, "end_ns", int, where)
    if end < start:
        raise TraceFormatError(f"{path}: {where}end_ns {end} is before start_ns {start}")
    return start, end


def _events(path: Path, entries: list, step: int) -> tuple[TraceEvent, ...]:
    """The events of ``EVENT_KINDS`` in one step's list; other kinds are skipped unread."""
    events = []
    for j, event in enumerate(entries):
        where = f"step {step} event {j}: "
        if not isinstance(event, dict):
            raise TraceFormatError(f"{path}: {where}expected an object, got {shown(event)}")
        kind = _field(path, event, "kind", str, where)
        if kind in EVENT_KINDS:
            start, end = _interval(path, event, where)
            events.append(TraceEvent(name=_field(path, event, "name", str, where), kind=kind,
                                     start_ns=start, end_ns=end))
    return tuple(events)


def _mismatch(names: list[str], expected: list[str], rank: int) -> str:
    """Where the compute events first differ from rank ``rank``'s action list."""
    for i, (name, action) in enumerate(zip(names, expected)):
        if name != action:
            return f"compute event {i} is {name!r} but rank {rank}'s action {i} is {action!r}"
    return f"{len(names)} compute events but rank {rank} runs {len(expected)} actions"


def _common_steps(records: list[dict[int, StepTrace]], paths: list[Path]) -> tuple[tuple[int, ...], list[str]]:
    """Step numbers every rank recorded, and a note for those only some ranks did."""
    common = set(records[0]).intersection(*records[1:])
    every = set().union(*records)
    if not common:
        empty = [str(path) for path, record in zip(paths, records) if not record]
        why = f"{', '.join(empty)} record no steps" if empty else "no step is recorded by every rank"
        raise TraceFormatError(f"{why}; run at least one engine.step with trace= set")
    notes = []
    if every - common:
        left = sorted(every - common)
        notes.append(f"steps {', '.join(map(str, left[:8]))}{', ...' if len(left) > 8 else ''} are not "
                     "in every rank's file and were left out (a run stopped during a step?)")
    return tuple(sorted(common)), notes


def _check_overlap(steps: tuple[int, ...], ranks: tuple[tuple[StepTrace, ...], ...], paths: list[Path]) -> None:
    """Every rank is inside ``engine.step`` at one common moment of each step (the loss reaches all)."""
    for i, step in enumerate(steps):
        late = max(range(len(ranks)), key=lambda r: ranks[r][i].start_ns)
        early = min(range(len(ranks)), key=lambda r: ranks[r][i].end_ns)
        if ranks[late][i].start_ns > ranks[early][i].end_ns:
            raise TraceFormatError(
                f"step {step}: {paths[early]} ends it before {paths[late]} starts it: files of different "
                f"runs (or hosts whose clocks disagree); {_FIX}")
