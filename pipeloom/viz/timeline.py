"""The timeline picture: one row per rank, one box per action at its simulated start and end, and
under it each rank's memory held over time (with the memory limit).

Boxes take their kind's colour, a hue of their own for a rank's second stage (:func:`stage_color`),
and a label that adapts to the room: ``stage:micro-batch`` where that fits, else the micro-batch,
else none (the legend says which); two-replica schedules show real micro-batch numbers. A lowered
schedule's communication is drawn in a thin lane under each rank's boxes: a bar while a send or a
receive takes time, a tick where it takes none (sends black, receives vermillion).

Boxes are drawn as one ``PolyCollection`` per colour; where the typical box is under two pixels wide
the rows are drawn as a coverage image instead (:mod:`pipeloom.viz.dense`), so a 512-micro-batch
plan does not alias into stripes. Times carry their unit (:class:`~pipeloom.viz.units.Units`) and
numbers are written as the tables write them. matplotlib is imported inside the functions (Agg
canvas, no pyplot state), never at ``import pipeloom.viz``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeloom.formatting import format_number, time_scale
from pipeloom.ir import Comm, compute_parts
from pipeloom.sim import Timeline
from pipeloom.viz.figure import DPI, check_figure_path, check_picture_ranks, figure_for_panels, save_figure
from pipeloom.viz.memory import LIMIT_COLOR, plot_memory, rank_colors
from pipeloom.viz.style import (
    COMM_COLORS,
    COMM_NAMES,
    IDLE_COLOR,
    KIND_COLORS,
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

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "LABEL_MODES",
    "legend_rows_of",
    "plot_timeline",
    "add_legend",
    "style_time_axis",
    "timeline_figure",
    "draw_timeline",
]

LABEL_MODES: dict[str, str] = {
    "full": "labels: stage:micro-batch",
    "microbatch": "labels: micro-batch",
    "none": "no labels: boxes too narrow",
}
"""What :func:`plot_timeline` returns and the legend says about the box labels."""

_LEGEND_COLUMNS = 4
_BAR = 0.8  # box height as a fraction of the row
_COMM_LANE = 0.2  # of the row: the bottom of the box band taken by communication in a lowered schedule
_COMM_GAP = 0.04  # of the row: between the compute boxes and the communication lane
_MAX_LABELS = 3000  # more labels than this cannot be read anyway and slow the drawing
_MIN_FONT_PT = 4.0
_LABELLED_SHARE = 0.5  # a label form is used when at least this share of the boxes fit it
_DENSE_PX = 2.0  # median box width (pixels) under which the rows are drawn as a coverage image
_RASTER_ABOVE = 5000  # boxes in one collection beyond which SVG embeds them as an image


Box = tuple[float, float, int, str, str]
LabelField = Literal[3, 4]  # the index of a box's full label or its micro-batch label
"""``(start, end, rank, full label, micro-batch label)`` of one compute action."""


def _boxes(timeline: Timeline) -> dict[tuple[str, int], list[Box]]:
    """Group every compute action into ``(kind, k) -> boxes``, k the index of its stage among those
    its rank holds (which picks the hue, :func:`stage_color`).

    The full label reads ``stage:mb`` on ranks that hold several stages, ``mb`` elsewhere; the
    micro-batch is the real one for a two-replica schedule (:func:`real_microbatch`).
    """
    number = real_microbatch(timeline.schedule)
    groups: dict[tuple[str, int], list[Box]] = {}
    for rank in range(timeline.num_ranks):
        actions = timeline.schedule.ranks[rank]
        index = {stage: k for k, stage in enumerate(sorted({action_stage(a) for a in actions if type(a) is not Comm}))}
        several = len(_stages(actions)) > 1
        for action, start, end in timeline.events(rank):
            if type(action) is Comm:
                continue
            short = action_label(action, stages=False, number=number)
            full = action_label(action, stages=True, number=number) if several else short
            groups.setdefault((action_kind(action), index[action_stage(action)]), []).append(
                (start, end, rank, full, short))
    return groups


def _axes_size_pt(ax: Axes) -> tuple[float, float]:
    """Width and height of the axes in points (1/72 in), from its fixed position."""
    from matplotlib.figure import Figure

    fig = ax.get_figure()
    assert isinstance(fig, Figure), "axes of a top-level figure (a SubFigure has no size of its own)"
    width_in, height_in = fig.get_size_inches()
    box = ax.get_position()
    return box.width * width_in * 72.0, box.height * height_in * 72.0


def _font_size(label: str, width_pt: float, height_pt: float) -> float:
    """Largest font (<= 9 pt) whose label fits a box; 0 when below the readable minimum."""
    size = min(9.0, 0.6 * height_pt, width_pt / (0.62 * len(label) + 0.5))
    return size if size >= _MIN_FONT_PT else 0.0


def _label_mode(boxes: list[Box], pt_per_time: float, height_pt: float, several: bool) -> str:
    """``full`` when at least half the boxes fit their full label (ranks with several stages),
    else ``microbatch`` when half fit the micro-batch alone, else ``none``."""
    if not boxes:
        return "none"
    forms: tuple[tuple[str, LabelField], ...] = ((("full", 3), ("microbatch", 4)) if several
                                                  else (("microbatch", 4),))
    for mode, field in forms:
        fits = sum(1 for box in boxes if _font_size(box[field], (box[1] - box[0]) * pt_per_time, height_pt))
        if fits >= _LABELLED_SHARE * len(boxes) and fits <= _MAX_LABELS:
            return mode
    return "none"


def plot_timeline(ax: Axes, timeline: Timeline, *, xmax: float | None = None, labels: bool = True,
                  units: Units = COST_UNITS) -> str:
    """Draw ``timeline`` onto ``ax``: rank rows (rank 0 on top), coloured boxes, summary title.

    ``xmax`` fixes the right end of the time axis (shared by comparison panels). Returns the label
    mode (a key of :data:`LABEL_MODES`): labels are drawn in that form where the font would be at
    least 4 pt.
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
    every = [box for items in groups.values() for box in items]
    widths_px = [(end - start) * pt_per_time * DPI / 72 for start, end, *_ in every]
    dense = bool(widths_px) and float(np.median(widths_px)) < _DENSE_PX
    several = _holds_several_stages(timeline)
    mode = "none" if dense or not labels else _label_mode(every, pt_per_time, box_height_pt, several)
    if dense:
        _plot_dense(ax, timeline, groups, xmax=xmax, width_px=round(width_pt * DPI / 72), cut=cut)
    else:
        for (kind, k), items in sorted(groups.items()):
            color = stage_color(kind, k)
            data = np.array([box[:3] for box in items], dtype=float).reshape(-1, 3)
            x0, x1, y = data[:, 0], data[:, 1], data[:, 2]
            verts = _quads(x0, x1, y - _BAR / 2, y + _BAR / 2 - cut)
            median_pt = float(np.median(x1 - x0)) * pt_per_time if len(items) else 0.0
            boxes = PolyCollection(verts, facecolors=color, edgecolors="white",
                                   linewidths=0.6 if median_pt >= 4.0 else 0.0)
            boxes.set_rasterized(len(items) > _RASTER_ABOVE)  # only affects SVG: an image, not 100k paths
            ax.add_collection(boxes, autolim=False)
            if mode != "none":
                _plot_labels(ax, items, field=3 if mode == "full" else 4, ink=text_color(color),
                             pt_per_time=pt_per_time, height_pt=box_height_pt, y_shift=-cut / 2)
        if lowered:
            _plot_comms(ax, timeline)
    _style_axes(ax, timeline, xmax, units)
    return mode


