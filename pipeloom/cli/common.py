"""What the ``pipeloom`` commands share: the usage error, costs from the flags, one-line error text,
and writing the requested files then printing a report (tables or JSON)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from pipeloom.cli.outputs import target
from pipeloom.cli.usage import UsageError
from pipeloom.ir import save_schedule
from pipeloom.problem import Costs
from pipeloom.sim import Timeline
from pipeloom.viz.report import per_rank_table, summary_table, terminal_timeline

__all__ = ["UsageError", "COST_FLAGS", "costs_from_args", "first_line", "emit"]

COST_FLAGS = ("f", "b", "w", "comm")
"""The cost flags (``--f`` ...) that set the matching ``Costs`` fields."""


def costs_from_args(args: argparse.Namespace) -> Costs:
    """Costs from the --f/--b/--w/--comm flags; a flag left out keeps the Costs default."""
    return Costs(**{k: getattr(args, k) for k in COST_FLAGS if getattr(args, k) is not None})


def first_line(error: BaseException) -> str:
    """The first line of an error's message (``file: reason`` for an OSError on a file)."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _write_files(args: argparse.Namespace, timeline: Timeline, report: dict) -> list[str]:
    """Write the requested files before anything is printed, so a refused or failed write leaves
    stdout empty; returns one message per file written (into the staged outputs, see cli/outputs.py)."""
    written = []
    if getattr(args, "save", None):
        save_schedule(timeline.schedule, target(args, args.save))
        written.append(f"wrote schedule {args.save}")
    if args.out or args.trace:
        from pipeloom import viz

        if args.out:
            title = f"{report['name']}: p={report['num_ranks']}, m={report['num_microbatches']}"
            viz.draw_timeline(timeline, target(args, args.out), title=title)
            written.append(f"wrote timeline picture {args.out}")
        if args.trace:
            viz.write_trace(timeline, target(args, args.trace))
            written.append(f"wrote trace {args.trace} (open it in https://ui.perfetto.dev)")
    return written


def emit(args: argparse.Namespace, timeline: Timeline, report: dict, table=summary_table) -> int:
    """Write the requested files, then print the report (tables or JSON) and the terminal view."""
    written = _write_files(args, timeline, report)
    console = Console(stderr=args.json, highlight=False)
    if args.json:
        print(json.dumps(report))
    else:
        console.print(table(report))
        console.print(per_rank_table(report))
    if args.terminal:
        view = terminal_timeline(timeline, console_width=console.width, width=args.width)
        console.print(view, soft_wrap=True)
    for message in written:
        console.print(message, markup=False, soft_wrap=True)
    return 0
