"""A user's problem file for the search: ``num_ranks`` and ``tasks`` as in the schedule JSON, plus the
machine facts (``comm_latency``, ``memory_limit``, ``static_memory``); a whole schedule file also works."""

from __future__ import annotations

from pathlib import Path

from pipeloom.errors import PipeloomError, ScheduleFormatError, shown
from pipeloom.ir.json_io import problem_from_document, schedule_from_document
from pipeloom.ir.jsonfields import check_keys, parse_object, read_text
from pipeloom.problem import Problem

__all__ = ["MAX_SEARCH_TASKS", "check_task_count", "load_problem", "problem_from_json"]

MAX_SEARCH_TASKS = 20_000
"""Tasks per micro-batch a search takes at most: its lower bounds hold an ancestor set per task (memory
and time grow with the square of the tasks: a 200,000-task chain would need about 5 GB and minutes)."""

_PROBLEM_KEYS = {"num_ranks", "tasks", "comm_latency", "memory_limit", "static_memory"}


def problem_from_json(text: str) -> Problem:
    """A problem from JSON: ``num_ranks`` and ``tasks`` (as in the schedule format), optional
    ``comm_latency``, ``memory_limit`` and ``static_memory``; a whole schedule file also works
    (its problem is taken, its rank lists ignored)."""
    document = parse_object(text, error=ScheduleFormatError, what="problem file",
                            hint=" with num_ranks and tasks")
    if isinstance(document.get("tasks"), list):  # before building a task of it
        check_task_count(len(document["tasks"]), error=ScheduleFormatError)
    if "format" in document:
        return schedule_from_document(document).problem
    check_keys(document, _PROBLEM_KEYS, where="problem", error=ScheduleFormatError)
    for key in ("num_ranks", "tasks"):
        if key not in document:
            raise ScheduleFormatError(f"problem: missing key {key!r}")
    ranks = document["num_ranks"]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ScheduleFormatError(f"problem.num_ranks: expected a positive integer, got {shown(ranks)}")
    if ranks > 1_000_000:  # before any table per rank is built (the search's own limit is lower: said by its caller)
        raise ScheduleFormatError(f"problem.num_ranks: {ranks:,} ranks is above the limit of 1,000,000 a problem "
                                  "file may declare; use fewer ranks")
    return problem_from_document(document, where="problem")


def check_task_count(count: int, *, error: type[PipeloomError] = PipeloomError) -> None:
    """``error`` when a problem of ``count`` tasks is above :data:`MAX_SEARCH_TASKS`."""
    if count > MAX_SEARCH_TASKS:
        raise error(f"the problem has {count:,} tasks per micro-batch, above the search's limit of "
                    f"{MAX_SEARCH_TASKS:,} (its bounds grow with the square of the tasks); use fewer ranks, "
                    "or merge tasks into fewer, larger stages")


def load_problem(path: str | Path) -> Problem:
    """:func:`problem_from_json` of a UTF-8 file; errors name the file."""
    path = Path(path)
    text = read_text(path)
    try:
        return problem_from_json(text)
    except ScheduleFormatError as error:
        csv = ("; a problem file is JSON (num_ranks and tasks, or a pipeloom schedule), a torch CSV is not one"
               if path.suffix.lower() == ".csv" and "malformed JSON" in str(error) else "")
        raise ScheduleFormatError(f"{path}: {error}{csv}") from None
