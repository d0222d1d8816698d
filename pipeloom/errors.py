"""Exceptions raised by pipeloom; every one names the bad value and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "CommError",
    "DeadlockError",
    "LoweringError",
    "MemoryLimitError",
    "OrderError",
    "PipeloomError",
    "ProblemError",
    "ScheduleError",
    "ScheduleFormatError",
    "require_type",
    "shown",
    "shown_list",
]


class PipeloomError(ValueError):
    """Base class of every error pipeloom raises for bad input: one ``except PipeloomError`` catches
    them all (it is a ValueError, and the type errors below are also TypeErrors)."""


class ArgumentError(PipeloomError):
    """A bad argument of a public function (a count, a size, an option out of range)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (a string where Costs are expected, ...)."""


class ProblemError(PipeloomError):
    """The task graph or stage graph is malformed (unknown rank, cycle, negative duration...)."""


class ScheduleFormatError(PipeloomError):
    """A schedule file or action string cannot be read (malformed JSON/CSV, wrong format tag...)."""


class ScheduleError(PipeloomError):
    """A schedule is not valid for its task graph (missing, duplicate or foreign actions)."""


class DeadlockError(ScheduleError):
    """The per-rank action lists cannot run to the end: every remaining head waits forever."""


class MemoryLimitError(ScheduleError):
    """A rank's peak memory exceeds the schedule's memory limit."""


class OrderError(ScheduleError):
    """Gradient-producing actions (B or W) of a stage do not run in micro-batch order."""


class CommError(ScheduleError):
    """The communication actions of a lowered schedule do not match: a send nobody receives, a
    receive nobody sends, messages between two ranks received out of their send order, data sent
    before it is made or used before it is received."""


class LoweringError(ScheduleError):
    """A schedule's problem cannot carry communication actions (a task on several ranks, a stage
    split over ranks, a cross-rank dependency that is neither forward values nor gradients), or its
    receives admit no order that keeps each pair of ranks first-in first-out."""


def require_type(name: str, value: object, expected: type | tuple[type, ...], fix: str) -> None:
    """:class:`ArgumentTypeError` naming ``name``, what it got and ``fix`` unless ``value`` is an
    ``expected``; public entry points call it on their first argument before using it."""
    if not isinstance(value, expected):
        raise ArgumentTypeError(f"{name} must be {fix}, got {type(value).__name__} {value!r:.60}")


def shown(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shown_list(items: Sequence[Any], most: int = 6, *, total: int | None = None) -> str:
    """``[a, b, c, ...]`` with at most ``most`` items and how many were left out: a list in an error
    message stays one short line however long the list is. ``total``: the whole list's length where ``items`` holds
    only its first ones (a list too long to make)."""
    head = ", ".join(map(str, items[:most]))
    more = (len(items) if total is None else total) - most
    return f"[{head}, ... ({more:,} more)]" if more > 0 else f"[{head}]"
