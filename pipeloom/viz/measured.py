"""Measured against predicted, drawn: one Perfetto trace holding a run's measured step above the
simulator's prediction, and the picture of both on one time axis. The analysis behind them (step and
task times, the prediction, the summary) is :mod:`pipeloom.trace`; its names still import from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeloom.trace.analysis import (
    Comparison,
)
from pipeloom.trace.explain import explain_ratio
from pipeloom.viz.perfetto import perfetto_events

__all__ = ["draw_measured", "merged_trace_events", "write_merged_trace"]

_US_PER_S = 1_000_000  # trace.py's time_unit_us for timelines in seconds: ts in real microseconds


def _relabel(events: list[dict], label: str, *, pid_offset: int, tid_offset: int,
             id_offset: int = 0) -> list[dict]:
    """trace.py's events moved to pids ``rank + pid_offset`` (named ``label rank N``), tids shifted
    by ``tid_offset`` and flow ids by ``id_offset``, so two timelines share one trace without colliding."""
    moved = []
    for event in events:
        event = {**event, "pid": event["pid"] + pid_offset}
        if "tid" in event:
            event["tid"] += tid_offset
        if "id" in event:
            event["id"] += id_offset
        if event["ph"] == "M" and event["name"] == "process_name":
            event["args"] = {"name": f"{label} {event['args']['name']}"}
        elif event["ph"] == "M" and event["name"] == "process_sort_index":
            event["args"] = {"sort_index": event["args"]["sort_index"] + pid_offset}
        moved.append(event)
    return moved


def _comm_events(comparison: Comparison, first_tid: int) -> list[dict]:
    """The measured step's waits and sends: one ``recv waits`` and one ``sends`` thread per rank."""
    run, origin = comparison.run, comparison.origin_ns
    i = run.steps.index(comparison.step)
    events: list[dict[str, Any]] = []
    for rank in range(run.world_size):
        for k, (kind, title) in enumerate((("wait", "recv waits"), ("send", "sends"))):
            tid = first_tid + 2 * rank + k
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": title}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": 1_000_000 + k}})
            for e in run.ranks[rank][i].of_kind(kind):
                ts = round((e.start_ns - origin) / 1000)
                events.append({"name": e.name, "cat": kind, "ph": "X", "pid": rank, "tid": tid, "ts": ts,
                               "dur": max(0, round((e.end_ns - origin) / 1000) - ts),
                               "args": {"start_ns": e.start_ns, "end_ns": e.end_ns}})
    return events


def merged_trace_events(comparison: Comparison) -> dict[str, Any]:
    """One Chrome/Perfetto trace: ``measured rank N`` processes (compute per stage as in
    :func:`~pipeloom.viz.perfetto_events`, plus recv-wait and send threads) above ``predicted rank N``
    ones; ts in microseconds, 0 = the start of the measured step and of the simulation."""
    p = comparison.run.world_size
    measured = _relabel(perfetto_events(comparison.measured, time_unit_us=_US_PER_S)["traceEvents"],
                        "measured", pid_offset=0, tid_offset=0)
    first_tid = 1 + max((e.get("tid", 0) for e in measured), default=0)
    comm = _comm_events(comparison, first_tid)
    flows = max((e["id"] for e in measured if "id" in e), default=0)
    predicted = _relabel(perfetto_events(comparison.predicted, time_unit_us=_US_PER_S)["traceEvents"],
                         "predicted", pid_offset=p, tid_offset=first_tid + 2 * p, id_offset=flows)
    return {
        "traceEvents": measured + comm + predicted,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "pipeloom",
            "schedule": comparison.run.schedule.name,
            "time_unit_us": _US_PER_S,
            "time_note": "ts and dur are microseconds; 0 = start of the measured step / of the simulation",
            "step_shown": comparison.step,
            "measured_step_time_s": comparison.measured_step_time,
            "predicted_step_time_s": comparison.predicted.makespan,
            "ratio": comparison.ratio,
        },
    }


def write_merged_trace(comparison: Comparison, path: str | Path) -> None:
    """Write :func:`merged_trace_events` as JSON; open it in https://ui.perfetto.dev."""
    trace = merged_trace_events(comparison)
    Path(path).write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False) + "\n")


def draw_measured(comparison: Comparison, path: str | Path) -> None:
    """Save the measured step above the predicted one on one time axis (seconds), PNG or SVG, with
    the ratio and what the prediction left out (:func:`~pipeloom.trace.explain_ratio`) on top."""
    from pipeloom.viz.compare import comparison_figure
    from pipeloom.viz.figure import check_figure_path, save_figure
    from pipeloom.viz.units import MEASURED_UNITS

    path, fmt = check_figure_path(path)
    run = comparison.run
    first, *left_out = explain_ratio(comparison)
    head = first.split(":", 1)[0]
    title = "\n".join([f"{run.schedule.name}, p={run.world_size}, m={run.schedule.num_microbatches}: measured step "
                        f"{comparison.step} vs predicted from median task times ({head}); per step, the "
                        "prediction leaves out:", *(line[2:] for line in left_out)])
    fig = comparison_figure([comparison.measured, comparison.predicted], title=title, units=MEASURED_UNITS)
    for text in fig.texts:  # the heading: its first line bold, the explanation plain and smaller
        text.set_fontweight("normal")
        text.set_fontsize(9)
    save_figure(fig, path=path, fmt=fmt)