def _plot_labels(ax: Axes, items: list[Box], *, field: LabelField, ink: str, pt_per_time: float,
                 height_pt: float, y_shift: float) -> None:
    """The ``field`` label of every box in ``items`` that has room for it."""
    for box in items:
        start, end, rank, label = box[0], box[1], box[2], box[field]
        size = _font_size(label, (end - start) * pt_per_time, height_pt)
        if size:
            ax.text((start + end) / 2, rank + y_shift, label, ha="center", va="center", fontsize=size,
                    color=ink, clip_on=True)


def _plot_dense(ax: Axes, timeline: Timeline, groups: dict[tuple[str, int], list[Box]], *, xmax: float,
                width_px: int, cut: float) -> None:
    """Every rank's boxes (and communication lane) as one coverage image (:mod:`pipeloom.viz.dense`)."""
    from matplotlib.colors import to_rgb

    from pipeloom.viz.dense import coverage_image

    top, bottom = -_BAR / 2, _BAR / 2 - cut
    layers = [(to_rgb(stage_color(kind, k)), top, bottom, [box[:3] for box in items])
              for (kind, k), items in sorted(groups.items())]
    comm_layers = []
    if timeline.schedule.lowered:
        marks: dict[str, list] = {"send": [], "receive": []}
        for rank in range(timeline.num_ranks):
            for action, start, end in timeline.events(rank):
                if type(action) is Comm:
                    marks["send" if action.is_send else "receive"].append((start, end, rank))
        comm_layers = [(to_rgb(COMM_COLORS[what]), _BAR / 2 - _COMM_LANE, _BAR / 2, items)
                       for what, items in marks.items()]
    image = coverage_image(layers, num_ranks=timeline.num_ranks, xmax=xmax, width=width_px)
    if comm_layers:
        lane = coverage_image(comm_layers, num_ranks=timeline.num_ranks, xmax=xmax, width=width_px, min_width=0.5)
        image = image + lane * (lane[..., 3:] > 0)  # the lane rows hold no compute
    ax.imshow(image, extent=(0, xmax, timeline.num_ranks - 0.5, -0.5), aspect="auto", interpolation="nearest",
              origin="upper", zorder=2)


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


