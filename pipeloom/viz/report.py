"""Reports of simulated schedules: the metrics as a JSON-ready dict, and the terminal tables
(summary, per rank, comparison) and Markdown table the command line prints.

rich loads inside the functions that build tables, so importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pipeloom.formatting import format_number
from pipeloom.ir import has_pairs, priced_overlap, without_overlap
from pipeloom.sim import Timeline, simulate
from pipeloom.stages import Costs

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from pipeloom.schedules import ScheduleInfo

__all__ = [
    "COMPARE_COLUMNS",
    "PER_RANK_ROWS",
    "compare_cells",
    "compare_markdown",
    "compare_table",
    "comparison_rows",
    "costs_report",
    "per_rank_table",
    "placements_table",
    "print_comparison",
    "schedules_table",
    "search_table",
    "summary_table",
    "terminal_timeline",
    "timeline_report",
]

COMPARE_COLUMNS = ("schedule", "makespan", "vs best", "bubble", "peak memory", "note")
"""Columns of the comparison table; ``note`` appears only when some schedule was not built."""


def timeline_report(timeline: Timeline, *, microbatches: int | None = None,
                    costs: Costs | None = None) -> dict:
    """The metrics of ``timeline`` as a JSON-ready dict (the CLI's ``--json`` object).

    ``microbatches`` is the user's count of real micro-batches where it differs from the schedule's
    (two-replica schedules pair them); ``costs`` the per-rank costs the schedule was built from.
    ``lower_bound`` is the busiest rank's total work, a floor for the makespan.
    """
    schedule = timeline.schedule
    return {
        "name": schedule.name,
        "num_ranks": schedule.num_ranks,
        "num_microbatches": schedule.num_microbatches if microbatches is None else microbatches,
        "schedule_microbatches": schedule.num_microbatches,
        "makespan": timeline.makespan,
        "bubble_ratio": timeline.bubble_ratio,
        "peak_memory": list(timeline.peak_memory),
        "busy": list(timeline.busy),
        "lower_bound": max(timeline.busy, default=0.0),
        "num_actions": schedule.num_actions,
        "memory_limit": schedule.problem.memory_limit,
        "costs": None if costs is None else costs_report(costs),
    }


def summary_table(report: dict) -> Table:
    """Two-column table of a ``timeline_report``: shape, makespan, bubble, bound, memory."""
    from rich.table import Table

    makespan, bound = report["makespan"], report["lower_bound"]
    micro = str(report["num_microbatches"])
    if report["schedule_microbatches"] != report["num_microbatches"]:
        micro += f" ({report['schedule_microbatches']} pairs)"
    table = Table(title=f"schedule {report['name']}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, value in (
        ("ranks", str(report["num_ranks"])),
        ("micro-batches", micro),
        ("makespan", format_number(makespan)),
        ("bubble ratio", f"{report['bubble_ratio']:.2%}"),
        ("work lower bound (busiest rank)", format_number(bound)),
        ("makespan / lower bound", f"{makespan / bound:.3f}" if bound > 0 else "-"),
        ("peak memory (max over ranks)", format_number(max(report["peak_memory"]))),
        ("actions", str(report["num_actions"])),
    ):
        table.add_row(label, value)
    return table


PER_RANK_ROWS = 64
"""Rows of the per-rank table shown at most: the first and last halves, the ranks between counted in one row (a
65,536-rank problem's table had taken half a minute to print and could not be read; ``--json`` has every rank)."""


def per_rank_table(report: dict) -> Table:
    """A ``timeline_report``'s ranks: busy, idle (makespan - busy), peak memory, a row each; of more than
    :data:`PER_RANK_ROWS` ranks, consecutive ranks alike in one row (``2-65535``), and past that many rows the middle
    ones counted."""
    from rich.table import Table

    table = Table(title="per rank")
    for column in ("rank", "busy", "idle", "peak memory"):
        table.add_column(column, justify="right")
    rows: list[list[Any]] = []  # [first rank, last rank, cells]
    fold = len(report["busy"]) > PER_RANK_ROWS
    for rank, (busy, peak) in enumerate(zip(report["busy"], report["peak_memory"])):
        cells = (format_number(busy), format_number(max(0.0, report["makespan"] - busy)), format_number(peak))
        if fold and rows and rows[-1][2] == cells:
            rows[-1][1] = rank
        else:
            rows.append([rank, rank, cells])
    half = PER_RANK_ROWS // 2
    shown = rows if len(rows) <= PER_RANK_ROWS + 1 else [*rows[:half], None, *rows[-half:]]  # never one row for one
    for row in shown:
        if row is None:
            hidden = rows[half:-half]
            table.add_row(f"{hidden[0][0]}-{hidden[-1][1]}", "...", "...", f"({len(hidden):,} rows left out)")
            continue
        first, last, cells = row
        table.add_row(str(first) if first == last else f"{first}-{last}", *cells)
    return table


_PAIR_PRICING = {"f_comm": 0.0, "b_comm": 0.0, "overlap": 0.0, "pair_time": None}
"""The Costs fields that price overlapped pairs, with their defaults."""


def costs_report(costs: Costs) -> dict[str, Any]:
    """``costs`` as a JSON-ready dict; the fields pricing overlapped pairs only where they differ from
    their defaults (so reports of schedules without them read as before)."""
    return {key: value for key, value in dataclasses.asdict(costs).items()
            if key not in _PAIR_PRICING or value != _PAIR_PRICING[key]}


def comparison_rows(outcomes: Sequence[tuple[str, Timeline | str]], *, microbatches: int | None = None,
                    costs: Costs | None = None) -> list[dict]:
    """One row per ``(name, timeline or error message)``: a ``timeline_report`` under ``name`` plus
    ``relative_makespan`` (makespan / the best makespan), or ``{"name", "error"}``."""
    rows: list[dict[str, Any]] = [{"name": name, "error": outcome} if isinstance(outcome, str) else
            {**timeline_report(outcome, microbatches=microbatches, costs=costs), "name": name}
            for name, outcome in outcomes]
    built = [row for row in rows if "error" not in row]
    best = min((row["makespan"] for row in built), default=0.0)
    for row in built:
        row["relative_makespan"] = row["makespan"] / best if best > 0 else 1.0
    timelines = [outcome for _, outcome in outcomes if not isinstance(outcome, str)]
    for row, timeline in zip(built, timelines, strict=True):
        _mark_overlap(row, timeline, built)
    return rows


def _mark_overlap(row: dict, timeline: Timeline, rows: Sequence[dict]) -> None:
    """Add ``makespan_without_overlap`` (its pairs priced F + B) and a ``note`` to the row of a schedule
    whose overlapped pairs are priced below F + B (an overlap fraction, a measured pair time or the
    communication they hide), naming the schedules it leads only through that overlap."""
    schedule = timeline.schedule
    if not (has_pairs(schedule) and priced_overlap(schedule.problem)):
        return
    plain = simulate(dataclasses.replace(schedule, problem=without_overlap(schedule.problem))).makespan
    row["makespan_without_overlap"] = plain
    behind = [other["name"] for other in rows if row["makespan"] < other["makespan"] <= plain]
    lead = f"; ahead of {', '.join(behind)} only through it" if behind else ""
    row["note"] = f"priced with overlap: {format_number(plain)} with pairs priced F + B{lead}"


def compare_cells(row: dict, *, reason: bool = True) -> list[str]:
    """The ``COMPARE_COLUMNS`` cells of a comparison row: a report with ``relative_makespan``,
    or ``{"name", "error"}`` for a schedule that was not built (the error in the note if ``reason``)."""
    if "error" in row:
        return [row["name"], "-", "-", "-", "-", f"not built: {row['error']}" if reason else "not built"]
    return [row["name"], format_number(row["makespan"]), f"{row['relative_makespan']:.3f}",
            f"{row['bubble_ratio']:.2%}", format_number(max(row["peak_memory"])), row.get("note", "")]


def compare_table(rows: Sequence[dict], title: str) -> Table:
    """The comparison table; the ``note`` column only when a row was not built (reason left out,
    so the table stays narrow: print the reasons under it)."""
    from rich.table import Table

    table = Table(title=title)
    failed = any("error" in row for row in rows)
    columns = COMPARE_COLUMNS if failed else COMPARE_COLUMNS[:-1]
    for column in columns:
        table.add_column(column, justify="left" if column in ("schedule", "note") else "right")
    for row in rows:
        table.add_row(*compare_cells(row, reason=False)[: len(columns)])
    return table


def print_comparison(console: Console, rows: Sequence[dict], title: str) -> None:
    """Print ``compare_table`` and, under it, why each schedule that was not built failed and the
    note of each whose makespan depends on overlapped pairs."""
    console.print(compare_table(rows, title))
    for row in rows:
        if "error" in row:
            console.print(f"{row['name']} not built: {row['error']}", markup=False, soft_wrap=True)
        elif row.get("note"):
            console.print(f"{row['name']}: {row['note']}", markup=False, soft_wrap=True)


def compare_markdown(rows: Sequence[dict], *, heading: str, title: str, footer: Sequence[str] = ()) -> str:
    """A Markdown page: ``# heading``, ``title``, the comparison table (reasons of rows not built
    in the note column; ``|`` in a cell escaped), then the ``footer`` lines."""
    cells = [COMPARE_COLUMNS, ["---"] * len(COMPARE_COLUMNS), *map(compare_cells, rows)]
    table = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in cells]
    return "\n".join([f"# {heading}", "", title, "", *table, "", *footer, ""])


def schedules_table(infos: Iterable[ScheduleInfo]) -> Table:
    """The ``pipeloom list`` table: name, placement, backward kinds, options (as flags), summary."""
    from rich.table import Table

    table = Table(title="Schedules (pipeloom show NAME --ranks P --microbatches M)")
    table.add_column("name", no_wrap=True)  # names are what users type: never cut
    for column in ("placement", "backward", "options", "summary"):
        table.add_column(column)
    for info in infos:
        flags = ", ".join(f"--{option.replace('_', '-')}" for option in info.options)
        table.add_row(info.name, info.placement, "I + W" if info.splits_backward else "B", flags, info.summary)
    return table


def terminal_timeline(timeline: Timeline, *, console_width: int, width: int | None = None) -> Text:
    """The terminal timeline view, ``width`` time columns (default: fill ``console_width``)."""
    from pipeloom.viz.terminal import render_timeline_rich

    margin = len(f"rank {timeline.num_ranks - 1} |") + 1  # the view's "rank N |" ... "|" frame
    return render_timeline_rich(timeline, width=width or max(20, console_width - margin))


# ------------------------------------------------------------------------------------ search


def search_table(report: dict) -> Table:
    """Two-column table of a ``pipeloom search`` report: shape, limit, makespan against the
    proven lower bound, the gap and status, the period (periodic mode) and the time spent."""
    from rich.table import Table

    limit = report.get("memory_limit")
    rows = [
        ("mode, status", f"{report['mode']}, {report['status']}"),
        ("ranks", str(report["num_ranks"])),
        ("micro-batches", str(report["num_microbatches"])),
        ("memory limit", "none" if limit is None else format_number(limit)),
        ("makespan", format_number(report["makespan"])),
        ("lower bound (proven)", format_number(report["lower_bound"])),
        ("gap", f"{report['gap']:.2%}"),
        ("bubble ratio", f"{report['bubble_ratio']:.2%}"),
    ]
    if report.get("period") is not None:
        rows.append(("period (lower bound)",
                     f"{format_number(report['period'])} ({format_number(report['period_lower_bound'])})"))
    rows += [("peak memory (max over ranks)", format_number(max(report["peak_memory"]))),
             ("search seconds", f"{report['search_seconds']:.2f}")]
    table = Table(title=f"search result {report['name']}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, value in rows:
        table.add_row(label, value)
    return table


def placements_table(infos: Iterable) -> Table:
    """The ``pipeloom list`` placements table: name, valid rank counts, summary (PlacementInfo)."""
    from rich.table import Table

    table = Table(title="Placements (pipeloom search --placement NAME --ranks D --microbatches M)")
    for column in ("name", "ranks", "summary"):
        table.add_column(column)
    for info in infos:
        table.add_row(info.name, info.rule, info.summary)
    return table
