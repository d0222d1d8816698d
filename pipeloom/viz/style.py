"""Colours, names and summary text shared by every view of a timeline (pictures, terminal, trace).

The palette is Okabe-Ito (distinguishable with the common colour-vision deficiencies); one colour
per action kind, used identically by the PNG/SVG pictures and the rich terminal view.
"""

from __future__ import annotations

from pipeloom.ir import Action, Overlap
from pipeloom.sim import Timeline

__all__ = [
    "COMM_COLORS",
    "COMM_NAMES",
    "KIND_COLORS",
    "KIND_NAMES",
    "IDLE_COLOR",
    "STAGE_LIGHTEN",
    "OVERLAP_KIND",
    "action_kind",
    "action_label",
    "action_stage",
    "kinds_present",
    "lighten",
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


def action_label(action: Action | Overlap, *, stages: bool) -> str:
    """A box's label: the micro-batch (``stage:mb`` when ``stages``); a pair ``F7|B3`` (``0:7|7:3``)."""
    if type(action) is Overlap:
        f, b = action.forward, action.backward
        if stages:
            return f"{f.stage}:{f.microbatch}|{b.stage}:{b.microbatch}"
        return f"F{f.microbatch}|{b.kind}{b.microbatch}"
    return f"{action.stage}:{action.microbatch}" if stages else str(action.microbatch)

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

STAGE_LIGHTEN: tuple[float, ...] = (0.0, 0.45, 0.25, 0.6)
"""How much the k-th stage held by a rank is mixed with white (cycled for k >= 4)."""


def kinds_present(timeline: Timeline) -> list[str]:
    """The action kinds that occur in the timeline's schedule, in F, B, I, W, O order."""
    seen = {task.kind for task in timeline.schedule.problem.tasks}
    if any(type(a) is Overlap for actions in timeline.schedule.ranks for a in actions):
        seen.add(OVERLAP_KIND)
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


def summary(timeline: Timeline) -> str:
    """``"1f1b: makespan 33, bubble 27.3%, peak memory 4"`` — the line every view shows."""
    return (
        f"{timeline.schedule.name}: makespan {timeline.makespan:.4g}, "
        f"bubble {timeline.bubble_ratio:.1%}, peak memory {peak(timeline):.4g}"
    )
