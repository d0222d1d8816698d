"""Saving and loading schedule files, pipeloom JSON or torch CSV chosen by the file suffix."""

from __future__ import annotations

from pathlib import Path

from pipeloom.errors import ScheduleFormatError, require_type
from pipeloom.ir.core import Schedule
from pipeloom.ir.json_io import schedule_from_json, schedule_to_json
from pipeloom.ir.jsonfields import check_path, read_text
from pipeloom.ir.torch_csv import schedule_from_csv, schedule_to_csv
from pipeloom.stages import Costs

__all__ = ["save_schedule", "load_schedule"]


def save_schedule(schedule: Schedule, path: str | Path) -> None:
    """Write ``schedule`` as pipeloom JSON (``.json``) or torch CSV (``.csv``: ``compute_only``, or
    ``compute_comms`` for a lowered schedule, which JSON does not hold).

    The suffix is matched case-insensitively; nothing is written when the format cannot carry it. A file that cannot
    be written is a ScheduleFormatError naming it, as :func:`load_schedule`'s unreadable one is.
    """
    require_type("schedule", schedule, Schedule, "a pipeloom Schedule (e.g. build_schedule('1f1b', 4, 8) or "
                 "load_schedule(path))")
    path = check_path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        text = schedule_to_csv(schedule)
    elif suffix == ".json":
        text = schedule_to_json(schedule, indent=1) + "\n"
    else:
        raise ScheduleFormatError(f"cannot save {path}: use a .json or .csv suffix")
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise ScheduleFormatError(f"cannot write {path}: {error.strerror or error}") from None


def load_schedule(path: str | Path, *, costs: Costs = Costs()) -> Schedule:
    """Read a schedule saved as pipeloom JSON or torch CSV (chosen by suffix, any case).

    The file must be UTF-8 text (a leading byte-order mark is allowed); a ScheduleFormatError names
    the file (or says ``path`` is no path).
    """
    path = check_path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise ScheduleFormatError(f"cannot read {path}: use a .json (pipeloom) or .csv (torch) file")
    text = read_text(path)
    try:
        if suffix == ".csv":
            return schedule_from_csv(text, name=path.stem, costs=costs)
        return schedule_from_json(text)
    except ScheduleFormatError as error:
        raise ScheduleFormatError(f"{path}: {error}") from None