def style_time_axis(ax: Axes, *, xmax: float, units: Units, label: bool = True) -> None:
    """Tick labels written as the tables write numbers (no ``1e6`` offset), seconds scaled to s/ms/us,
    and the axis label with the unit: ``time (cost units)`` or ``time (ms)``."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    factor, name = time_scale(xmax) if units.time == "seconds" else (1.0, "cost units")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, steps=[1, 2, 2.5, 5, 10]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: format_number(value / factor)))
    if label:
        ax.set_xlabel(f"time ({name})", fontsize=9)


def _style_axes(ax: Axes, timeline: Timeline, xmax: float, units: Units) -> None:
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
    style_time_axis(ax, xmax=xmax, units=units, label=False)
    ax.set_title(summary(timeline, units), loc="left", fontsize=10)


def _legend_handles(timelines: Sequence[Timeline], modes: Sequence[str] | None, units: Units) -> list[Any]:
    """The legend's entries: the kinds (a swatch per stage hue a rank uses), communication, idle,
    memory and its limit, the box labels' form (``modes``; None: a placeholder of the same size)."""
    from matplotlib.legend_handler import HandlerTuple  # noqa: F401 (used through the tuple handles)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    present = {kind for timeline in timelines for kind in kinds_present(timeline)}
    hues = max((len(_stages(actions)) for t in timelines for actions in t.schedule.ranks), default=1)
    hues = max(1, min(hues, 4))
    handles: list[Any] = [
        (tuple(Patch(facecolor=stage_color(kind, k)) for k in range(hues)), f"{kind}  {KIND_NAMES[kind]}")
        for kind in KIND_COLORS if kind in present
    ]
    if hues > 1:
        ordinals = ", ".join(("1st", "2nd", "3rd", "4th")[:hues])
        handles.append((Patch(facecolor="none", edgecolor="none"), f"swatches: a rank's {ordinals} stage"))
    if any(timeline.schedule.lowered for timeline in timelines):
        handles.extend((Patch(facecolor=COMM_COLORS[what]), COMM_NAMES[what]) for what in COMM_COLORS)
    handles.append((Patch(facecolor=IDLE_COLOR, edgecolor="#999999"), "idle (bubble)"))
    colors = rank_colors(max(t.num_ranks for t in timelines))
    what = " (micro-batches)" if units.memory == "cost" else ""
    handles.append((tuple(Line2D([], [], color=c) for c in (colors[0], colors[-1])),
                    f"memory per rank{what}, rank 0 darkest"))
    if any(t.schedule.problem.memory_limit is not None for t in timelines):
        handles.append((Line2D([], [], color=LIMIT_COLOR, linestyle="--"), "memory limit"))
    handles.append((Patch(facecolor="none", edgecolor="none"), _labels_text(timelines, modes)))
    return handles


def _labels_text(timelines: Sequence[Timeline], modes: Sequence[str] | None) -> str:
    """What the box labels show: one form for all panels, or each panel's on its title's right."""
    if modes is None or len(set(modes)) > 1:
        return "labels: see each panel's right"
    text = LABEL_MODES[modes[0]]
    if modes[0] != "none" and any(real_microbatch(t.schedule) for t in timelines):
        text += " (real micro-batches)"
    return text


