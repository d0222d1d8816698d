"""Colours, names, micro-batch numbers and summary text shared by every view of a timeline
(pictures, terminal, trace).

The kind colours are Okabe-Ito (distinguishable with the common colour-vision deficiencies), used
identically by the PNG/SVG pictures and the rich terminal view; a rank's second stage gets a hue of
its own next to its kind's (blue/indigo forwards, orange/brick backwards, ...), later ones lighter.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeloom.ir import Action, Comm, Overlap, Schedule
from pipeloom.sim import Timeline
from pipeloom.viz.units import COST_UNITS, Units, format_memory, format_time

__all__ = [
    "COMM_COLORS",
    "COMM_NAMES",
    "KIND_COLORS",
    "KIND_NAMES",
    "IDLE_COLOR",
    "STAGE_HUES",
    "OVERLAP_KIND",
    "action_kind",
    "action_label",
    "action_stage",
    "kinds_present",
    "lighten",
    "real_microbatch",
    "stage_color",
    "text_color",
    "peak",
    "summary",
]

KIND_COLORS: dict[str, str] = {
    "F": "#0072B2",  # blue
    "B": "#E69F00",  # orange
    "I": "#009E73",  # bluish green
    "W": "#CC79A7",  # reddish purple
    "O": "#56B4E9",  # sky blue: an overlapped F&B pair
}
"""Fill colour of each action kind (Okabe-Ito); ``O`` is an overlapped pair's."""

KIND_NAMES: dict[str, str] = {
    "F": "forward",
    "B": "backward",
    "I": "input-grad backward",
    "W": "weight-grad backward",
    "O": "overlapped F&B pair",
}
"""Legend words for each action kind."""

OVERLAP_KIND = "O"
"""The kind letter the views give an overlapped pair (one box of its own colour)."""


def action_kind(action: Action | Overlap) -> str:
    """The kind a view draws: the action's, or ``O`` for an overlapped pair."""
    return OVERLAP_KIND if type(action) is Overlap else action.kind


def action_stage(action: Action | Overlap) -> int:
    """The stage a view files the action under: its own, or a pair's forward stage."""
    return action.forward.stage if type(action) is Overlap else action.stage


def action_label(action: Action | Overlap, *, stages: bool,
                 number: Callable[[int, int], int] | None = None) -> str:
    """A box's label: the micro-batch (``stage:mb`` when ``stages``); a pair ``F7|B3`` (``0:7|7:3``).

    ``number(stage, mb)`` gives the micro-batch shown (:func:`real_microbatch`; default the IR's)."""
    show = number or (lambda stage, microbatch: microbatch)
    if type(action) is Overlap:
        f, b = action.forward, action.backward
        if stages:
            return f"{f.stage}:{show(f.stage, f.microbatch)}|{b.stage}:{show(b.stage, b.microbatch)}"
        return f"F{show(f.stage, f.microbatch)}|{b.kind}{show(b.stage, b.microbatch)}"
    mb = show(action.stage, action.microbatch)
    return f"{action.stage}:{mb}" if stages else str(mb)


def real_microbatch(schedule: Schedule) -> Callable[[int, int], int] | None:
    """``number(stage, ir_mb) -> real micro-batch`` for a schedule of c > 1 model replicas (DualPipe,
    Chimera), None for one replica.

    The replicas are the connected components of the stage graph, ordered by their first stage, all of
    one size; IR micro-batch m of component j is real micro-batch ``c * m + j``, as the runtime feeds
    them (:mod:`pipeloom.runtime.program`): ``7:0`` of DualPipe on 4 ranks (up replica) is real 1.
    """
    problem = schedule.problem
    parent = list(range(problem.num_stages))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for task in problem.tasks:
        for stage, _ in task.deps:
            parent[find(stage)] = find(task.stage)
    groups: dict[int, list[int]] = {}
    for stage in range(problem.num_stages):
        groups.setdefault(find(stage), []).append(stage)
    components = sorted(groups.values(), key=lambda group: group[0])
    if len(components) < 2 or len({len(group) for group in components}) != 1:
        return None
    replica = {stage: j for j, group in enumerate(components) for stage in group}
    count = len(components)
    return lambda stage, microbatch: count * microbatch + replica[stage]


COMM_COLORS: dict[str, str] = {
    "send": "#000000",  # black
    "receive": "#D55E00",  # vermillion
}
"""Colour of the communication marks of a lowered schedule (Okabe-Ito, apart from the kinds')."""

COMM_NAMES: dict[str, str] = {
    "send": "send",
    "receive": "receive (waiting for data)",
}
"""Legend words for the communication marks."""

IDLE_COLOR = "#EEEEEE"
"""Background of the rank rows, so that bubbles read as empty grey space."""

STAGE_HUES: dict[str, tuple[str, str]] = {
    "F": ("#0072B2", "#3B4CC0"),  # blue, indigo
    "B": ("#E69F00", "#A6461A"),  # orange, brick
    "I": ("#009E73", "#7A8F00"),  # bluish green, olive
    "W": ("#CC79A7", "#A24BB5"),  # reddish purple, violet
    "O": ("#56B4E9", "#8172B3"),  # sky blue, muted violet
}
"""The colours of the first and second stage a rank holds, per kind: two hues (the first is the kind's
:data:`KIND_COLORS`); the third and fourth stage are these mixed half with white, and so on."""


def stage_color(kind: str, k: int) -> str:
    """Colour of a ``kind`` box of the k-th stage (0-based) its rank holds: see :data:`STAGE_HUES`."""
    hues = STAGE_HUES[kind]
    return lighten(hues[k % 2], min(0.7, 0.45 * (k // 2)))


def kinds_present(timeline: Timeline) -> list[str]:
    """The action kinds that occur in the timeline's schedule, in F, B, I, W, O order (a ``B`` on a
    split stage counts as B)."""
    seen = {action_kind(action) for actions in timeline.schedule.ranks for action in actions
            if type(action) is not Comm}
    return [kind for kind in KIND_COLORS if kind in seen]


def _rgb(color: str) -> tuple[float, float, float]:
    """``#RRGGBB`` -> floats in [0, 1]."""
    return tuple(int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def lighten(color: str, amount: float) -> str:
    """``color`` mixed with white: 0 keeps it, 1 gives white."""
    mixed = (c + (1.0 - c) * amount for c in _rgb(color))
    return "#" + "".join(f"{round(255 * c):02X}" for c in mixed)


def text_color(color: str) -> str:
    """Black or white, whichever has the higher WCAG contrast on ``color`` (luminance 0.179 splits them)."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in _rgb(color)]
    luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    return "#000000" if luminance > 0.179 else "#FFFFFF"


def peak(timeline: Timeline) -> float:
    """Peak held memory, maximum over ranks."""
    return max(timeline.peak_memory, default=0.0)


def summary(timeline: Timeline, units: Units = COST_UNITS) -> str:
    """``"1f1b: makespan 33, bubble 27.3%, peak memory 4"`` — the line every view shows, numbers as the
    tables write them (``1,456,749``; ``12.345 ms`` and ``85.5 MiB`` in seconds and bytes)."""
    return (
        f"{timeline.schedule.name}: makespan {format_time(timeline.makespan, units)}, "
        f"bubble {timeline.bubble_ratio:.1%}, peak memory {format_memory(peak(timeline), units)}"
    )
