"""``pipeloom trace``: a run's measured step (the engine's per-rank trace files) next to the step the
simulator predicts from the measured task times: summary tables, a merged Perfetto trace, a picture."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import report_console, target
from pipeloom.trace import StepSelectionError, compare_run, load_run_trace, trace_summary
from pipeloom.viz.measured import draw_measured, write_merged_trace

__all__ = ["cmd_trace", "trace_tables"]


def _ms(seconds: float, unit: str = " ms") -> str:
    """Seconds as milliseconds with three decimals, e.g. ``12.345 ms``."""
    return f"{seconds * 1e3:,.3f}{unit}"


def _steps_text(summary: dict) -> str:
    used, recorded = summary["steps_used"], summary["steps_recorded"]
    text = f"{len(used)} of {len(recorded)}"
    left = [step for step in recorded if step not in used]
    if left and len(left) <= 3:
        text += f" (left out: step{'s' if len(left) > 1 else ''} {', '.join(map(str, left))})"
    return text


def _summary_table(summary: dict) -> Table:
    """Measured and predicted step time, their ratio, and how they were measured."""
    ratio = summary["ratio"]
    table = Table(title=f"trace of {summary['schedule']} (p={summary['num_ranks']}, "
                        f"m={summary['num_microbatches']})", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, value in (
        ("steps measured", _steps_text(summary)),
        ("measured step time (median)", _ms(summary["measured_step_time"])),
        ("predicted step time", _ms(summary["predicted_step_time"])),
        ("measured / predicted", "-" if ratio is None else f"{ratio:.3f}"),
        ("comm latency (estimated)", _ms(summary["comm_latency"])),
        ("engine.step wall time (median)", _ms(summary["wall_step_time"])),
        ("step shown in the trace and picture", str(summary["step_shown"])),
    ):
        table.add_row(label, value)
    return table


def _rank_table(summary: dict) -> Table:
    """Per rank and step: measured compute (busy), idle (step time - busy) and the receive-wait and
    send time within it; predicted busy and idle."""
    table = Table(title="per rank and step, ms (measured: mean over the steps)")
    for column in ("rank", "busy", "idle", "recv wait", "send", "pred. busy", "pred. idle"):
        table.add_column(column, justify="right")
    for row in summary["ranks"]:
        keys = ("busy", "idle", "wait", "send", "predicted_busy", "predicted_idle")
        table.add_row(str(row["rank"]), *(_ms(row[key], "") for key in keys))
    return table


def _task_table(summary: dict) -> Table:
    """Median time of each task: one row per stage, one column per kind present."""
    kinds = [kind for kind in "FBIW" if any(task["kind"] == kind for task in summary["tasks"])]
    medians = {(task["stage"], task["kind"]): task["median"] for task in summary["tasks"]}
    table = Table(title="median task time, ms")
    for column in ("stage", *kinds):
        table.add_column(column, justify="right")
    for stage in sorted({stage for stage, _ in medians}):
        table.add_row(str(stage), *(_ms(medians[(stage, kind)], "") if (stage, kind) in medians else "-"
                                    for kind in kinds))
    return table


def trace_tables(summary: dict) -> list[Table]:
    """The tables ``pipeloom trace`` prints for a :func:`~pipeloom.trace.trace_summary`."""
    return [_summary_table(summary), _rank_table(summary), _task_table(summary)]


def cmd_trace(args: argparse.Namespace) -> int:
    """``pipeloom trace``: read one run's trace files, compare, write the files, print the report."""
    for path in args.paths:  # before any work
        if not path.exists():
            raise UsageError(f"{str(path)!r} does not exist; pass a trace folder or its rank*.json files")
    run = load_run_trace(args.paths)
    try:
        comparison = compare_run(run, steps=args.steps, step=args.step)
    except StepSelectionError as error:
        raise UsageError(f"--step: {error}") from None
    written = []
    if args.out:  # files first: a failed write leaves stdout empty
        write_merged_trace(comparison, target(args, args.out))
        written.append(f"wrote merged trace {args.out} (open it in https://ui.perfetto.dev)")
    if args.png:
        draw_measured(comparison, target(args, args.png))
        written.append(f"wrote picture {args.png}")
    summary = trace_summary(comparison)
    console = report_console(stderr=args.json)
    if args.json:
        print(json.dumps(summary))
    else:
        for table in trace_tables(summary):
            console.print(table)
    for message in [*summary["notes"], *written]:
        console.print(message, markup=False, soft_wrap=True)
    return 0