def add_legend(fig: Figure, timelines: Sequence[Timeline], *, modes: Sequence[str] | None = None,
               units: Units = COST_UNITS) -> None:
    """One legend for the figure (see :func:`_legend_handles`); ``modes``: what each panel's
    :func:`plot_timeline` returned. Panels whose label forms differ say theirs on the right."""
    from matplotlib.legend_handler import HandlerTuple

    handles = _legend_handles(timelines, modes, units)
    if modes is not None and len(set(modes)) > 1:
        for ax, mode in zip([a for a in fig.axes if a.get_title(loc="left")], modes):
            ax.set_title(LABEL_MODES[mode], loc="right", fontsize=8, color="#555555")
    fig.legend([h for h, _ in handles], [label for _, label in handles], loc="lower center",
               ncol=math.ceil(len(handles) / legend_rows_of(timelines, units=units)), frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, 0.0), handlelength=2.6, handler_map={tuple: HandlerTuple(ndivide=None, pad=0.0)})


def legend_rows_of(timelines: Sequence[Timeline], *, units: Units = COST_UNITS) -> int:
    """Rows :func:`add_legend` uses: its entries, :data:`_LEGEND_COLUMNS` to a row."""
    return math.ceil(len(_legend_handles(timelines, None, units)) / _LEGEND_COLUMNS)


def _holds_several_stages(timeline: Timeline) -> bool:
    return any(len(_stages(actions)) > 1 for actions in timeline.schedule.ranks)


def _stages(actions) -> set[int]:
    """The stages a rank's actions run (both parts of an overlapped pair; a communication's own)."""
    return {part.stage for a in actions for part in (compute_parts(a) or (a,))}


def panels_figure(timelines: Sequence[Timeline], *, title: str | None, units: Units,
                  xmax: float | None = None) -> Figure:
    """Timelines stacked on one time axis, each with its memory panel, a heading and one legend."""
    check_picture_ranks(sum(t.num_ranks for t in timelines))
    heading = 0 if title is None else title.count("\n") + 1
    fig, axes, memory_axes = figure_for_panels([t.num_ranks for t in timelines], heading=heading,
                                               legend_rows=legend_rows_of(timelines, units=units))
    xmax = xmax if xmax is not None else max(t.makespan for t in timelines)
    xmax = xmax if xmax > 0 else 1.0
    modes = [plot_timeline(ax, t, xmax=xmax, units=units) for ax, t in zip(axes, timelines)]
    for ax, t in zip(memory_axes, timelines):
        plot_memory(ax, t, units=units, xmax=xmax)
    for ax in [*axes, *memory_axes[:-1]]:
        ax.tick_params(axis="x", labelbottom=False)
    style_time_axis(memory_axes[-1], xmax=xmax, units=units)
    if title is not None:
        fig.suptitle(title, fontsize=12, fontweight="bold", y=1 - 0.1 / fig.get_size_inches()[1], va="top")
    add_legend(fig, timelines, modes=modes, units=units)
    return fig


def timeline_figure(timeline: Timeline, *, title: str | None = None, units: Units = COST_UNITS) -> Figure:
    """The matplotlib Figure :func:`draw_timeline` saves (the timeline axes, then its memory axes),
    e.g. for notebooks."""
    return panels_figure([timeline], title=title, units=units)


def draw_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None,
                  units: Units = COST_UNITS) -> None:
    """Save the timeline picture of ``timeline`` to ``path`` (``.png`` or ``.svg``).

    One row per rank (rank 0 on top), one box per action at its simulated start/end coloured by
    kind (a hue per stage a rank holds), labels where they fit, bubbles as empty grey space, each
    rank's memory held under it, a legend, time on the x axis in ``units`` (:data:`COST_UNITS`:
    ``time (cost units)``; :data:`~pipeloom.viz.units.PLAN_UNITS` for a plan: seconds and bytes),
    and a title with the schedule name, makespan, bubble ratio and peak memory.
    """
    path, fmt = check_figure_path(path)
    save_figure(timeline_figure(timeline, title=title, units=units), path=path, fmt=fmt)
