"""The timeline picture: one row per rank, one box per action at its simulated start and end.

A lowered schedule's communication is drawn in a thin lane under each rank's boxes: a bar while a
send or a receive takes time, a tick where it takes none (sends black, receives vermillion).

Boxes are drawn as one ``PolyCollection`` per (kind, stage shade), so a 64-rank, 1024-micro-batch
schedule (131k boxes) draws in seconds; labels are added only where they fit. matplotlib is
imported inside the functions (Agg canvas, no pyplot state), never at ``import pipeloom.viz``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeloom.ir import Comm, compute_parts
from pipeloom.sim import Timeline
from pipeloom.viz.style import (
    COMM_COLORS,
    COMM_NAMES,
    IDLE_COLOR,
    KIND_COLORS,
    KIND_NAMES,
    STAGE_LIGHTEN,
    action_kind,
    action_label,
    action_stage,
    kinds_present,
    lighten,
    summary,
    text_color,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "FIGURE_SUFFIXES",
    "check_figure_path",
    "figure_for_panels",
    "legend_rows_of",
    "plot_timeline",
    "add_legend",
    "save_figure",
    "timeline_figure",
    "draw_timeline",
]

FIGURE_SUFFIXES = (".png", ".svg")
"""File suffixes the pictures can be written as."""

DPI = 100
_WIDTH_IN = 14.0  # figure width, inches
_LEFT_IN, _RIGHT_IN = 0.85, 0.3  # room for the rank labels / right edge
_HEADING_IN = 0.4  # the overall title, when one is given
_PANEL_TITLE_IN = 0.45  # each panel's summary line
_BOTTOM_IN = 0.8  # x tick labels, axis label and legend
_LEGEND_ROW_IN = 0.25  # each legend row beyond the first (a lowered schedule's legend takes two)
_BAR = 0.8  # box height as a fraction of the row
_COMM_LANE = 0.2  # of the row: the bottom of the box band taken by communication in a lowered schedule
_COMM_GAP = 0.04  # of the row: between the compute boxes and the communication lane
_MAX_LABELS = 3000  # more labels than this cannot be read anyway and slow the drawing
_MIN_FONT_PT = 4.0
_RASTER_ABOVE = 5000  # boxes in one collection beyond which SVG embeds them as an image
_SVG_RASTER_DPI = 200


def check_figure_path(path: str | Path) -> tuple[Path, str]:
    """``(path, "png" | "svg")``; ValueError naming the allowed suffixes for anything else."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FIGURE_SUFFIXES:
        raise ValueError(
            f"cannot draw {str(path)!r}: the picture format is chosen by the file suffix, "
            f"use one of {', '.join(FIGURE_SUFFIXES)}"
        )
    return path, suffix[1:]


def _row_height(total_ranks: int) -> float:
    """Inches per rank row: 0.36 for small pipelines, shrinking so big ones stay about 8 in tall."""
    return min(0.36, max(0.08, 8.0 / max(total_ranks, 1)))


