"""The interactive timeline view: one self-contained HTML file (inline script and style, no network)
with zoom, hover (action, start, end, memory after) and each rank's memory curve; the same view is
what a ``Schedule`` or ``Timeline`` shows in a notebook and what ``pipeloom serve`` draws.

Python prepares the data (:func:`timeline_data`: colours, labels and units as the pictures have them,
:mod:`pipeloom.viz.style`, :mod:`pipeloom.viz.memory`); ``static/timeline.js`` draws it on canvases.
"""

from __future__ import annotations

import html
import json
import uuid
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pipeloom.ir import Comm, Schedule
from pipeloom.sim import Timeline
from pipeloom.viz.style import (
    COMM_COLORS,
    COMM_NAMES,
    KIND_NAMES,
    action_kind,
    action_label,
    action_stage,
    kinds_present,
    real_microbatch,
    stage_color,
    summary,
    text_color,
)
from pipeloom.viz.units import COST_UNITS, Units

__all__ = ["NOTEBOOK_MAX_ACTIONS", "notebook_html", "static_asset", "timeline_data", "timeline_html", "write_html"]

NOTEBOOK_MAX_ACTIONS = 20_000
"""Most actions a notebook cell draws interactively (about 1 MB of data); a larger schedule shows its
summary line only (write it with :func:`write_html` instead)."""

@cache
def static_asset(name: str) -> str:
    """The text of ``pipeloom/viz/static/<name>`` (``timeline.js``, ``timeline.css``)."""
    return (resources.files("pipeloom.viz") / "static" / name).read_text(encoding="utf-8")


def _hex(color: tuple[float, ...]) -> str:
    return "#" + "".join(f"{round(255 * c):02X}" for c in color[:3])


def timeline_data(timeline: Timeline, *, units: Units = COST_UNITS, title: str | None = None) -> dict:
    """The JSON-ready data the script draws: per rank, columns ``start``, ``end``, ``mem`` (held right
    after the action starts), ``color`` (index into ``colors``), ``label`` (the real micro-batch, shown
    where it fits), ``text`` (the action's IR text, and its real micro-batch where that differs) and
    ``comm`` (1 for a send/receive); per rank a memory step curve ``[times, held]``; the legend."""
    from pipeloom.viz.memory import LIMIT_COLOR, rank_colors

    schedule = timeline.schedule
    number = real_microbatch(schedule)
    colors: list[str] = []
    color_index: dict[str, int] = {}

    def index_of(color: str) -> int:
        if color not in color_index:
            color_index[color] = len(colors)
            colors.append(color)
        return color_index[color]

    ranks = []
    for rank in range(timeline.num_ranks):
        actions = schedule.ranks[rank]
        order = {stage: k for k, stage in enumerate(sorted({action_stage(a) for a in actions if type(a) is not Comm}))}
        row: dict[str, list[Any]] = {
            "start": list(timeline.starts[rank]), "end": list(timeline.ends[rank]),
            "mem": list(timeline.memory[rank]), "color": [], "label": [], "text": [], "comm": []}
        for action in actions:
            if type(action) is Comm:
                row["color"].append(index_of(COMM_COLORS["send" if action.is_send else "receive"]))
                row["label"].append("")
                row["text"].append(str(action))
                row["comm"].append(1)
                continue
            row["color"].append(index_of(stage_color(action_kind(action), order[action_stage(action)])))
            label = action_label(action, stages=False, number=number)
            text = str(action)
            row["label"].append(label)
            row["text"].append(text if number is None else f"{text} (real micro-batch {label})")
            row["comm"].append(0)
        ranks.append(row)
    legend = [[f"{kind} {KIND_NAMES[kind]}", stage_color(kind, 0)] for kind in kinds_present(timeline)]
    if schedule.lowered:
        legend += [[COMM_NAMES[way], COMM_COLORS[way]] for way in ("send", "receive")]
    if schedule.problem.memory_limit is not None:
        legend.append(["memory limit", LIMIT_COLOR])
    memory = []
    for rank in range(timeline.num_ranks):
        curve = timeline.memory_curve(rank)
        memory.append([[t for t, _ in curve], [held for _, held in curve]])
    return {
        "title": title or "",
        "summary": summary(timeline, units),
        "units": {"time": units.time, "memory": units.memory},
        "makespan": timeline.makespan,
        "limit": schedule.problem.memory_limit,
        "lowered": schedule.lowered,
        "colors": colors,
        "textColors": [text_color(color) for color in colors],
        "rankColors": [_hex(color) for color in rank_colors(timeline.num_ranks)],
        "legend": legend,
        "ranks": ranks,
        "memory": memory,
    }


