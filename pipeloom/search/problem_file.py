"""A user's problem file for the search: ``num_ranks`` and ``tasks`` as in the schedule JSON, plus the
machine facts (``comm_latency``, ``memory_limit``, ``static_memory``); a whole schedule file also works."""

from __future__ import annotations

from pathlib import Path

from pipeloom.errors import ScheduleFormatError, shown
from pipeloom.ir.json_io import problem_from_document, schedule_from_document
from pipeloom.ir.jsonfields import check_keys, parse_object, read_text
from pipeloom.problem import Problem

__all__ = ["load_problem", "problem_from_json"]

_PROBLEM_KEYS = {"num_ranks", "tasks", "comm_latency", "memory_limit", "static_memory"}


def problem_from_json(text: str) -> Problem:
    """A problem from JSON: ``num_ranks`` and ``tasks`` (as in the schedule format), optional
    ``comm_latency``, ``memory_limit`` and ``static_memory``; a whole schedule file also works
    (its problem is taken, its rank lists ignored)."""
    document = parse_object(text, error=ScheduleFormatError, what="problem file",
                            hint=" with num_ranks and tasks")
    if "format" in document:
        return schedule_from_document(document).problem
    check_keys(document, _PROBLEM_KEYS, where="problem", error=ScheduleFormatError)
    for key in ("num_ranks", "tasks"):
        if key not in document:
            raise ScheduleFormatError(f"problem: missing key {key!r}")
    ranks = document["num_ranks"]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1_000_000:
        raise ScheduleFormatError(f"problem.num_ranks: expected a positive integer, got {shown(ranks)}")
    return problem_from_document(document, where="problem")


def load_problem(path: str | Path) -> Problem:
    """:func:`problem_from_json` of a UTF-8 file; errors name the file."""
    path = Path(path)
    text = read_text(path)
    try:
        return problem_from_json(text)
    except ScheduleFormatError as error:
        raise ScheduleFormatError(f"{path}: {error}") from None