def figure_for_panels(panel_ranks: Sequence[int], *, heading: bool,
                      legend_rows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure with one axes per panel, stacked top to bottom, heights proportional to ranks, and
    room for ``legend_rows`` legend rows at the bottom (see :func:`legend_rows_of`).

    The layout is fixed in inches (no layout engine), so the axes geometry is known before drawing
    and label sizes can be fitted to the boxes; the pixel size is ``figsize * DPI`` exactly.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    row = _row_height(sum(panel_ranks))
    heights = [max(n, 1) * row for n in panel_ranks]
    bottom = _BOTTOM_IN + (legend_rows - 1) * _LEGEND_ROW_IN
    total = (_HEADING_IN if heading else 0.15) + sum(heights) + len(heights) * _PANEL_TITLE_IN + bottom
    fig = Figure(figsize=(_WIDTH_IN, total), dpi=DPI)
    FigureCanvasAgg(fig)
    axes_list: list[Axes] = []
    top = total - (_HEADING_IN if heading else 0.15)
    for height in heights:
        top -= _PANEL_TITLE_IN
        rect = (
            _LEFT_IN / _WIDTH_IN,
            (top - height) / total,
            (_WIDTH_IN - _LEFT_IN - _RIGHT_IN) / _WIDTH_IN,
            height / total,
        )
        sharex = axes_list[0] if axes_list else None
        axes_list.append(fig.add_axes(rect, sharex=sharex))
        top -= height
    return fig, axes_list


def _boxes(timeline: Timeline) -> dict[tuple[str, int], list[tuple[float, float, int, str]]]:
    """Group every action into ``(kind, stage shade) -> [(start, end, rank, label), ...]``.

    The k-th stage a rank holds gets shade k; labels read ``mb``, or ``stage:mb`` on ranks that
    hold several stages.
    """
    groups: dict[tuple[str, int], list[tuple[float, float, int, str]]] = {}
    for rank in range(timeline.num_ranks):
        actions = timeline.schedule.ranks[rank]
        shade = {stage: k for k, stage in enumerate(sorted({action_stage(a) for a in actions if type(a) is not Comm}))}
        several = len(_stages(actions)) > 1
        for action, start, end in timeline.events(rank):
            if type(action) is Comm:
                continue
            label = action_label(action, stages=several)
            key = (action_kind(action), shade[action_stage(action)] % len(STAGE_LIGHTEN))
            groups.setdefault(key, []).append((start, end, rank, label))
    return groups


def _axes_size_pt(ax: Axes) -> tuple[float, float]:
    """Width and height of the axes in points (1/72 in), from its fixed position."""
    fig = ax.get_figure()
    width_in, height_in = fig.get_size_inches()
    box = ax.get_position()
    return box.width * width_in * 72.0, box.height * height_in * 72.0


def _font_size(label: str, width_pt: float, height_pt: float) -> float:
    """Largest font (<= 9 pt) whose label fits a box; 0 when below the readable minimum."""
    size = min(9.0, 0.6 * height_pt, width_pt / (0.62 * len(label) + 0.5))
    return size if size >= _MIN_FONT_PT else 0.0


def plot_timeline(ax: Axes, timeline: Timeline, *, xmax: float | None = None, labels: bool = True) -> None:
    """Draw ``timeline`` onto ``ax``: rank rows (rank 0 on top), kind-coloured boxes, summary title.

    ``xmax`` fixes the right end of the time axis (shared by comparison panels); labels (the
    micro-batch number) are drawn only where the font would be at least 4 pt.
    """
    import numpy as np
    from matplotlib.collections import PolyCollection

    xmax = xmax if xmax is not None else timeline.makespan
    xmax = xmax if xmax > 0 else 1.0
    num_ranks = max(timeline.num_ranks, 1)
    width_pt, height_pt = _axes_size_pt(ax)
    pt_per_time = width_pt / xmax
    lowered = timeline.schedule.lowered
    cut = _COMM_LANE + _COMM_GAP if lowered else 0.0  # compute boxes leave the lane at the bottom
    box_height_pt = height_pt / num_ranks * (_BAR - cut)
    groups = _boxes(timeline)
    texts: list[tuple[float, float, str, float, str]] = []
    for (kind, shade), items in sorted(groups.items()):
        color = lighten(KIND_COLORS[kind], STAGE_LIGHTEN[shade])
        data = np.array([(s, e, r) for s, e, r, _ in items], dtype=float).reshape(-1, 3)
        x0, x1, y = data[:, 0], data[:, 1], data[:, 2]
        verts = _quads(x0, x1, y - _BAR / 2, y + _BAR / 2 - cut)
        median_pt = float(np.median(x1 - x0)) * pt_per_time if len(items) else 0.0
        edge = 0.6 if median_pt >= 4.0 else 0.0
        boxes = PolyCollection(verts, facecolors=color, edgecolors="white", linewidths=edge)
        boxes.set_rasterized(len(items) > _RASTER_ABOVE)  # only affects SVG: an image, not 100k paths
        ax.add_collection(boxes, autolim=False)
        if labels:
            ink = text_color(color)
            for start, end, rank, label in items:
                size = _font_size(label, (end - start) * pt_per_time, box_height_pt)
                if size:
                    texts.append(((start + end) / 2, rank - cut / 2, label, size, ink))
    if len(texts) <= _MAX_LABELS:
        for x, y, label, size, ink in texts:
            ax.text(x, y, label, ha="center", va="center", fontsize=size, color=ink, clip_on=True)
    if lowered:
        _plot_comms(ax, timeline)
    _style_axes(ax, timeline, xmax)


def _quads(x0, x1, y0, y1):
    """``(n, 4, 2)`` corners of the boxes ``[x0, x1] x [y0, y1]`` (numpy arrays or scalars for y)."""
    import numpy as np

    y0, y1 = np.broadcast_to(y0, np.shape(x0)), np.broadcast_to(y1, np.shape(x0))
    return np.stack([np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1),
                     np.stack([x1, y0], 1)], 1)