def _script_json(value: object) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>`` or ``<!--`` can close it)."""
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")


def _views(data: Sequence[dict]) -> tuple[str, str]:
    """(the views' container elements, the script rendering them)."""
    ids = [f"pipeloom-view-{uuid.uuid4().hex[:12]}" for _ in data]  # distinct on one notebook page
    divs = "\n".join(f'<div id="{i}" class="pipeloom-timeline"></div>' for i in ids)
    calls = "".join(f'PipeloomTimeline.render(document.getElementById("{i}"),d[{k}]);' for k, i in enumerate(ids))
    return divs, f"(function(){{var d={_script_json(list(data))};{calls}}})();"


def timeline_html(timelines: Timeline | Sequence[Timeline], *, title: str | None = None,
                  units: Units = COST_UNITS) -> str:
    """A whole HTML document showing each timeline (one for ``show``, several for ``compare``), the
    script and style inline: it opens from disk with no network."""
    timelines = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    names = [t.schedule.name for t in timelines]
    heading = title or ", ".join(names)
    divs, script = _views([timeline_data(t, units=units, title=t.schedule.name if len(timelines) > 1 else None)
                           for t in timelines])
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(heading)} - pipeloom</title>"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "script-src 'unsafe-inline'; style-src 'unsafe-inline'\">"
        f"<style>body{{margin:16px;font-family:system-ui,sans-serif}}\n{static_asset('timeline.css')}</style>"
        f"</head><body><h1 style=\"font-size:16px\">{html.escape(heading)}</h1>\n{divs}\n"
        f"<script>{static_asset('timeline.js')}</script><script>{script}</script></body></html>\n"
    )


def write_html(timelines: Timeline | Sequence[Timeline], path: str | Path, *, title: str | None = None,
               units: Units = COST_UNITS) -> None:
    """Write :func:`timeline_html` to ``path``."""
    Path(path).write_text(timeline_html(timelines, title=title, units=units), encoding="utf-8")


def notebook_html(item: Schedule | Timeline) -> str:
    """The notebook view of a schedule (simulated here) or timeline: the interactive view, or the
    summary line alone above :data:`NOTEBOOK_MAX_ACTIONS` actions or when the schedule cannot run."""
    from pipeloom.errors import PipeloomError
    from pipeloom.sim import simulate

    schedule = item.schedule if isinstance(item, Timeline) else item
    if schedule.num_actions > NOTEBOOK_MAX_ACTIONS:
        return (f"<pre>{html.escape(schedule.name)}: {schedule.num_ranks} ranks, {schedule.num_actions:,} actions "
                f"(above {NOTEBOOK_MAX_ACTIONS:,}: write it with pipeloom.viz.html.write_html)</pre>")
    try:
        timeline = item if isinstance(item, Timeline) else simulate(item)
    except PipeloomError as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"<pre>{html.escape(schedule.name)}: cannot simulate: {html.escape(first)}</pre>"
    divs, script = _views([timeline_data(timeline, title=schedule.name)])
    return (f"<style>{static_asset('timeline.css')}</style>{divs}"
            f"<script>{static_asset('timeline.js')}</script><script>{script}</script>")
