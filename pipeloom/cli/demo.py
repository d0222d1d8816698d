"""``pipeloom demo``: compare the main schedules on the zero-bubble paper's costs and write a
comparison figure, the best schedule's timeline and trace, and a Markdown summary."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import report_console
from pipeloom.cli.schedules import compare_schedules
from pipeloom.schedules import REGISTRY
from pipeloom.stages import Costs
from pipeloom.viz.report import compare_markdown, print_comparison

__all__ = ["DEMO_COSTS", "DEMO_RANKS", "DEMO_MICROBATCHES", "DEMO_SCHEDULES", "cmd_demo"]

DEMO_COSTS = Costs(f=18522, b=18086, w=9337, comm=601)
"""Per-rank F, I, W and communication costs from the zero-bubble paper, used by ``pipeloom demo``."""
DEMO_RANKS, DEMO_MICROBATCHES = 8, 24
DEMO_SCHEDULES = tuple(name for name, info in REGISTRY.items() if info.in_demo)  # the registry says which
"""Schedules the demo compares; one that cannot be built gets a note instead of a row."""


def cmd_demo(args: argparse.Namespace) -> int:
    """``pipeloom demo``: build, compare, draw and summarise ``DEMO_SCHEDULES`` into ``args.out``."""
    from pipeloom import viz

    out: Path = args.out
    try:  # before anything is built
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--out {str(out)!r}: cannot create the folder ({error.strerror})") from None
    rows, timelines = compare_schedules(DEMO_SCHEDULES, DEMO_RANKS, DEMO_MICROBATCHES, DEMO_COSTS, None)
    c = DEMO_COSTS
    title = (f"p={DEMO_RANKS}, m={DEMO_MICROBATCHES}, zero-bubble paper costs "
             f"(f={c.f:g}, b={c.b:g}, w={c.w:g}, comm={c.comm:g})")
    built = [row["name"] for row in rows if "error" not in row]  # aligned with timelines
    best = min(range(len(built)), key=lambda i: timelines[i].makespan)
    name = built[best]
    files = [(out / "compare.png", "comparison figure"),
             (out / f"timeline-{name}.png", f"timeline of the best schedule, {name}"),
             (out / f"trace-{name}.json", "its trace; open it in https://ui.perfetto.dev"),
             (out / "summary.md", "the table and the command that made it"),
             (out / "timelines.html", "every timeline, interactive (zoom, hover, memory); opens with no network")]
    viz.draw_comparison(timelines, files[0][0], title=title)
    viz.draw_timeline(timelines[best], files[1][0], title=f"{name}: {title}")
    viz.write_perfetto(timelines[best], files[2][0])
    files[3][0].write_text(_summary_markdown(rows, title, out))
    from pipeloom.viz.html import write_html

    write_html(timelines, files[4][0], title=title)
    console = report_console()
    print_comparison(console, rows, title)
    console.print("Files:", markup=False, soft_wrap=True)
    for path, what in files:
        console.print(f"  {path}  ({what})", markup=False, soft_wrap=True)
    return 0


def _summary_markdown(rows: list[dict], title: str, out: Path) -> str:
    """The demo's table as Markdown, with the commands that reproduce it."""
    c, names = DEMO_COSTS, " ".join(row["name"] for row in rows)
    command = (f"pipeloom compare {names} --ranks {DEMO_RANKS} --microbatches {DEMO_MICROBATCHES} "
               f"--f {c.f:g} --b {c.b:g} --w {c.w:g} --comm {c.comm:g}")
    footer = [f"Made by `pipeloom demo --out {out}`, or:", "", "```", command, "```"]
    return compare_markdown(rows, heading="pipeloom demo", title=title, footer=footer)