def _plot_comms(ax: Axes, timeline: Timeline) -> None:
    """The communication lane of each rank: bars where a send/receive takes time, ticks elsewhere."""
    import numpy as np
    from matplotlib.collections import LineCollection, PolyCollection

    marks: dict[str, tuple[list, list]] = {"send": ([], []), "receive": ([], [])}
    for rank in range(timeline.num_ranks):
        for action, start, end in timeline.events(rank):
            if type(action) is Comm:
                bars, ticks = marks["send" if action.is_send else "receive"]
                (bars if end > start else ticks).append((start, end, rank))
    for what, (bars, ticks) in marks.items():
        color = COMM_COLORS[what]
        if bars:
            data = np.array(bars, dtype=float)
            low = data[:, 2] + _BAR / 2
            verts = _quads(data[:, 0], data[:, 1], low - _COMM_LANE, low)
            ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors="none"), autolim=False)
        if ticks:
            segments = [[(x, r + _BAR / 2 - _COMM_LANE), (x, r + _BAR / 2)] for x, _, r in ticks]
            ax.add_collection(LineCollection(segments, colors=color, linewidths=0.8), autolim=False)


def _style_axes(ax: Axes, timeline: Timeline, xmax: float) -> None:
    """Rank tick labels, grey background for idle time, light time grid, summary title."""
    num_ranks = max(timeline.num_ranks, 1)
    ax.set_xlim(0, xmax)
    ax.set_ylim(num_ranks - 0.5, -0.5)
    step = math.ceil(num_ranks / 16)
    ticks = list(range(0, num_ranks, step))
    ax.set_yticks(ticks, [f"rank {r}" for r in ticks], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.set_facecolor(IDLE_COLOR)
    ax.grid(axis="x", color="white", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(summary(timeline), loc="left", fontsize=10)


def add_legend(fig: Figure, timelines: Sequence[Timeline]) -> None:
    """One legend for the figure: the kinds present, idle time, and the stage shading if used."""
    from matplotlib.patches import Patch

    present = {kind for timeline in timelines for kind in kinds_present(timeline)}
    handles: list[Any] = [
        Patch(facecolor=KIND_COLORS[kind], label=f"{kind}  {KIND_NAMES[kind]}")
        for kind in KIND_COLORS
        if kind in present
    ]
    if any(timeline.schedule.lowered for timeline in timelines):
        handles.extend(Patch(facecolor=COMM_COLORS[what], label=COMM_NAMES[what]) for what in COMM_COLORS)
    handles.append(Patch(facecolor=IDLE_COLOR, edgecolor="#999999", label="idle (bubble)"))
    if any(_holds_several_stages(timeline) for timeline in timelines):
        handles.append(
            Patch(facecolor=lighten(KIND_COLORS["F"], STAGE_LIGHTEN[1]),
                  label="lighter: later stage on the rank (labels stage:micro-batch)")
        )
    fig.legend(handles=handles, loc="lower center", ncol=math.ceil(len(handles) / legend_rows_of(timelines)),
               frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, 0.0))


def legend_rows_of(timelines: Sequence[Timeline]) -> int:
    """Rows :func:`add_legend` uses: 2 when a lowered schedule adds the communication marks, else 1."""
    return 2 if any(timeline.schedule.lowered for timeline in timelines) else 1


def _holds_several_stages(timeline: Timeline) -> bool:
    return any(len(_stages(actions)) > 1 for actions in timeline.schedule.ranks)


def _stages(actions) -> set[int]:
    """The stages a rank's actions run (both parts of an overlapped pair; a communication's own)."""
    return {part.stage for a in actions for part in (compute_parts(a) or (a,))}


def save_figure(fig: Figure, *, path: Path, fmt: str) -> None:
    """Write ``fig`` as PNG (``figsize * DPI`` pixels) or SVG (text kept as text, dense box sets
    embedded as a 200 dpi image)."""
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipeloom"}):
        if fmt == "svg":
            fig.savefig(path, format=fmt, dpi=_SVG_RASTER_DPI, metadata={"Date": None})
        else:
            fig.savefig(path, format=fmt, dpi=fig.dpi)


def timeline_figure(timeline: Timeline, *, title: str | None = None) -> Figure:
    """The matplotlib Figure :func:`draw_timeline` saves (one axes), e.g. for notebooks."""
    fig, (ax,) = figure_for_panels([timeline.num_ranks], heading=title is not None,
                                   legend_rows=legend_rows_of([timeline]))
    plot_timeline(ax, timeline)
    ax.set_xlabel("time", fontsize=9)
    if title is not None:
        fig.suptitle(title, fontsize=12, fontweight="bold", y=1 - 0.1 / fig.get_size_inches()[1], va="top")
    add_legend(fig, [timeline])
    return fig


def draw_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None) -> None:
    """Save the timeline picture of ``timeline`` to ``path`` (``.png`` or ``.svg``).

    One row per rank (rank 0 on top), one box per action at its simulated start/end coloured by
    kind, the micro-batch in each box that has room, bubbles as empty grey space, a legend, time
    on the x axis, and a title with the schedule name, makespan, bubble ratio and peak memory.
    """
    path, fmt = check_figure_path(path)
    save_figure(timeline_figure(timeline, title=title), path=path, fmt=fmt)
