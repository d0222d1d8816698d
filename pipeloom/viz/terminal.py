"""Terminal view of a timeline: one text line per rank, time scaled to a number of columns.

Column c covers times ``[c, c+1) * makespan / width``. An action fills the columns from
``round(start * width / makespan)`` to ``round(end * width / makespan)``: its kind letter, then
its micro-batch number if it has room, then the kind letter again (``F12FFF``); an action too
short for a column of its own takes the column it starts in if that one is free. Idle is ``.``:
a column the simulator has the rank idle over throughout is always ``.``, and a column shows an
action when that action covers more than half of it. A lowered schedule's communication actions
are not drawn (their time shows as ``.``); the pictures show them. An overlapped pair is one action
of kind ``O`` with its forward's micro-batch (``O7OO``).
"""

from __future__ import annotations

from itertools import groupby
from typing import TYPE_CHECKING

from pipeloom.ir import Comm, compute_parts
from pipeloom.sim import Timeline
from pipeloom.viz.style import KIND_COLORS, KIND_NAMES, action_kind, kinds_present, summary, text_color

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["IDLE", "timeline_cells", "render_timeline", "render_timeline_rich"]

IDLE = "."
"""The character of an idle column."""

Cell = tuple[str, "str | None"]
"""One column: its character and the kind of the action drawn there (None when idle)."""


def _check_width(width: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive number of columns, got {width!r}")


def _fill(row: list[Cell], kind: str, microbatch: int, first: int, last: int) -> None:
    """Write one action into columns ``first..last-1`` (``last == first``: column first if free)."""
    if last <= first:
        if row[first][1] is None:
            row[first] = (kind, kind)
        return
    text = f"{kind}{microbatch}"
    if len(text) > last - first:
        text = kind
    text = text.ljust(last - first, kind)
    for offset, char in enumerate(text):
        row[first + offset] = (char, kind)


def timeline_cells(timeline: Timeline, *, width: int = 100) -> list[list[Cell]]:
    """Per rank, ``width`` cells ``(char, kind or None)``: the grid both renderers print."""
    _check_width(width)
    grid: list[list[Cell]] = [[(IDLE, None)] * width for _ in range(timeline.num_ranks)]
    if timeline.makespan <= 0:
        return grid
    per_time = width / timeline.makespan
    for rank, row in enumerate(grid):
        for action, start, end in timeline.events(rank):
            if type(action) is Comm:
                continue
            first, last = round(start * per_time), min(round(end * per_time), width)
            if last <= first:
                first = last = min(int(start * per_time), width - 1)
            _fill(row, action_kind(action), compute_parts(action)[0].microbatch, first, last)
    return grid


def _header(timeline: Timeline, width: int) -> list[str]:
    """The summary line and the scale/legend line."""
    column = timeline.makespan / width
    legend = ", ".join(f"{kind} {KIND_NAMES[kind]}" for kind in kinds_present(timeline))
    return [summary(timeline), f"1 column = {column:.3g} time units; {legend}; {IDLE} idle"]


def _labels(timeline: Timeline) -> list[str]:
    digits = len(str(max(timeline.num_ranks - 1, 0)))
    return [f"rank {rank:>{digits}} |" for rank in range(timeline.num_ranks)]


def render_timeline(timeline: Timeline, *, width: int = 100) -> str:
    """Plain-text view: two header lines (makespan, bubble ratio, peak memory; scale and legend),
    then one line per rank, ``rank r |`` followed by ``width`` columns.
    """
    grid = timeline_cells(timeline, width=width)
    lines = _header(timeline, width)
    for label, row in zip(_labels(timeline), grid):
        lines.append(label + "".join(char for char, _ in row) + "|")
    return "\n".join(lines)


def render_timeline_rich(timeline: Timeline, *, width: int = 100) -> Text:
    """The same view as :func:`render_timeline` as a ``rich.text.Text``, boxes coloured like the pictures."""
    from rich.text import Text

    grid = timeline_cells(timeline, width=width)
    text = Text()
    for line in _header(timeline, width):
        text.append(line + "\n", style="bold" if not text else "dim")
    for label, row in zip(_labels(timeline), grid):
        text.append(label)
        for kind, run in groupby(row, key=lambda cell: cell[1]):
            chars = "".join(char for char, _ in run)
            if kind is None:
                text.append(chars, style="dim")
            else:
                color = KIND_COLORS[kind]
                text.append(chars, style=f"{text_color(color)} on {color}")
        text.append("|\n")
    text.rstrip()
    return text
