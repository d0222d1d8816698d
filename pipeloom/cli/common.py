"""What the ``pipeloom`` commands share: the usage error, costs from the flags, one-line error text,
and writing the requested files then printing a report (tables or JSON)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Iterator, Mapping

from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import report_console, target
from pipeloom.errors import PipeloomError
from pipeloom.ir import save_schedule
from pipeloom.sim import Timeline
from pipeloom.stages import Costs
from pipeloom.viz.report import per_rank_table, summary_table, terminal_timeline

__all__ = ["COST_FLAGS", "OVERLAP_FLAGS", "check_flag_sums", "check_picture", "costs_from_args", "emit", "first_line",
           "limit_units"]

COST_FLAGS = ("f", "b", "w", "comm", "f_comm", "b_comm")
"""The cost flags (``--f`` ...) that set the matching ``Costs`` fields."""
OVERLAP_FLAGS = ("overlap", "pair_time")
"""The flags that price overlapped pairs (``Costs.overlap``, ``Costs.pair_time``)."""


def costs_from_args(args: argparse.Namespace) -> Costs:
    """Costs from the --f/--b/--w/--comm/--f-comm/--b-comm/--overlap/--pair-time flags; a flag left out
    keeps the Costs default."""
    given = {k: getattr(args, k, None) for k in COST_FLAGS + OVERLAP_FLAGS}
    try:
        return Costs(**{k: v for k, v in given.items() if v is not None})
    except PipeloomError as error:  # e.g. --f-comm larger than --f
        raise UsageError(f"{first_line(error)} (set by --{'/--'.join(k.replace('_', '-') for k in given)})") from None


def check_flag_sums(flags: Mapping[str, float | None], microbatches: int) -> None:
    """UsageError naming the largest flag when the flags' values (``{"--f": 1e308, ...}``; None: not
    given) added up over ``microbatches`` micro-batches, four times over (a rank runs a forward, a
    backward and the latency between them per micro-batch and stage: the bound ``build_schedule``
    checks), leave the float range: ``--f 1e308`` names ``--f``, not an ``inf`` further down."""
    given = {flag: value for flag, value in flags.items() if value is not None}
    if not given or math.isfinite(sum(given.values()) * 4.0 * max(microbatches, 1)):
        return
    flag = max(given, key=given.__getitem__)
    others = [other for other in given if other != flag and given[other] >= given[flag] / 10]
    also = f" (with {', '.join(others)})" if others else ""
    raise UsageError(f"{flag} {given[flag]:g}{also} overflows the float range when the times add up over "
                     f"{microbatches:,} micro-batch{'' if microbatches == 1 else 'es'}; "
                     "scale it down (e.g. seconds to milliseconds)")


@contextlib.contextmanager
def limit_units(args: argparse.Namespace, units: str) -> Iterator[None]:
    """Name the unit of ``--memory-limit`` in an error about the limit that flag set (its values are
    ``units``, e.g. micro-batches, where ``pipeloom plan``'s are bytes)."""
    try:
        yield
    except PipeloomError as error:
        line = first_line(error)
        if isinstance(error, UsageError) or getattr(args, "memory_limit", None) is None \
                or "limit" not in line or "memory" not in line:
            raise
        lines = str(error).strip().splitlines()
        lines[0] = f"{lines[0]} [--memory-limit counts {units}, not bytes]"
        try:
            marked = type(error)("\n".join(lines))
        except TypeError:  # a subclass with another signature keeps its own text
            raise error from None
        raise marked from None


def check_picture(args: argparse.Namespace, ranks: int) -> None:
    """UsageError, before anything is built, when ``-o`` asks for a .png/.svg picture of more rank rows
    than :data:`pipeloom.viz.figure.MAX_PICTURE_RANKS`."""
    from pipeloom.viz.figure import MAX_PICTURE_RANKS

    out = getattr(args, "out", None)
    if out is not None and out.suffix.lower() in (".png", ".svg") and ranks > MAX_PICTURE_RANKS:
        raise UsageError(f"-o {out}: a picture of {ranks:,} rank rows is above the limit of {MAX_PICTURE_RANKS:,} "
                         "(it could not be read); use fewer ranks, or -o a .html view")


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
    if args.out or args.perfetto:
        from pipeloom import viz

        if args.out:
            title = f"{report['name']}: p={report['num_ranks']}, m={report['num_microbatches']}"
            if args.out.suffix.lower() == ".html":
                from pipeloom.viz.html import write_html

                write_html(timeline, target(args, args.out), title=title)
                written.append(f"wrote interactive timeline {args.out} (open it in a browser)")
            else:
                viz.draw_timeline(timeline, target(args, args.out), title=title)
                written.append(f"wrote timeline picture {args.out}")
        if args.perfetto:
            viz.write_perfetto(timeline, target(args, args.perfetto))
            written.append(f"wrote Perfetto timeline {args.perfetto} (open it in https://ui.perfetto.dev)")
    return written


def emit(args: argparse.Namespace, timeline: Timeline, report: dict, table=summary_table) -> int:
    """Write the requested files, then print the report (tables or JSON) and the terminal view."""
    written = _write_files(args, timeline, report)
    console = report_console(stderr=args.json)
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
