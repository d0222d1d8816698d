"""The figure around the pictures: its size in inches for a number of rank rows and panels, the file
formats it is written as, and the limit on rank rows a picture holds. matplotlib is imported inside the
functions (Agg canvas, no pyplot state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeloom.errors import PipeloomError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["DPI", "FIGURE_SUFFIXES", "MAX_PICTURE_RANKS", "check_figure_path", "check_picture_ranks",
           "figure_for_panels", "save_figure"]

FIGURE_SUFFIXES = (".png", ".svg")
"""File suffixes the pictures can be written as."""

DPI = 100
_WIDTH_IN = 14.0  # figure width, inches
_LEFT_IN, _RIGHT_IN = 0.85, 0.3  # room for the rank labels / right edge
_HEADING_IN = 0.4  # the overall title, when one is given
_PANEL_TITLE_IN = 0.45  # each panel's summary line
_MEMORY_IN, _MEMORY_GAP_IN = 0.75, 0.06  # the memory panel under each timeline, and the gap above it
_BOTTOM_IN = 0.8  # x tick labels, axis label and the legend's first row
_LEGEND_ROW_IN = 0.25  # each legend row beyond the first
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


MAX_PICTURE_RANKS = 2048
"""Rank rows a timeline picture holds at most: rows stay 0.08 in tall from 100 ranks on, so 2,048 ranks are
already a 170-inch, 17,000-pixel figure (and 65,536 ranks run out of memory after half a minute)."""


def check_picture_ranks(ranks: int) -> None:
    """PipeloomError when a picture of ``ranks`` rank rows (all panels together) is above :data:`MAX_PICTURE_RANKS`."""
    if ranks > MAX_PICTURE_RANKS:
        raise PipeloomError(f"a timeline picture of {ranks:,} ranks is above the limit of {MAX_PICTURE_RANKS:,} "
                            "rank rows (it could not be read); draw fewer ranks, or leave the picture out")


def _row_height(total_ranks: int) -> float:
    """Inches per rank row: 0.36 for small pipelines, shrinking so big ones stay about 8 in tall."""
    return min(0.36, max(0.08, 8.0 / max(total_ranks, 1)))


def figure_for_panels(panel_ranks: Sequence[int], *, heading: bool | int, legend_rows: int = 1,
                      memory: bool = True) -> tuple[Figure, list[Axes], list[Axes]]:
    """A figure with one timeline axes per panel, stacked top to bottom, heights proportional to
    ranks, each with a memory axes under it (``memory``), room for ``heading`` title lines (True: one)
    and for ``legend_rows`` legend rows at
    the bottom (see :func:`legend_rows_of`). Returns ``(figure, timeline axes, memory axes)``; all
    share the x axis.

    The layout is fixed in inches (no layout engine), so the axes geometry is known before drawing
    and label sizes can be fitted to the boxes; the pixel size is ``figsize * DPI`` exactly.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    row = _row_height(sum(panel_ranks))
    heading_in = _HEADING_IN + 0.22 * (int(heading) - 1) if heading else 0.15
    heights = [max(n, 1) * row for n in panel_ranks]
    below = _MEMORY_GAP_IN + _MEMORY_IN if memory else 0.0
    bottom = _BOTTOM_IN + (legend_rows - 1) * _LEGEND_ROW_IN
    total = heading_in + sum(heights) + len(heights) * (_PANEL_TITLE_IN + below) + bottom
    fig = Figure(figsize=(_WIDTH_IN, total), dpi=DPI)
    FigureCanvasAgg(fig)
    axes_list: list[Axes] = []
    memory_list: list[Axes] = []
    left, width = _LEFT_IN / _WIDTH_IN, (_WIDTH_IN - _LEFT_IN - _RIGHT_IN) / _WIDTH_IN
    top = total - heading_in
    for height in heights:
        top -= _PANEL_TITLE_IN
        sharex = axes_list[0] if axes_list else None
        axes_list.append(fig.add_axes((left, (top - height) / total, width, height / total), sharex=sharex))
        top -= height
        if memory:
            top -= _MEMORY_GAP_IN
            memory_list.append(fig.add_axes((left, (top - _MEMORY_IN) / total, width, _MEMORY_IN / total),
                                            sharex=axes_list[0]))
            top -= _MEMORY_IN
    return fig, axes_list, memory_list



def save_figure(fig: Figure, *, path: Path, fmt: str) -> None:
    """Write ``fig`` as PNG (``figsize * DPI`` pixels) or SVG (text kept as text, dense box sets
    embedded as a 200 dpi image)."""
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipeloom"}):
        if fmt == "svg":
            fig.savefig(path, format=fmt, dpi=_SVG_RASTER_DPI, metadata={"Date": None})
        else:
            fig.savefig(path, format=fmt, dpi=fig.dpi)
